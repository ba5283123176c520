"""Compile once per block structure: the graph path's nested compile regions.

``torch.compile(model, fullgraph=True)`` of a sharded model traces each sharded block's call
(its gather, its forward and, in backward, its reduce-scatter) as a region, once per block
structure, and calls it again for the other blocks of that structure. A stack of blocks of
four structures — plain, a different plain attribute (a "sliding window"), frozen, and one
that keeps its parameters from forward to backward — two of each, trains beside our eager
engine and an unsharded replica (fp32: within 1e-5), with one region per structure, every
block's collectives inside its region, and no recompilation after the first step.

``aot_eager`` in the suite (``nox -s soak`` adds inductor, ``FULLY_SHARD_COMPILE_BACKENDS``);
a second instance's compilation reusing the first's inductor code is a soak case. The
structure key itself (``fully_shard.regions``) is checked without compiling.
"""

from __future__ import annotations

import copy
import functools
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fully_shard import fully_shard
from fully_shard.regions import block_structure
from harness import mesh_1d, run_distributed
from parity import loss_fn, param_diffs
from test_graph import _Graphs

STEPS = 3
BACKENDS = tuple(os.environ.get("FULLY_SHARD_COMPILE_BACKENDS", "aot_eager").split(","))
_OPS = torch.ops._c10d_functional


class _Block(nn.Module):
    """``x + down(tanh(up(x)))``; with ``window``, only the last ``window`` positions get the
    update (a plain attribute that changes what forward computes, as a sliding window does)."""

    def __init__(self, dim: int, hidden: int, window: int = 0) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)  # 7 rows: uneven over 2 ranks
        self.down = nn.Linear(hidden, dim, bias=False)
        self.window = window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.down(torch.tanh(self.up(x)))
        if self.window:
            keep = torch.arange(x.size(1), device=x.device) >= x.size(1) - self.window
            update = update * keep.unsqueeze(-1)
        return x + update


