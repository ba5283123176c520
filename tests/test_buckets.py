"""Buckets (``set_bucket_cap_mb``): consecutive groups share one all-gather and one reduce-scatter.

What they must do, checked here on a ``Transformer`` (root + one group per block):

- train like the unsharded model (``check_parity``, 3 AdamW steps) with buckets on, for
  reshard after forward on and off, gradient accumulation, frozen and tied parameters,
  activation checkpointing, HSDP and a module skipped in some steps (2 blocks: every group in
  one bucket is three groups sharing each collective, as four would); and like the same
  4-block model without buckets bit for bit (mixed precision, a group with other options,
  after an exception, parameters kept after forward: then one copy-out for the bucket's
  groups), since a bucket only concatenates its groups' buffers (W = 2: each element of a
  reduce-scatter is one addition either way);
- issue one collective per bucket: counted with ``CountingComm`` in a step after the first
  (which records the order and runs unbucketed), against hand-counted buckets and
  ``Buckets.sizes()`` (a cap that splits 4 blocks into buckets of two);
- close a bucket at a group whose options differ;
- refuse a bad cap before changing anything;
- in the one graph (``torch.compile(model, fullgraph=True)``, ``aot_eager``): one all-gather
  and one reduce-scatter per bucket in the traced graphs, the same training as the eager
  engine with the same cap and as the unsharded model, a recompile when the cap changes
  (two of the parametrized test's four cases here, which make every assertion of the four;
  all four, and inductor, in ``nox -s soak``: see ``GRAPH_CASES``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from collections import Counter
from typing import Any
from unittest import mock

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

import fully_shard.group as fs_group
from fully_shard import (
    CountingComm,
    FSDPModule,
    FullyShardTypeError,
    FullyShardValueError,
    MixedPrecisionPolicy,
    fully_shard,
)
from fully_shard.group import GroupState
from harness import device_mesh, mesh_1d, run_distributed
from matrix import thinned
from models import ModelArgs, Transformer
from parity import (
    check_parity,
    fsdp_gradient_sync,
    loss_fn,
    make_token_batch,
    param_diffs,
)
from test_graph import _batch, _collectives, _Graphs, _Net
from tp_plan import apply_tp

ARGS = ModelArgs(n_layers=4)
# The blocks of the parity cases with every group in one bucket: a bucket of root + 2 blocks
# shares its collectives as root + 4 would, at about half the CPU (each of the 3 steps compares
# every parameter and gradient, one gather each). The cap that splits the blocks into buckets
# of two, and the twin runs, keep 4.
PARITY_LAYERS = 2
# The compiled cases' backends: aot_eager here, inductor too in ``nox -s soak``.
BACKENDS = tuple(os.environ.get("FULLY_SHARD_COMPILE_BACKENDS", "aot_eager").split(","))
# Every compatible group in one bucket.
ALL = 64.0
# 2 blocks per bucket, not 3: a block is 2,976 fp32 elements (x W=2 ranks: 23,808 bytes of
# buffer), the root 1,040 (8,320 bytes); the cap is 26,214 bytes.
TWO_BLOCKS = 0.025


class _SkipsLastBlock(Transformer):
    """Runs its last block only in every other forward (counted per model)."""

    calls = 0

    def forward(self, tokens: Tensor) -> Tensor:
        self.calls += 1
        h = self.tok_embeddings(tokens)
        freqs = self.rope(tokens.shape[1]) if self.rope is not None else None
        layers = list(self.layers)
        for layer in layers if self.calls % 2 else layers[:-1]:
            h = layer(h, freqs)
        logits: Tensor = self.output(self.norm(h))
        return logits


def _checkpointed(model: nn.Module) -> None:
    for block in model.get_submodule("layers").children():
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)  # type: ignore[method-assign]


def _shard(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    cap: float | None,
    comm: CountingComm | None = None,
    other_block: dict[str, Any] | None = None,
    **options: Any,
) -> None:
    """Each block, then the root; block 1 gets ``other_block`` options instead (if given)."""
    for i, block in enumerate(model.get_submodule("layers").children()):
        mine = other_block if other_block is not None and i == 1 else options
        fully_shard(block, mesh=mesh, **mine)
    fully_shard(model, mesh=mesh, **options)
    assert isinstance(model, FSDPModule)
    model.set_bucket_cap_mb(cap)
    if comm is not None:
        model.set_comm(comm)


def _count_one_step(model: nn.Module, comm: CountingComm, batch: Any) -> dict[str, Any]:
    """Collectives of one forward + backward (the order is recorded: buckets are on)."""
    comm.reset()
    tokens, targets = batch
    out = model(tokens)
    forward = comm.count_by_op()
    comm.reset()
    loss_fn(out, targets).backward()
    buckets = model._fsdp_state.root.buckets  # type: ignore[union-attr]
    states = [s.groups for s in model._fsdp_state.root.states]  # type: ignore[union-attr]
    return {
        "forward": forward,
        "backward": comm.count_by_op(),
        "sizes": None if buckets is None else buckets.sizes(),
        "sharded": all(g.state is GroupState.SHARDED for gs in states for g in gs),
    }


CASES = {
    # case: (build options, shard options, check_parity options)
    "reshard": ({}, {}, {}),
    "no-reshard": ({}, {"reshard_after_forward": False}, {}),
    "accum": ({}, {}, {"grad_accum": 2, "set_gradient_sync": fsdp_gradient_sync}),
    "frozen": ({"frozen": "layers.1."}, {}, {}),
    "tied": ({"tie_embeddings": True}, {}, {}),
    "checkpoint": ({"checkpoint": True}, {}, {}),
    "skip": ({"skips": True}, {}, {}),
    "hsdp": ({}, {"hsdp": True}, {}),
    # W = 4, resharded to pairs after forward: no gather is bucketed, the reductions are
    "reshard-int": ({}, {"reshard_after_forward": 2}, {}),
    # W = 4: tensor parallel over tp 2 first (tests/tp_plan.py), then fully_shard over dp 2;
    # only ours are counted (TP's collectives are DTensor's)
    "tp": ({}, {"tp": True}, {}),
}


def _parity(case: str, cap: float, layers: int = PARITY_LAYERS) -> dict[str, Any]:
    build_opts, shard_opts, parity_opts = CASES[case]
    shard_opts = dict(shard_opts)
    hsdp = shard_opts.pop("hsdp", False)
    tp = shard_opts.pop("tp", False)
    root = device_mesh((2, 2), ("dp", "tp")) if tp else None
    mesh = (
        device_mesh((2, 2), ("rep", "shard")) if hsdp else mesh_1d() if root is None else root["dp"]
    )
    args = ModelArgs(n_layers=layers, tie_embeddings=bool(build_opts.get("tie_embeddings")))

    def build() -> nn.Module:
        model = (_SkipsLastBlock if build_opts.get("skips") else Transformer)(args)
        for name, p in model.named_parameters():
            if name.startswith(build_opts.get("frozen", "-")):
                p.requires_grad_(False)
        if build_opts.get("checkpoint"):
            _checkpointed(model)
        return model

    comm = CountingComm()
    held: list[nn.Module] = []

    def shard(model: nn.Module, mesh: DeviceMesh) -> None:
        if root is not None:
            apply_tp(model, root["tp"])  # type: ignore[arg-type]
        _shard(model, mesh, cap=cap, comm=comm, **shard_opts)
        held.append(model)

    stats = check_parity(build, shard, make_token_batch, mesh, steps=3, **parity_opts)
    batch = make_token_batch(2, torch.Generator().manual_seed(7))
    counts = _count_one_step(held[0], comm, batch)
    return {"stats": dict(stats), **counts}


# (all-gathers in forward, in backward, reduce-scatters) with every group in one bucket
ONE_BUCKET = {
    "reshard": (1, 1, 1),
    "no-reshard": (1, 0, 1),
    "accum": (1, 1, 1),
    "frozen": (1, 1, 1),
    "tied": (1, 1, 1),
    "checkpoint": (1, 1, 1),
    "skip": (1, 1, 1),
    "hsdp": (1, 1, 1),
    # the root reshards to pairs too: it gathers again, as every block does
    "reshard-int": (PARITY_LAYERS + 1, PARITY_LAYERS + 1, 1),
    "tp": (1, 1, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_buckets_train_like_the_unsharded_model_with_one_collective_per_bucket(case: str) -> None:
    world = 4 if case in ("hsdp", "reshard-int", "tp") else 2
    for seen in run_distributed(_parity, world, case, ALL):
        assert seen["stats"]["max_param_diff"] < 1e-5
        forward, backward, reduce = ONE_BUCKET[case]
        assert seen["forward"] == {"all_gather": forward}, seen
        want = {"all_gather": backward, "reduce_scatter": reduce}
        if case == "hsdp":
            want["all_reduce"] = reduce  # one per reduce bucket, over the replicas
        assert seen["backward"] == {k: v for k, v in want.items() if v}, seen
        assert seen["sharded"]
        sizes = seen["sizes"]  # one collective per bucket
        assert (len(sizes["forward"]), len(sizes["backward"]), len(sizes["reduce"])) == (
            forward,
            backward or len(sizes["backward"]),
            reduce,
        )


def test_the_cap_decides_the_buckets_and_the_collectives() -> None:
    for seen in run_distributed(_parity, 2, "reshard", TWO_BLOCKS, 4):
        assert seen["stats"]["max_param_diff"] < 1e-5
        # forward [root, 0] [1, 2] [3]; backward gathers [3, 2] [1, 0]; reductions, in the
        # order backward finishes the groups (the root last): [3, 2] [1, 0] [root]
        assert seen["sizes"] == {"forward": [2, 2, 1], "backward": [2, 2], "reduce": [2, 2, 1]}
        assert seen["forward"] == {"all_gather": 3}
        assert seen["backward"] == {"all_gather": 2, "reduce_scatter": 3}


# -- bit for bit the same as without buckets ---------------------------------------------------


def _twin_steps(case: str) -> dict[str, Any]:
    """The same model sharded twice, with and without buckets, 3 AdamW steps on the same
    data (an exception raised and recovered from in step 1 for the "raise-*" cases)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kept = {"reshard_after_forward": False}
    by_case: dict[str, dict[str, Any]] = {"mp": {"mp_policy": mp}, "kept": kept, "kept-own": kept}
    options = by_case.get(case, {})
    other = {"other-options": {"mp_policy": mp}}.get(case)
    copies: list[int] = []
    real_copy_out = fs_group.copy_out

    def counted_copy_out(*args: Any) -> None:  # every copy-out of gathered parameters
        copies.append(1)
        real_copy_out(*args)

    with contextlib.ExitStack() as patches:  # this rank's process only, for this job only
        patches.enter_context(mock.patch.object(fs_group, "copy_out", counted_copy_out))
        if case == "kept-own":  # the shared copy-out declines: each group copies its own
            patches.enter_context(
                mock.patch.object(fs_group.SharedCopy, "fill", lambda self, caller: False)
            )
        return _twin_train(case, options, other, copies)