class _Stack(nn.Module):
    """Tokens (B, S) -> logits; one block per entry of ``kinds``, in order: by default blocks
    of four structures, two of each, interleaved."""

    KINDS = ("plain", "window", "frozen", "kept")

    def __init__(
        self, kinds: Sequence[str] = KINDS * 2, vocab: int = 13, dim: int = 8, hidden: int = 7
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.kinds = list(kinds)
        self.blocks = nn.ModuleList(
            _Block(dim, hidden, window=3 if kind == "window" else 0) for kind in self.kinds
        )
        for kind, block in zip(self.kinds, self.blocks, strict=True):
            if kind == "frozen":
                block.requires_grad_(False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # type: ignore[no-any-return]


def _shard(model: _Stack, regions: bool = True) -> None:
    mesh = mesh_1d()
    for kind, block in zip(model.kinds, model.blocks, strict=True):
        fully_shard(block, mesh=mesh, reshard_after_forward=kind != "kept")
    fully_shard(model, mesh=mesh)
    if not regions:
        model.set_compile_region(False)  # type: ignore[operator]


def _regions(gm: torch.fx.GraphModule) -> Counter[str]:
    """How many times each region body is called in ``gm``."""
    return Counter(
        n.args[0].target
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph
    )


def _ops_in(gm: torch.fx.GraphModule) -> Counter[str]:
    """The collectives of ``gm`` outside its regions, and those inside each call of one."""
    found: Counter[str] = Counter()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is torch.ops.higher_order.invoke_subgraph:
            found["in regions: " + ", ".join(sorted(_ops_in(getattr(gm, n.args[0].target))))] += 1
        elif n.target in (_OPS.all_gather_into_tensor.default, _OPS.all_to_all_single.default):
            found[n.target.__name__.split(".")[0]] += 1
    return found


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(0, 13, (4, 7), generator=torch.Generator().manual_seed(step))
    return seq[:, :-1], seq[:, 1:]


def _train(backend: str, regions: bool, kinds: Sequence[str] = _Stack.KINDS * 2) -> dict[str, Any]:
    """The stack compiled whole beside our eager engine and the unsharded replica, W=2."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _Stack(kinds)
    reference, eager = copy.deepcopy(model), copy.deepcopy(model)
    _shard(model, regions)
    _shard(eager)
    kept = _Graphs(backend)
    # Dynamo inlines a region called once; keep every region, so that each structure shows.
    with torch._dynamo.config.patch(inline_single_use_invoke_subgraph=False):
        run = torch.compile(model, backend=kept, fullgraph=True)
        rank = torch.distributed.get_rank()
        models = [(run, model), (eager, eager), (reference, reference)]
        optims = [
            torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for _, m in models
        ]
        frames = []
        for step in range(STEPS):
            tokens, targets = _batch(step)
            mine = slice(2 * rank, 2 * rank + 2)
            for (call, _), optim in zip(models, optims, strict=True):
                rows = slice(None) if call is reference else mine
                loss_fn(call(tokens[rows]), targets[rows]).backward()
                optim.step()
                optim.zero_grad()
            frames.append(len(kept.dynamo))
    return {
        "diffs": param_diffs(model, reference),
        "eager_diffs": param_diffs(model, eager),
        "frames": frames,
        "regions": [sorted(_regions(g).values()) for g in kept.dynamo],
        "fw": [_ops_in(g) for g in kept.fw],
        "bw": [_ops_in(g) for g in kept.bw],
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_region_per_block_structure_trains_exactly(backend: str) -> None:
    """Four structures, two blocks each: four regions, each called twice; every block's
    all-gather inside its region (and its reduce-scatter in the backward region); within
    1e-5 of our eager engine and the unsharded replica; compiled once."""
    for r in run_distributed(functools.partial(_train, backend, True), 2, timeout=300):
        assert max(r["diffs"]) < 1e-5, r["diffs"]
        assert max(r["eager_diffs"]) < 1e-5, r["eager_diffs"]
        assert r["frames"] == [1] * STEPS  # no recompilation at steps 2 and 3
        assert r["regions"] == [[2, 2, 2, 2]]
        if backend == "inductor":  # inductor compiles its own graphs: none kept to inspect
            continue
        (fw,), (bw,) = r["fw"], r["bw"]
        # Forward: the root's all-gather outside, one per block inside its region.
        assert fw == {"all_gather_into_tensor": 1, "in regions: all_gather_into_tensor": 8}, fw
        # Backward: the root's reduce-scatter outside (gloo: an all-to-all); in each block's
        # region its reduce-scatter, and the recomputed all-gather where the block reshards
        # after forward. The frozen blocks have nothing to reduce.
        regions = {k: v for k, v in bw.items() if k.startswith("in regions")}
        assert bw["all_to_all_single"] == 1, bw
        assert regions == {
            "in regions: all_gather_into_tensor, all_to_all_single": 4,  # plain, window
            "in regions: all_gather_into_tensor": 2,  # frozen: recomputed gather, no reduction
            "in regions: all_to_all_single": 2,  # kept: gathered in forward, saved
        }, regions


def test_regions_off_trace_every_block_inline() -> None:
    """``set_compile_region(False)``: no region, the same training; a block that reshards
    after forward and one that keeps its parameters (the two ways a region gathers) inline."""
    train = functools.partial(_train, "aot_eager", False, ("plain", "kept"))
    (r, _) = run_distributed(train, 2, timeout=300)
    assert max(r["diffs"]) < 1e-5 and max(r["eager_diffs"]) < 1e-5, r
    assert r["regions"] == [[]] and r["frames"] == [1] * STEPS


def _two_instances() -> dict[str, Any]:
    """Two instances of one structure (two plain blocks), each compiled, stepped in turn twice
    (W=1)."""
    torch._dynamo.reset()
    kept = _Graphs("aot_eager")
    runs, frames, losses = [], [], []
    for _ in range(2):
        torch.manual_seed(0)
        model = _Stack(("plain", "plain"))
        _shard(model)
        runs.append(torch.compile(model, backend=kept, fullgraph=True))
    tokens, targets = _batch(0)
    for run in (*runs, *runs):
        loss = loss_fn(run(tokens), targets)
        loss.backward()
        losses.append(loss.item())
        frames.append(kept.frames)
    return {"frames": frames, "losses": losses}


def test_a_second_instance_is_traced_once_more_and_neither_recompiles_after() -> None:
    """What a second instance of one structure costs today: one more dynamo trace (the
    frame's guards match each FSDPState, ParamGroup, comm and policy object by identity, so
    the first instance's trace is not reused), and then neither instance recompiles: the
    frame keeps both entries. Same seed, same batch: the same losses."""
    (r,) = run_distributed(_two_instances, 1, timeout=300)
    assert r["frames"] == [1, 2, 2, 2], r["frames"]
    assert len(set(r["losses"][:2])) == 1, r["losses"]


def _lengths() -> dict[str, Any]:
    """Three sequence lengths, W=1, two "window" blocks (one region, called twice; they read
    the length): the second length makes dynamo trace again with the length dynamic, which a
    region's key cannot hold (a symbolic size): those blocks run inline. The third reuses
    that trace."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Stack(("window", "window"))
    reference = copy.deepcopy(model)
    _shard(model)
    kept = _Graphs("aot_eager")
    run = torch.compile(model, backend=kept, fullgraph=True)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for seq in (6, 8, 10):
        g = torch.Generator().manual_seed(seq)
        tokens = torch.randint(0, 13, (2, seq + 1), generator=g)
        for call, optim in zip((run, reference), optims, strict=True):
            loss_fn(call(tokens[:, :-1]), tokens[:, 1:]).backward()
            optim.step()
            optim.zero_grad()
    return {
        "diffs": param_diffs(model, reference),
        "regions": [sum(_regions(g).values()) for g in kept.dynamo],
    }


def test_a_length_made_dynamic_runs_its_blocks_inline() -> None:
    (r,) = run_distributed(_lengths, 1, timeout=300)
    assert max(r["diffs"]) < 1e-5, r["diffs"]
    assert r["regions"] == [2, 0], r["regions"]  # static: 2 region calls; dynamic: inline


def _second_instance() -> dict[str, Any]:
    """Two instances of one structure compiled in turn, W=1, inductor: the second's dynamo
    and AOTAutograd trace again (the frame's guards hold our objects), its inductor graphs come
    from the first's (inductor's FX graph cache, in process)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    hits = []
    # An empty inductor cache (read from the environment at each lookup): a run before this
    # one, in this process or another, must not have left these graphs on disk.
    was = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="second_instance_")
    try:
        for _ in range(2):
            torch.manual_seed(0)
            model = _Stack()
            _shard(model)
            run = torch.compile(model, fullgraph=True)
            tokens, targets = _batch(0)
            loss_fn(run(tokens), targets).backward()
            hits.append(counters["inductor"]["fxgraph_cache_hit"])
    finally:
        if was is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = was
    return {"hits": hits}


@pytest.mark.skipif("inductor" not in BACKENDS, reason="inductor only (nox -s soak)")
def test_second_instance_reuses_the_first_ones_compiled_code() -> None:
    (r,) = run_distributed(_second_instance, 1, timeout=600)
    assert r["hits"][0] == 0 and r["hits"][1] >= 2, r  # forward and backward found again


class _Saving(nn.Module):
    """``tanh(lin(x))``: saves a view of its input (for the weight's gradient) and its own
    output (for tanh's), the two tensors a region's caller must not overwrite."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _Between(nn.Module):
    """Blocks with the caller's own work between them, before and after each call: the
    caller's buffers that inductor may reuse while a block's backward still needs them."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(_Saving() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h * 2.0 + 1.0) * 0.5 + h
        return h


def _grads_between(backend: str) -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Between()
    reference = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh_1d())
    fully_shard(model, mesh=mesh_1d())
    kept = _Graphs(backend)
    x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(1))
    rank = torch.distributed.get_rank()
    torch.compile(model, backend=kept, fullgraph=True)(x[2 * rank : 2 * rank + 2]).sum().backward()
    (reference(x).sum() / 2).backward()  # the mean of the two ranks' sums
    return {
        "grads": [
            (p.grad.full_tensor() - q.grad).abs().max().item()  # type: ignore[union-attr]
            for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        ],
        "regions": [sorted(_regions(g).values()) for g in kept.dynamo],
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_region_keeps_what_its_backward_reads_from_the_caller(backend: str) -> None:
    """A block that saves a view of its input and its own output, with the caller computing
    on both sides of each call: exact gradients (inductor, torch 2.13.0, without the region's
    copies of its outputs: 1 to 4 apart, its caller computing in place on a returned tensor
    that the region had also saved; ``nox -s soak`` runs it with inductor)."""
    for r in run_distributed(functools.partial(_grads_between, backend), 2, timeout=300):
        assert r["regions"] == [[3]], r["regions"]  # one region, called by the three blocks
        assert max(r["grads"]) < 1e-5, r["grads"]


# -- the structure key, without compiling ---------------------------------------------------------


def _keys(*blocks: nn.Module) -> int:
    return len({block_structure(b) for b in blocks})


def test_copies_have_one_structure_and_differences_make_another() -> None:
    torch.manual_seed(0)
    block = _Block(8, 7)
    assert _keys(block, _Block(8, 7), copy.deepcopy(block)) == 1  # values are not structure
    assert _keys(block, _Block(8, 7, window=3)) == 2  # a plain attribute
    assert _keys(block, _Block(8, 6)) == 2  # a shape
    assert _keys(block, _Block(8, 7).requires_grad_(False)) == 2  # frozen
    assert _keys(block, _Block(8, 7).double()) == 2  # a dtype
    assert _keys(block, _Block(8, 7).eval()) == 2  # the training flag
    hooked = _Block(8, 7)
    hooked.up.register_forward_hook(lambda m, i, o: o * 2)
    assert _keys(block, hooked) == 2  # a hook inside the block


def test_functions_and_partials_compare_by_what_they_are() -> None:
    """A checkpoint_wrapper-style attribute (a partial of one function) or an activation is
    the same in every block; another object is equal only to itself."""

    def with_fn(fn: Any) -> nn.Module:
        block = _Block(8, 7)
        block.fn = fn  # type: ignore[assignment]
        return block

    def partial() -> Any:
        return functools.partial(checkpoint, use_reentrant=False)

    assert _keys(with_fn(partial()), with_fn(partial())) == 1
    assert _keys(with_fn(torch.tanh), with_fn(torch.tanh)) == 1
    assert _keys(with_fn(torch.tanh), with_fn(torch.relu)) == 2
    assert _keys(with_fn(object()), with_fn(object())) == 2