def _twin_train(
    case: str, options: dict[str, Any], other: dict[str, Any] | None, copies: list[int]
) -> dict[str, Any]:
    """:func:`_twin_steps`' training; ``copies`` grows by one per copy-out."""
    models, comms = [], []
    for cap in (None, ALL):
        torch.manual_seed(0)
        model = Transformer(ARGS)
        comm = CountingComm()
        _shard(model, mesh_1d(), cap=cap, comm=comm, other_block=other, **options)
        models.append(model)
        comms.append(comm)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    rank = torch.distributed.get_rank()
    for step in range(3):
        tokens, targets = make_token_batch(4, torch.Generator().manual_seed(step))
        tokens, targets = tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]
        forward_copies = []
        for model, optim, comm in zip(models, optims, comms, strict=True):
            comm.reset()
            if step == 1 and case.startswith("raise-"):
                _raise_and_recover(model, tokens, targets, case)
            copies.clear()
            out = model(tokens)
            forward_copies.append(len(copies))
            loss_fn(out, targets).backward()
            optim.step()
            optim.zero_grad()
    counts = [c.count_by_op() for c in comms]
    pairs = zip(models[0].parameters(), models[1].parameters(), strict=True)
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in pairs)
    sizes = models[1]._fsdp_state.root.buckets.sizes()
    return {"same": same, "counts": counts, "sizes": sizes, "copies": forward_copies}


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise RuntimeError("boom in backward")


def _raise_and_recover(model: nn.Module, tokens: Tensor, targets: Tensor, case: str) -> None:
    """A forward (or backward) that raises half-way through the blocks, then the reset."""
    block = model.get_submodule("layers.2")
    if case == "raise-forward":

        def hook(*_: Any) -> None:
            raise RuntimeError("boom in forward")

        handle = block.register_forward_pre_hook(hook)
    else:
        handle = block.register_forward_hook(lambda m, i, out: _RaiseInBackward.apply(out))
    with pytest.raises(RuntimeError, match="boom"):
        loss_fn(model(tokens), targets).backward()
    handle.remove()
    assert isinstance(model, FSDPModule)
    model.reset_iter_state()
    for p in model.parameters():
        p.grad = None


@pytest.mark.parametrize(
    "case", ["mp", "other-options", "raise-forward", "raise-backward", "kept", "kept-own"]
)
def test_buckets_change_no_number(case: str) -> None:
    for seen in run_distributed(_twin_steps, 2, case):
        assert seen["same"], case
        if case.startswith("kept"):
            # forward's copy-outs in the last step, unbucketed and bucketed: one per group,
            # or one for the bucket's 5 groups that keep their parameters (SharedCopy)
            assert seen["sizes"]["forward"] == [5]
            assert seen["copies"] == [5, 5 if case == "kept-own" else 1]
            assert seen["counts"][1] == {"all_gather": 1, "reduce_scatter": 1}
        if case == "other-options":
            # block 1 gathers in bf16: it closes the fp32 buckets on both sides; its reduce
            # dtype is fp32 like the others', so the reduction still spans every group
            assert seen["sizes"] == {"forward": [2, 1, 2], "backward": [2, 1, 1], "reduce": [5]}
        if case in ("mp", "other-options"):
            unbucketed, bucketed = seen["counts"]
            assert unbucketed == {"all_gather": 9, "reduce_scatter": 5}
            groups = seen["sizes"]
            want_gathers = len(groups["forward"]) + len(groups["backward"])
            assert bucketed == {"all_gather": want_gathers, "reduce_scatter": len(groups["reduce"])}


# -- bad input ---------------------------------------------------------------------------------


def _bad_caps() -> list[str]:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    _shard(model, mesh_1d(), cap=None)
    assert isinstance(model, FSDPModule)
    errors = []
    for bad in (-1, float("nan"), float("inf"), "25", True, [25]):
        with pytest.raises((FullyShardValueError, FullyShardTypeError)) as info:
            model.set_bucket_cap_mb(bad)  # type: ignore[arg-type]
        errors.append(f"{type(info.value).__name__}: {info.value}")
    states = [m._fsdp_state for m in model.modules() if isinstance(m, FSDPModule)]
    assert all(s.bucket_cap is None for s in states)  # nothing changed
    model.set_bucket_cap_mb(0)
    assert all(s.bucket_cap is None for s in states)
    model.set_bucket_cap_mb(1)
    assert all(s.bucket_cap == 1024 * 1024 for s in states)
    # every group has its own default TorchComm (no set_comm here): they still share buckets
    for step in range(2):
        loss_fn(*_step_inputs(model, step)).backward()
    assert model._fsdp_state.root.buckets.sizes() == {  # type: ignore[union-attr]
        "forward": [5],
        "backward": [4],
        "reduce": [5],
    }
    return errors


def _step_inputs(model: nn.Module, step: int) -> tuple[Tensor, Tensor]:
    tokens, targets = make_token_batch(2, torch.Generator().manual_seed(step))
    return model(tokens), targets


def test_a_bad_cap_is_refused_before_anything_changes() -> None:
    errors = run_distributed(_bad_caps, 2)[0]
    assert [e.split(":")[0] for e in errors] == [
        "FullyShardValueError",
        "FullyShardValueError",
        "FullyShardValueError",
        "FullyShardTypeError",
        "FullyShardTypeError",
        "FullyShardTypeError",
    ]
    assert "set_bucket_cap_mb" in errors[0] and "-1" in errors[0]


# -- in the one graph ----------------------------------------------------------------------------


def _compiled_with_cap(
    reshard: bool,
    regions: bool,
    bf16_block: bool,
    cap_at: int,
    backend: str = "aot_eager",
    eager_first: bool = False,
    blocks: int = 4,
) -> dict[str, Any]:
    """test_graph's net (tied embedding and head in the root's group, ``blocks`` blocks,
    uneven rows), W=2: compiled whole beside our eager engine and the unsharded replica, 3
    AdamW steps. The cap (every group in one bucket) comes before step ``cap_at`` on both
    sharded models (at 1: step 0 traces without buckets, step 1 again with them); block 1
    gathers in bf16 if ``bf16_block``; with ``eager_first`` step 0 runs the sharded model
    eagerly, so that the graph path plans its buckets from the order that step recorded."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net(checkpointed=False, blocks=blocks)
    reference, eager = copy.deepcopy(model), copy.deepcopy(model)
    f32 = torch.float32
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=f32, output_dtype=f32)
    for m in (model, eager):
        for i, block in enumerate(m.blocks):
            mp = bf16 if bf16_block and i == 1 else MixedPrecisionPolicy()
            fully_shard(block, mesh=mesh_1d(), reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(m, mesh=mesh_1d())  # the root keeps its parameters (torch's default)
    assert isinstance(model, FSDPModule) and isinstance(eager, FSDPModule)
    model.set_compile_region(regions)
    graphs = _Graphs(backend)
    models = (model, eager, reference)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    rank = torch.distributed.get_rank()
    frames = []
    # Dynamo inlines a region called once; keep every region, so that each one shows.
    with torch._dynamo.config.patch(inline_single_use_invoke_subgraph=False):
        run = torch.compile(model, backend=graphs, fullgraph=True)
        for step in range(3):
            if step == cap_at:
                model.set_bucket_cap_mb(ALL)
                eager.set_bucket_cap_mb(ALL)
            tokens, targets = _batch(step, 4)
            first = model if eager_first and step == 0 else run
            for call, optim in zip((first, eager, reference), optims, strict=True):
                rows = slice(None) if call is reference else slice(2 * rank, 2 * rank + 2)
                loss_fn(call(tokens[rows]), targets[rows]).backward()
                optim.step()
                optim.zero_grad()
            frames.append(graphs.frames)
    bodies = Counter(
        n.args[0].target
        for n in graphs.dynamo[-1].graph.nodes
        if n.target is torch.ops.higher_order.invoke_subgraph
    )
    return {
        "diffs": param_diffs(model, reference),
        "eager_diffs": param_diffs(model, eager),
        "frames": frames,
        "regions": sorted(bodies.values()),  # calls of each region body
        "fw": [_collectives(g) for g in graphs.fw],
        "bw": [_collectives(g) for g in graphs.bw],
    }


# The blocks of the parametrized case: two share a bucket as well as four would.
BLOCKS = 2
# (reshard, regions, cap_at, eager_first). Each case compiles (the first twice): the suite
# runs two, which between them make every assertion of the four: blocks traced inline and a
# recompile (the first), one shared region and the buckets planned from an eager first step
# (the last). Blocks that keep their parameters with regions off, and each of the last case's
# two options alone, are soak cases (tests/matrix.py); test_regions.py traces regions off.
GRAPH_CASES = [
    (True, True, 1, False),
    (False, True, 0, False),
    (False, False, 0, True),
    (False, True, 0, True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("reshard", "regions", "cap_at", "eager_first"),
    thinned(GRAPH_CASES, [GRAPH_CASES[0], GRAPH_CASES[-1]]),
)
def test_the_one_graph_has_one_collective_per_bucket(
    reshard: bool, regions: bool, cap_at: int, eager_first: bool, backend: str
) -> None:
    """Buckets in the traced graph (two blocks): the same training as eager with the same cap
    and as the unsharded model (1e-5), and one all-gather and one reduce-scatter (gloo: an
    all-to-all) per bucket. The root keeps its parameters after forward; with ``reshard`` the
    blocks do not, so the root is a bucket of its own and the blocks' bucket gathers again in
    backward. A cap set after the first compiled step recompiles once. With regions on,
    blocks that reshard are traced inline (their bucket's gather would otherwise be kept
    until backward); blocks that keep their parameters share one region that takes them
    gathered. After an eager first step the buckets follow the order it recorded (the same
    here)."""
    f32 = torch.float32
    case = (reshard, regions, False, cap_at, backend, eager_first, BLOCKS)
    for r in run_distributed(_compiled_with_cap, 2, *case, timeout=300):
        assert max(r["diffs"]) < 1e-5, r["diffs"]
        assert max(r["eager_diffs"]) < 1e-5, r["eager_diffs"]
        assert r["frames"] == ([1, 2, 2] if cap_at else [0, 1, 1] if eager_first else [1] * 3)
        assert r["regions"] == ([BLOCKS] if regions and not reshard else [])
        if backend == "inductor":  # inductor compiles its own graphs: none kept to inspect
            continue
        if cap_at:  # the first graph: one gather and one reduction per group
            assert r["fw"][0] == [("all_gather", f32)] * (BLOCKS + 1)
            assert r["bw"][0].count(("all_to_all", f32)) == BLOCKS + 1
        fw, bw = r["fw"][-1], r["bw"][-1]
        buckets = 2 if reshard else 1
        assert fw == [("all_gather", f32)] * buckets, fw
        again = [("all_gather", f32)] if reshard else []  # the blocks' bucket, recomputed
        assert Counter(bw) == Counter(again + [("all_to_all", f32)] * buckets), bw


def test_a_bf16_block_closes_the_bucket_in_the_graph() -> None:
    """Block 1 gathers in bf16: buckets [root] [0] [1] [2, 3] (the root keeps its parameters,
    the blocks reshard); blocks 0 and 1, each a bucket of one, keep their regions (one each:
    their gathers differ), blocks 2 and 3 are traced inline."""
    f32, bf16 = torch.float32, torch.bfloat16
    for r in run_distributed(_compiled_with_cap, 2, True, True, True, 0, timeout=300):
        # bf16 compute in block 1: against eager as test_graph's mixed precision test
        assert max(r["eager_diffs"]) < 1e-4, r["eager_diffs"]
        assert r["frames"] == [1, 1, 1]
        (fw,), (bw,) = r["fw"], r["bw"]
        assert Counter(fw) == {("all_gather", f32): 3, ("all_gather", bf16): 1}, fw
        assert Counter(bw) == {
            ("all_gather", f32): 2,  # block 0's and the bucket [2, 3]'s, recomputed
            ("all_gather", bf16): 1,  # block 1's
            ("all_to_all", f32): 4,
        }, bw
        assert r["regions"] == [1, 1]


def _accumulating_in_the_graph() -> dict[str, Any]:
    """Two micro-batches a step, gradient sync off for the first, compiled with one bucket
    for the blocks, beside the unsharded replica on the global batches."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net(checkpointed=False, blocks=2)
    reference = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh_1d())
    fully_shard(model, mesh=mesh_1d())
    assert isinstance(model, FSDPModule)
    model.set_bucket_cap_mb(ALL)
    graphs = _Graphs("aot_eager")
    run = torch.compile(model, backend=graphs, fullgraph=True)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    rank = torch.distributed.get_rank()
    for step in range(2):
        for micro in range(2):
            tokens, targets = _batch(10 * step + micro, 4)
            model.set_requires_gradient_sync(micro == 1)
            mine = slice(2 * rank, 2 * rank + 2)
            loss_fn(run(tokens[mine]), targets[mine]).backward()
            loss_fn(reference(tokens), targets).backward()
        for optim in optims:
            optim.step()
            optim.zero_grad()
    return {
        "diffs": param_diffs(model, reference),
        "frames": graphs.frames,
        "bw": [_collectives(g) for g in graphs.bw],
    }


def test_gradient_accumulation_in_the_graph_reduces_each_bucket_once() -> None:
    """Sync off: the bucket's backward keeps each group's gradients unreduced (no collective
    but the blocks' recomputed gather); sync on: they join the last micro-batch's, one
    reduce-scatter per bucket ([root], [0, 1]). One graph per value of the flag."""
    f32 = torch.float32
    for r in run_distributed(_accumulating_in_the_graph, 2, timeout=300):
        assert max(r["diffs"]) < 1e-5, r["diffs"]
        assert r["frames"] == 2
        unsynced, synced = r["bw"]
        assert unsynced == [("all_gather", f32)], unsynced
        assert Counter(synced) == {("all_gather", f32): 1, ("all_to_all", f32): 2}, synced
