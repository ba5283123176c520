"""The graph path: ``torch.compile(model, fullgraph=True)`` of a model sharded block by block.

Each case trains the compiled sharded model beside an unsharded replica on the global batch
(fp32: exact to 1e-5) or beside our eager engine (mixed precision), on a small model that
holds every shape of parameter the path has to handle: an embedding tied to the output head
(one tensor in two modules of the root's group), a frozen parameter beside trainable ones,
row counts that do not divide by the world size (padding), blocks with activation
checkpointing inside. The captured forward and backward graphs are inspected too.

The backend is ``aot_eager``'s (AOTAutograd with the min-cut partitioner, no code generation)
with hooks that keep the graphs; ``nox -s soak`` adds ``inductor``
(``FULLY_SHARD_COMPILE_BACKENDS``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, graph
from fully_shard.errors import FullyShardNotImplementedError
from harness import device_mesh, mesh_1d, run_distributed
from matrix import thinned
from models import RMSNorm
from parity import loss_fn, param_diffs

STEPS = 3
BACKENDS = tuple(os.environ.get("FULLY_SHARD_COMPILE_BACKENDS", "aot_eager").split(","))
_OPS = torch.ops._c10d_functional
# param_persistence_threshold: keeps _Net's block's up.bias (7) and the root's scale (8) whole,
# and _TPNet's norm weights (8); the smallest sharded parameter (_Net's up.weight, 7 x 8) has
# 56 elements.
_KEPT = 9


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int, checkpointed: bool) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)  # 7 rows: uneven over 2 or 4 ranks
        self.down = nn.Linear(hidden, dim, bias=False)
        self.checkpointed = checkpointed

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.tanh(self.up(x)))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return x + checkpoint(self._mlp, x, use_reentrant=False)  # type: ignore[no-any-return]
        return x + self._mlp(x)


class _Net(nn.Module):
    """Tokens (B, S) -> logits (B, S, vocab); the head's weight is the embedding's."""

    def __init__(
        self, checkpointed: bool, vocab: int = 13, dim: int = 8, hidden: int = 7, blocks: int = 2
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, hidden, checkpointed) for _ in range(blocks))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h * self.scale)
        return out


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.tanh(self.up(x)))
        return out


class _TPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.mlp = _MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))  # type: ignore[no-any-return]


class _TPNet(nn.Module):
    """Tokens -> logits, Megatron-style over a TP mesh (:func:`_tp_then_shard`): the
    embedding row-parallel over the vocabulary, the MLP column- then row-parallel, the norms
    sequence-parallel (their weights' gradients are Partial over the TP ranks), the head
    column-parallel. The feed-forward half of ``tp_plan.apply_tp``'s Llama, at a fraction of
    its compile time."""

    def __init__(self, vocab: int = 14, dim: int = 8, hidden: int = 10) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([_TPBlock(dim, hidden)])
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.layers:
            h = block(h)
        return self.head(self.norm(h))  # type: ignore[no-any-return]


def _tp_then_shard(
    model: _TPNet,
    root: Any,
    dp_dims: tuple[str, ...] = ("dp",),
    root_options: dict[str, Any] | None = None,
) -> None:
    """TP over ``root["tp"]``, then ``fully_shard`` over ``root[dp_dims]``, the root's with
    ``root_options``."""
    tp, dp = root["tp"], root[dp_dims]
    parallelize_module(
        model,
        tp,
        {
            "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp,
            {
                "norm": SequenceParallel(),
                "mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "mlp.up": ColwiseParallel(),
                "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp, **(root_options or {}))


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(0, 13, (rows, 7), generator=torch.Generator().manual_seed(step))
    return seq[:, :-1], seq[:, 1:]


class _Graphs:
    """A backend that compiles as ``backend`` and keeps what dynamo traced (``dynamo``, one
    graph per frame) and every forward / backward graph (test_regions uses it too)."""

    def __init__(self, backend: str) -> None:
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        self.dynamo: list[torch.fx.GraphModule] = []
        self.fw: list[torch.fx.GraphModule] = []
        self.bw: list[torch.fx.GraphModule] = []

        def keep(into: list[torch.fx.GraphModule]) -> Any:
            def compiler(gm: torch.fx.GraphModule, example: Any) -> Any:
                into.append(gm)
                return make_boxed_func(gm.forward)

            return compiler

        self._aot = aot_autograd(
            fw_compiler=keep(self.fw),
            bw_compiler=keep(self.bw),
            partition_fn=min_cut_rematerialization_partition,
        )
        self._backend = backend

    @property
    def frames(self) -> int:
        return len(self.dynamo)

    def __call__(self, gm: torch.fx.GraphModule, example: Any) -> Any:
        self.dynamo.append(gm)
        if self._backend == "inductor":
            return torch._inductor.compile(gm, example)  # type: ignore[attr-defined]
        return self._aot(gm, example)


def _collectives(
    gm: torch.fx.GraphModule, group: str | None = None, *, besides: str | None = None
) -> list[tuple[str, torch.dtype]]:
    """The collectives of ``gm`` in order: over process group ``group`` only, or over every
    group but ``besides``, if given. On gloo the graph reduce-scatters with an all-to-all
    (graph.py's ``_reduce``). A compiled region (a block's ``invoke_subgraph``) counts its
    body's collectives at each call."""
    names = {
        _OPS.all_gather_into_tensor.default: "all_gather",
        _OPS.reduce_scatter_tensor.default: "reduce_scatter",
        _OPS.all_to_all_single.default: "all_to_all",
        _OPS.all_reduce.default: "all_reduce",
    }
    found: list[tuple[str, torch.dtype]] = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is torch.ops.higher_order.invoke_subgraph:
            found += _collectives(getattr(gm, n.args[0].target), group, besides=besides)
        elif n.target in names and group in (None, n.args[-1]) and n.args[-1] != besides:
            found.append((names[n.target], n.args[0].meta["val"].dtype))
    return found


def _shard(model: _Net, mesh: Any, **options: Any) -> None:
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **options)
    fully_shard(
        model, mesh=mesh, **{k: v for k, v in options.items() if k != "reshard_after_forward"}
    )


def _step(
    run: Any, optim: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor
) -> float:
    loss = loss_fn(run(tokens), targets)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def _setup(case: str) -> tuple[nn.Module, Callable[[nn.Module], None], int, int, list[str]]:
    """The unsharded model of ``case``, how to shard it, this rank's data-parallel rank and
    size, and the name of our process group (the dp one: the replicas' for ``hsdp_tp``)."""
    if case == "tp":  # (dp=2, tp=2): TP in the block and at the root, then fully_shard
        # unflattened from a 1-D world mesh, as torchtitan builds its meshes: the parameters
        # land on the concatenated (dp, tp) mesh with torch's placements (strided on dim 0).
        # The root's norm weight kept whole, the block's sharded: both kinds of TP norm.
        root = device_mesh((4,), ("world",))._unflatten(0, (2, 2), ("dp", "tp"))
        kept = {"param_persistence_threshold": _KEPT}
        shard = functools.partial(_tp_then_shard, root=root, root_options=kept)
        groups = [root["dp"].get_group().group_name]
        return _TPNet(), shard, root["dp"].get_local_rank(), 2, groups
    if case == "hsdp_tp":  # (replicate=2, shard=1, tp=2): HSDP over TP, the 3-D layout
        root = device_mesh((2, 1, 2), ("rep", "shard", "tp"))
        shard = functools.partial(_tp_then_shard, root=root, dp_dims=("rep", "shard"))
        groups = [root["rep"].get_group().group_name]
        return _TPNet(), shard, root["rep"].get_local_rank(), 2, groups
    model = _Net(checkpointed=True)
    model.scale.requires_grad_(False)  # frozen, in the root's group beside trainable weights
    mesh = mesh_1d()
    shard = functools.partial(_shard, mesh=mesh, reshard_after_forward=True)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    return model, shard, rank, world, [mesh.get_group().group_name]


def _trainable(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _train_exact(backend: str, case: str) -> dict[str, Any]:
    """fp32: the compiled sharded model beside our eager engine (same shards, same rows) and
    an unsharded replica on the global batch."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, shard, dp_rank, dp_size, groups = _setup(case)
    reference, eager = copy.deepcopy(model), copy.deepcopy(model)
    shard(model)
    shard(eager)
    graphs = _Graphs(backend)
    run = torch.compile(model, backend=graphs, fullgraph=True)
    optim, eager_optim, ref_optim = _trainable(model), _trainable(eager), _trainable(reference)
    frames = []
    for step in range(STEPS):
        tokens, targets = _batch(step, 2 * dp_size)
        mine = slice(2 * dp_rank, 2 * dp_rank + 2)
        _step(run, optim, tokens[mine], targets[mine])
        _step(eager, eager_optim, tokens[mine], targets[mine])
        _step(reference, ref_optim, tokens, targets)
        frames.append(graphs.frames)
    state = model._fsdp_state  # type: ignore[attr-defined]
    return {
        "kept": [p.fqn for g in state.groups for p in g.persistent],
        "diffs": param_diffs(model, reference),
        "eager_diffs": param_diffs(model, eager),
        "registered": all(isinstance(p, DTensor) for p in model.parameters()),
        "grads_none": all(p.grad is None for p in model.parameters()),
        "sharded": str(state.groups[0].state),
        "frames": frames,
        "fw": [_collectives(g, groups[0]) for g in graphs.fw],
        "bw": [_collectives(g, groups[0]) for g in graphs.bw],
        # TP's: over any group but ours. (DTensor may run them on an earlier test's TP group
        # over the same ranks: its caches take meshes of equal ranks and names as one.)
        "tp_bw": [_collectives(g, besides=groups[0]) for g in graphs.bw] if case != "fsdp" else [],
        "blocks": len(model.blocks if case == "fsdp" else model.layers),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", thinned(["fsdp", "tp", "hsdp_tp"], ["fsdp", "tp"]))
def test_whole_model_in_one_graph_trains_exactly(backend: str, case: str) -> None:
    """One forward and one backward graph, no recompilation, parameters within 1e-5 of our
    eager engine and of the unsharded replica. ``fsdp``: W=2, tied + frozen weights, uneven
    rows, AC inside blocks. ``tp``: W=4 as (dp=2) x (tp=2) unflattened from the world mesh
    (torchtitan's way), every parameter a 2-D DTensor (strided where TP and we both shard
    dim 0), the TP modules computing with DTensors inside the graph, uneven dp rows, and
    sequence-parallel norms whose weights' gradients are Partial over the TP ranks, summed
    over TP as eager sums them: the block's norm weight sharded over dp (reduce-scattered),
    the root's kept whole (``param_persistence_threshold``: its TP placement kept, Replicate
    on dp; all-reduced over dp). ``hsdp_tp`` (``nox -s soak``): the same model, every
    parameter sharded, on (replicate=2) x (shard=1) x (tp=2), the 3-D layout at four ranks:
    one shard rank gathers nothing, the gradients are all-reduced over the replicas."""
    world = 2 if case == "fsdp" else 4
    got = run_distributed(functools.partial(_train_exact, backend, case), world, timeout=300)
    for r in got:
        assert r["kept"] == (["norm.weight"] if case == "tp" else []), r["kept"]
        assert max(r["diffs"]) < 1e-5, r["diffs"]
        assert max(r["eager_diffs"]) < 1e-5, r["eager_diffs"]
        assert r["registered"] and r["grads_none"] and r["sharded"] == "GroupState.SHARDED"
        assert r["frames"] == [1] * STEPS  # one frame, compiled once
        if backend == "inductor":
            continue
        (fw,), (bw,) = r["fw"], r["bw"]
        f32, blocks = torch.float32, r["blocks"]
        if case == "hsdp_tp":  # on the replicate group: nothing in forward, one all-reduce
            assert fw == [] and bw == [("all_reduce", f32)] * (blocks + 1), (fw, bw)
            ((tp_bw),) = r["tp_bw"]
            assert tp_bw.count(("all_reduce", f32)) == blocks + 1, tp_bw
            continue
        # One all-gather per group in forward (the blocks and the root), fp32.
        assert fw == [("all_gather", f32)] * (blocks + 1)
        # Backward: the blocks reshard after forward, so their gathers are recomputed; the
        # root keeps its parameters. One reduce-scatter per group, fp32; with tp, the root's
        # kept-whole norm weight all-reduced over dp besides.
        want = [("all_gather", f32)] * blocks + [("all_to_all", f32)] * (blocks + 1)
        if case == "tp":
            want.append(("all_reduce", f32))
        assert sorted(bw) == sorted(want), bw
        if case == "tp":  # each norm weight's Partial gradient summed over TP, as in eager
            ((tp_bw),) = r["tp_bw"]
            assert tp_bw.count(("all_reduce", f32)) == blocks + 1, tp_bw


def _train_hsdp_accumulating(backend: str) -> dict[str, Any]:
    """HSDP (2 x 2), fp32, kept-whole parameters, two micro-batches per step (sync off, then
    on) vs the replica; one block (two graphs on four ranks: the compile is the cost)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net(checkpointed=False, blocks=1)
    reference = copy.deepcopy(model)
    mesh = device_mesh((2, 2), ("replicate", "shard"))
    _shard(model, mesh, reshard_after_forward=False, param_persistence_threshold=_KEPT)
    graphs = _Graphs(backend)
    run = torch.compile(model, backend=graphs, fullgraph=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    frames = []
    for step in range(STEPS):
        tokens, targets = _batch(step, 4 * world)
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)  # type: ignore[operator]
            rows = slice(4 * rank + 2 * micro, 4 * rank + 2 * micro + 2)
            (loss_fn(run(tokens[rows]), targets[rows]) / 2).backward()
        optim.step()
        optim.zero_grad()
        _step(reference, ref_optim, tokens, targets)
        frames.append(graphs.frames)
    return {
        "diffs": param_diffs(model, reference),
        "frames": frames,
        "bw": [_collectives(g) for g in graphs.bw],
    }


@pytest.mark.parametrize("backend", BACKENDS[:1])
def test_hsdp_with_gradient_accumulation_trains_exactly(backend: str) -> None:
    """2 x 2 HSDP, sync off for the first of two micro-batches: a second graph for the flag
    (compiled once each), exact against the replica; the unsynced backward reduces nothing.
    The block's bias and the root's scale kept whole: their gradients summed over the shard
    group, then the replicas (two all-reduces per group, as the eager engine issues them)."""
    got = run_distributed(functools.partial(_train_hsdp_accumulating, backend), 4, timeout=300)
    for r in got:
        assert max(r["diffs"]) < 1e-5, r["diffs"]
        assert r["frames"] == [2] * STEPS
        if backend == "inductor":  # inductor compiles its own graphs: none kept to inspect
            continue
        unsynced, synced = r["bw"]
        assert unsynced == [], unsynced
        f32 = torch.float32
        # per group (the block, the root): two for the kept-whole, the sharded reduce-scatter
        # and its all-reduce over the replicas
        want = [("all_reduce", f32)] * 6 + [("all_to_all", f32)] * 2
        assert sorted(synced, key=str) == sorted(want, key=str), synced


@contextlib.contextmanager
def _native_reduce_scatter() -> Iterator[None]:
    """Trace the backend's own reduce-scatter, the graph NCCL runs, instead of gloo's
    all-to-all (graph.py's ``_reduce``)."""
    graph._EXCHANGE_ON_GLOO = False
    try:
        yield
    finally:
        graph._EXCHANGE_ON_GLOO = True


@_native_reduce_scatter()
def _train_mixed_precision(backend: str) -> dict[str, Any]:
    """bf16 compute, fp32 reduction, the blocks' up.bias and the root's scale kept whole:
    compiled beside our eager engine, same options; the reduce-scatters as NCCL runs them."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net(checkpointed=False)
    eager = copy.deepcopy(model)
    for m in (model, eager):
        _shard(m, mesh_1d(), mp_policy=mp, param_persistence_threshold=_KEPT)
    graphs = _Graphs(backend)
    run = torch.compile(model, backend=graphs, fullgraph=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_optim = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    rank = torch.distributed.get_rank()
    for step in range(STEPS):
        tokens, targets = _batch(step, 4)
        mine = slice(2 * rank, 2 * rank + 2)
        _step(run, optim, tokens[mine], targets[mine])
        _step(eager, eager_optim, tokens[mine], targets[mine])
    return {
        "diffs": param_diffs(model, eager),
        "dtypes": {str(p.dtype) for p in model.parameters()},
        **_kept_whole(model),
        "frames": graphs.frames,
        "fw": [_collectives(g) for g in graphs.fw],
        "bw": [_collectives(g) for g in graphs.bw],
    }


def _kept_whole(model: nn.Module) -> dict[str, list[Any]]:
    """The kept-whole parameters of ``model`` (a _Net) and its blocks, and whether each bias
    and scale is a ``Replicate()`` DTensor."""
    states = [m._fsdp_state for m in (model, *model.blocks)]  # type: ignore[union-attr]
    return {
        "kept": sorted(p.fqn for s in states for g in s.groups for p in g.persistent),
        "replicate": [
            isinstance(p, DTensor) and p.placements == (Replicate(),)
            for n, p in model.named_parameters()
            if n.endswith(("bias", "scale"))
        ],
    }


@pytest.mark.parametrize("backend", BACKENDS[:1])
def test_mixed_precision_gathers_bf16_and_reduces_fp32(backend: str) -> None:
    """bf16 gathers, fp32 reductions, against our eager engine with the same options; the
    kept-whole parameters (``param_persistence_threshold``: the blocks' biases, the root's
    scale) ``Replicate`` DTensors, their gradients all-reduced in fp32, one per group."""
    got = run_distributed(functools.partial(_train_mixed_precision, backend), 2, timeout=300)
    f32, bf16 = torch.float32, torch.bfloat16
    for r in got:
        # Against our eager engine, which (torch 2.15's reduce_dtype) sums the tied weight's
        # two uses in one backward in fp32 (the unsharded parameter's grad_dtype), where the
        # traced gather's output sums them in bf16, then casts: measured 2.6e-5 after 3 AdamW
        # steps under aot_eager. Inductor also fuses the bf16 casts into its kernels, which
        # rounds differently (measured 6e-4): bf16's scale.
        assert max(r["diffs"]) < (1e-4 if backend == "aot_eager" else 2e-3), r["diffs"]
        assert r["dtypes"] == {"torch.float32"}  # the sharded parameters stay fp32
        assert r["kept"] == ["scale", "up.bias", "up.bias"], r["kept"]
        assert r["replicate"] == [True] * 3, r["replicate"]
        assert r["frames"] == 1, r["frames"]
        if backend == "inductor":  # inductor compiles its own graphs: none kept to inspect
            continue
        (fw,), (bw,) = r["fw"], r["bw"]
        assert fw == [("all_gather", bf16)] * 3
        # The blocks reshard after forward (the default below the root): bf16 gathers again.
        # One reduce-scatter and, for the kept-whole, one all-reduce per group, fp32.
        expected = [("all_gather", bf16)] * 2 + [("reduce_scatter", f32), ("all_reduce", f32)] * 3
        assert sorted(bw) == sorted(expected), bw


# accumulate: reshard after forward, AC in the block, two micro-batches a step (sync off,
# then on); keep+buckets: reshard_after_forward=False under a bucket cap. (bf16 compute:
# test_mixed_precision_gathers_bf16_and_reduces_fp32.)
_KEPT_CASES = ("accumulate", "keep+buckets")


def _train_kept_whole(backend: str) -> dict[str, Any]:
    """Each case of ``_KEPT_CASES`` (W=2, one block, one spawn for all): compiled with kept-whole
    parameters beside our eager engine with the same threshold and an unsharded replica on the
    global batch."""
    rank = torch.distributed.get_rank()
    out: dict[str, Any] = {}
    for case in _KEPT_CASES:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _Net(checkpointed=case == "accumulate", blocks=1)
        if case == "keep+buckets":
            model.scale.requires_grad_(False)  # a frozen kept-whole parameter: not reduced
        reference, eager = copy.deepcopy(model), copy.deepcopy(model)
        options: dict[str, Any] = {"param_persistence_threshold": _KEPT}
        options["reshard_after_forward"] = case != "keep+buckets"
        for m in (model, eager):
            _shard(m, mesh_1d(), **options)
            if case == "keep+buckets":
                m.set_bucket_cap_mb(25)  # type: ignore[operator]
        graphs = _Graphs(backend)
        run = torch.compile(model, backend=graphs, fullgraph=True)
        optim, eager_optim, ref_optim = _trainable(model), _trainable(eager), _trainable(reference)
        for step in range(STEPS):
            tokens, targets = _batch(step, 8)
            if case == "accumulate":  # two micro-batches per step, sync off for the first
                for m, o in ((run, optim), (eager, eager_optim)):
                    for micro in range(2):
                        model_of = model if m is run else eager
                        model_of.set_requires_gradient_sync(micro == 1)  # type: ignore[operator]
                        rows = slice(4 * rank + 2 * micro, 4 * rank + 2 * micro + 2)
                        (loss_fn(m(tokens[rows]), targets[rows]) / 2).backward()
                    o.step()
                    o.zero_grad()
            else:
                mine = slice(4 * rank, 4 * rank + 4)
                _step(run, optim, tokens[mine], targets[mine])
                _step(eager, eager_optim, tokens[mine], targets[mine])
            _step(reference, ref_optim, tokens, targets)
        out[case] = {
            **_kept_whole(model),
            "diffs": param_diffs(model, reference),
            "eager_diffs": param_diffs(model, eager),
            "frames": graphs.frames,
            "bw": [_collectives(g) for g in graphs.bw],
        }
    return out


@pytest.mark.parametrize("backend", BACKENDS[:1])
def test_kept_whole_parameters_in_the_graph_train_like_eager_and_the_replica(backend: str) -> None:
    """``param_persistence_threshold`` on the graph path: the block's bias and the root's
    scale kept whole, shown to the module as local tensors, their gradients all-reduced in the
    backward graph, one all-reduce per group, into ``Replicate`` gradients. Exact (1e-5)
    against our eager engine with the same threshold and against the unsharded replica, with
    reshard after forward and gradient accumulation, and without resharding under a bucket
    cap (the root's scale frozen there). (With bf16 compute, against eager:
    test_mixed_precision_gathers_bf16_and_reduces_fp32.)"""
    got = run_distributed(functools.partial(_train_kept_whole, backend), 2, timeout=300)
    f32 = torch.float32
    reduce = [("all_reduce", f32)] * 2 + [("all_to_all", f32)] * 2  # per group: kept, sharded
    for r in got:
        for case, c in r.items():
            assert c["kept"] == ["scale", "up.bias"], (case, c)
            assert c["replicate"] == [True] * 2, (case, c)
            assert max(c["eager_diffs"]) < 1e-5, (case, c["eager_diffs"])
            assert max(c["diffs"]) < 1e-5, (case, c["diffs"])
            assert c["frames"] == (2 if case == "accumulate" else 1), (case, c["frames"])
            if backend == "inductor":  # inductor compiles its own graphs: none kept to inspect
                continue
            bws = [sorted(bw, key=str) for bw in c["bw"]]
            if case == "accumulate":  # a graph per flag; the unsynced backward only gathers
                assert bws == [
                    [("all_gather", f32)],
                    sorted([("all_gather", f32), *reduce], key=str),
                ]
            else:  # keep+buckets: one reduce-scatter; the frozen scale not reduced
                assert bws == [sorted([("all_reduce", f32), ("all_to_all", f32)], key=str)], bws


def _replicate_on(model: nn.Module, mesh: Any) -> None:
    """Make every parameter of ``model`` a ``Replicate()`` DTensor on ``mesh``, keeping ties."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()]))
            setattr(module, name, made[id(p)])


def _untraceable(case: str) -> tuple[str, str]:
    """Compile a model whose root group uses an option the graph path cannot trace."""
    from fully_shard import CountingComm, DataParallelMeshDims, QuantizationPolicy

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net(checkpointed=False)
    options: dict[str, Any] = {}
    mesh = mesh_1d()
    if case == "offload":
        options["offload_policy"] = CPUOffloadPolicy()
    if case == "spmd":  # every parameter a DTensor on the whole (named) mesh, tied ones too
        mesh = device_mesh((2,), ("dp",))
        options["dp_mesh_dims"] = DataParallelMeshDims(shard="dp")
        _replicate_on(model, mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **options)
    if case == "int8":  # the embedding's padded shard (7 x 8 elements) holds a block of 8
        options["quantization_policy"] = QuantizationPolicy(all_gather="int8", block_size=8)
    fully_shard(model, mesh=mesh, **options)
    if case == "comm":
        model.set_comm(CountingComm())  # type: ignore[operator]
    if case == "keep_storage":
        model.set_keep_unsharded_storage(True)  # type: ignore[operator]
    if case == "manual":
        model.set_manual_backward_finalization(True)  # type: ignore[operator]
    run = torch.compile(model, backend="eager", fullgraph=True)
    since = graph._GRAPH_PATH_SINCE
    if case == "old_torch":  # as on a torch the graph path has not run on
        graph._GRAPH_PATH_SINCE = (99, 0)
    try:
        run(_batch(0, 2)[0])
    except Exception as e:  # dynamo wraps it (InternalTorchDynamoError); ours is the context
        cause = e if isinstance(e, FullyShardNotImplementedError) else e.__context__
        return type(cause).__name__, str(cause)
    finally:
        graph._GRAPH_PATH_SINCE = since
    return "", "no error"


@pytest.mark.parametrize(
    ("case", "names"),
    [
        ("offload", "CPU offload"),
        ("int8", "int8 (QuantizationPolicy)"),
        ("comm", "set_comm"),
        ("spmd", "whole SPMD mesh (dp_mesh_dims)"),
        ("old_torch", "needs torch 99.0 or newer"),
        ("keep_storage", "set_keep_unsharded_storage(True)"),
        ("manual", "set_manual_backward_finalization(True)"),
    ],
)
def test_untraceable_options_fail_at_compile_time_naming_the_option(case: str, names: str) -> None:
    for kind, message in run_distributed(functools.partial(_untraceable, case), 2, timeout=120):
        assert kind == "FullyShardNotImplementedError", message
        assert names in message and "ompile each block instead" in message, message


def _train_blocks_compiled_after_sharding(backend: str) -> dict[str, Any]:
    """``torch.compile(block, fullgraph=True)`` after ``fully_shard``, the root eager; the
    biases and the root's scale kept whole (the blocks' all-reduced in their graphs, the
    root's by the eager engine)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net(checkpointed=False)
    reference = copy.deepcopy(model)
    graphs = _Graphs(backend)
    for i, block in enumerate(list(model.blocks)):
        fully_shard(block, mesh=mesh_1d(), param_persistence_threshold=_KEPT)
        model.blocks[i] = torch.compile(block, backend=graphs, fullgraph=True)
    fully_shard(model, mesh=mesh_1d(), param_persistence_threshold=_KEPT)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    rank, frames = torch.distributed.get_rank(), []
    for step in range(STEPS):
        tokens, targets = _batch(step, 4)
        _step(model, optim, tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
        _step(reference, ref_optim, tokens, targets)
        frames.append(graphs.frames)
    return {
        "diffs": param_diffs(model, reference),
        "frames": frames,
        "fw": [_collectives(g) for g in graphs.fw],
        "bw": [_collectives(g) for g in graphs.bw],
    }


def test_block_compiled_after_sharding_carries_its_own_collectives() -> None:
    """Each block's graph holds its gather and its reductions, the kept-whole bias's
    all-reduce among them (the root's hooks stay eager); exact."""
    got = run_distributed(
        functools.partial(_train_blocks_compiled_after_sharding, BACKENDS[0]), 2, timeout=300
    )
    for r in got:
        assert max(r["diffs"]) < 1e-5, r["diffs"]
        assert r["frames"] == [2] * STEPS  # one graph per block (their groups differ)
        if BACKENDS[0] != "inductor":
            assert r["fw"] == [[("all_gather", torch.float32)]] * 2
            f32 = torch.float32
            want = sorted([("all_gather", f32), ("all_reduce", f32), ("all_to_all", f32)])
            assert [sorted(bw) for bw in r["bw"]] == [want] * 2, r["bw"]


def test_one_rank_compiles_without_collectives() -> None:
    # W = 1: nothing to gather or reduce; the gradients still go through the group's
    # reduction arithmetic (its divisions) to the DTensor parameters' .grad.
    (got,) = run_distributed(_train_exact, 1, "aot_eager", "fsdp", timeout=300)
    assert max(got["diffs"]) < 1e-5 and max(got["eager_diffs"]) < 1e-5, got
    assert got["frames"] == [1] * STEPS
    assert got["fw"] == [[]] and got["bw"] == [[]]


def _grads_beside_eager(p: nn.Parameter, q: nn.Parameter) -> tuple[bool, bool, float]:
    """(compiled has a gradient, it is a DTensor laid out as its parameter, max |diff| from
    eager's local rows; 0 where neither has a gradient, inf where only one has)."""
    g, want = p.grad, q.grad
    if g is None or want is None:
        return g is not None, False, 0.0 if g is None and want is None else float("inf")
    laid_out = (
        isinstance(g, DTensor)
        and isinstance(p, DTensor)
        and g.placements == p.placements
        and g.device_mesh == p.device_mesh
        and g.shape == p.shape
        and g.dtype == want.dtype
    )
    return True, laid_out, (g.to_local() - want.to_local()).abs().max().item()  # type: ignore[union-attr]


def _compiled_grads_against_eager() -> dict[str, Any]:
    """Backward after backward, the sharded gradients a compiled step leaves beside our eager
    engine's: accumulated over two backwards, a user's post-accumulate-grad hook, a
    parameter frozen and unfrozen, the shards replaced by ``model.to(torch.float64)``, a
    ``grad_dtype`` set before sharding."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net(checkpointed=False, blocks=1)
    model.scale.requires_grad_(False)  # frozen from the start, in the root's group
    eager = copy.deepcopy(model)
    for m in (model, eager):
        m.blocks[0].up.bias.grad_dtype = torch.float64  # type: ignore[union-attr]  # kept sharded
        _shard(m, mesh_1d())
    from torch._dynamo.utils import counters

    compiled = counters["stats"]["unique_graphs"]  # (the kept graphs of _Graphs would keep
    # weak references to the parameters, which stop _apply's swap in model.to() below)
    run = torch.compile(model, backend=BACKENDS[0], fullgraph=True)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    hooked: list[str] = []
    model.blocks[0].up.weight.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
        lambda p: hooked.append(type(p.grad).__name__)
    )
    rank = torch.distributed.get_rank()
    seen: dict[str, Any] = {}

    def backward(step: int, tag: str) -> None:
        tokens, targets = _batch(step, 4)
        mine = slice(2 * rank, 2 * rank + 2)
        for m in (run, eager):
            loss_fn(m(tokens[mine]), targets[mine]).backward()
        pairs = zip(model.named_parameters(), eager.parameters(), strict=True)
        seen[tag] = {name: _grads_beside_eager(p, q) for (name, p), q in pairs}
        seen[tag + " frames"] = counters["stats"]["unique_graphs"] - compiled

    def step_and_zero() -> None:
        for optim in optims:
            optim.step()
            optim.zero_grad()

    backward(0, "first")
    seen["bias grad"] = str(model.blocks[0].up.bias.grad.dtype)  # type: ignore[union-attr]
    backward(1, "accumulated")  # no zero_grad: added into the sharded .grad
    seen["hooked"] = list(hooked)
    step_and_zero()  # in place on the DTensors: the graph's shards see it
    for m in (model, eager):
        m.blocks[0].down.weight.requires_grad_(False)  # type: ignore[union-attr, operator]
    backward(2, "frozen")  # the first graph: its gradient dropped, the leaf frozen
    step_and_zero()
    backward(2, "frozen again")  # traced frozen
    step_and_zero()
    for m in (model, eager):
        m.blocks[0].down.weight.requires_grad_(True)  # type: ignore[union-attr, operator]
    backward(3, "unfrozen")
    step_and_zero()
    for m in (model, eager):
        m.to(torch.float64)  # the DTensors swapped for float64 ones: recompiled
    backward(4, "float64")
    step_and_zero()
    backward(5, "float64, stepped")
    seen["diffs"] = param_diffs(model, eager)
    return seen


def test_compiled_gradients_are_the_eager_engines_dtensors() -> None:
    """After each compiled backward every sharded gradient is a DTensor with its parameter's
    mesh, placements and shape, within 1e-6 of our eager engine's local rows, on the same
    parameters: accumulated into an existing ``.grad``, a user's post-accumulate-grad hook run
    once per backward after it is in place, a parameter frozen (no gradient: the first
    backward after freezing runs the graph traced trainable and drops the gradient, the next
    call recompiles) and unfrozen (recompiled once), and the shards replaced by
    ``model.to(torch.float64)`` (recompiled: float64 gradients, the optimizer's steps seen by
    the next compiled forward). A bias whose ``grad_dtype`` was float64 before sharding has
    float64 sharded gradients on both runtimes."""
    frames = {
        "first": 1,
        "accumulated": 1,
        "frozen": 1,
        "frozen again": 2,
        "unfrozen": 3,
        "float64": 4,
    }
    for r in run_distributed(_compiled_grads_against_eager, 2, timeout=300):
        assert r["hooked"] == ["DTensor", "DTensor"], r["hooked"]
        assert r["bias grad"] == "torch.float64", r["bias grad"]
        assert max(r["diffs"]) < 1e-6, r["diffs"]
        for tag, grads in r.items():
            if tag in ("hooked", "diffs", "bias grad") or tag.endswith("frames"):
                continue
            assert tag.split(",")[0] in frames and r[tag + " frames"] == frames[tag.split(",")[0]]
            for name, (has, laid_out, diff) in grads.items():
                frozen = name == "scale" or (
                    tag.startswith("frozen") and name == "blocks.0.down.weight"
                )
                assert has != frozen and (frozen or laid_out), (tag, name, has, laid_out)
                assert diff < 1e-6, (tag, name, diff)


# The recipes of docs/recipes/compile.md ("Inductor's collective passes"): inductor's passes,
# given as torch.compile options. They run only where inductor generates code, so these cases
# run where FULLY_SHARD_COMPILE_BACKENDS names inductor (nox -s soak).
RECIPES = {
    "bucket": {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all"},
    "reorder": {
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": [
            "reorder_compute_for_overlap",
            "sink_waits",
            "raise_comms",
        ],
    },
}
# One call in an output module: (output =) torch.ops.<namespace>.<op>.<overload>(<first arg>,
# or a generated kernel, or an extern one.
_CALL = re.compile(
    r"\s*(?:(\w+) = )?(?:torch\.ops\.(\w+)\.(\w+)\.\w+\((\w*)|cpp_fused|extern_kernels)"
)


def _code_collectives(code: str) -> tuple[dict[str, int], list[int]]:
    """The collectives an inductor output module calls, and for each one waited on, how many
    other calls (kernels, aten ops) run between its start and its wait."""
    counts: dict[str, int] = {}
    pending: dict[str, int] = {}  # started collective's output buffer -> calls since
    gaps = []
    for line in code[code.index("def call(") :].splitlines():
        call = _CALL.match(line)
        if call is None:
            continue
        out, namespace, op, first_arg = call.groups()
        if namespace != "_c10d_functional":
            pending = {buf: n + 1 for buf, n in pending.items()}
            continue
        counts[op] = counts.get(op, 0) + 1
        if op == "wait_tensor" and first_arg in pending:
            gaps.append(pending.pop(first_arg))
        elif out:
            pending[out] = 0
    return counts, gaps


@_native_reduce_scatter()
def _train_with_passes(recipe: str) -> dict[str, Any]:
    """fp32, blocks resharding after forward, inductor with a recipe's passes on, the
    reduce-scatters as NCCL runs them (the bucketing pass leaves gloo's all-to-alls apart)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net(checkpointed=False)
    reference = copy.deepcopy(model)
    _shard(model, mesh_1d(), reshard_after_forward=True)
    # The passes move and merge collectives across blocks, within one graph: each block in a
    # region of its own would keep its collectives to itself (docs/recipes/compile.md).
    model.set_compile_region(False)  # type: ignore[operator]
    # Cache off: a graph found in inductor's cache is not generated again, so its code would
    # not reach run_and_get_code.
    options = {**RECIPES[recipe], "fx_graph_cache": False}
    run = torch.compile(model, fullgraph=True, options=options)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    rank, codes = torch.distributed.get_rank(), []
    for step in range(STEPS):
        tokens, targets = _batch(step, 4)
        mine = slice(2 * rank, 2 * rank + 2)
        if step == 0:  # compiles forward and backward: keep both output modules
            _, codes = run_and_get_code(_step, run, optim, tokens[mine], targets[mine])
        else:
            _step(run, optim, tokens[mine], targets[mine])
        _step(reference, ref_optim, tokens, targets)
    return {"diffs": param_diffs(model, reference), "code": [_code_collectives(c) for c in codes]}


@pytest.mark.skipif("inductor" not in BACKENDS, reason="inductor only (nox -s soak)")
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_inductor_collective_passes_train_exactly(recipe: str) -> None:
    """bucket: forward's three all-gathers become one, backward's two recomputed gathers one
    and its three reduce-scatters one. reorder: the same collectives, started earlier or
    waited on later (without the passes, torch 2.13 waits right after each collective).
    Parameters within 1e-5 of the unsharded replica either way."""
    for r in run_distributed(functools.partial(_train_with_passes, recipe), 2, timeout=600):
        assert max(r["diffs"]) < 1e-5, r["diffs"]
        (fw, fw_gaps), (bw, bw_gaps) = r["code"]
        if recipe == "bucket":
            assert fw == {"all_gather_into_tensor_out": 1, "wait_tensor": 1}, fw
            assert bw == {
                "all_gather_into_tensor_out": 1,
                "reduce_scatter_tensor": 1,
                "wait_tensor": 2,
            }, bw
        else:
            assert fw == {"all_gather_into_tensor": 3, "wait_tensor": 3}, fw
            assert bw == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 3, "wait_tensor": 5}
            assert len(fw_gaps) == 3 and len(bw_gaps) == 5 and max(fw_gaps + bw_gaps) > 0


# -- one description, two runtimes ------------------------------------------------------------


class _UserComm:
    """A user's AllGather / ReduceScatter (never issued here)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("never issued")


def _walk_config_fields() -> dict[str, str]:
    """Every GroupConfig field against graph.CONFIG_FIELDS, on an HSDP group (2 replicas of
    one shard rank, so that every option applies): a "described" field changes the
    description, a "refused" one makes check_traceable raise, the others change neither."""
    import dataclasses

    from fully_shard import QuantizationPolicy
    from fully_shard.description import describe
    from fully_shard.group import GroupConfig
    from fully_shard.mesh import post_forward_subgroup

    torch.manual_seed(0)
    model = _Net(checkpointed=False)
    fully_shard(model, mesh=device_mesh((2, 1), ("rep", "shard")))
    (group,) = model._fsdp_state.groups  # type: ignore[attr-defined]
    model(_batch(0, 2)[0])  # lazy init: the unsharded sides are chosen
    base = group.config
    others = {
        "reshard_after_forward": False,
        "reshard_after_backward": False,
        "requires_gradient_sync": False,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        "quantization_policy": QuantizationPolicy(all_gather="int8", block_size=8),
        "offload_policy": CPUOffloadPolicy(),
        "post_forward": post_forward_subgroup(group.info, 1),
        "requires_all_reduce": False,
        "all_reduce_hook": lambda t: None,
        "gradient_divide_factor": 3.0,
        "force_sum_reduction_for_comms": True,
        "unshard_in_backward": False,
        "all_gather_comm": _UserComm(),
        "reduce_scatter_comm": _UserComm(),
        "reduce_scatter_unused_params": True,
        "reduce_scatter_max_input_buffers": 2,
        "reduce_scatter_group": torch.distributed.new_group(),
        "allocate_from_process_group": True,
        "symm_mem_backend": "NCCL",
        "keep_unsharded_storage": True,
        "compile_region": False,
    }
    before = describe(group.params, group.info, base)
    seen = {}
    for f in dataclasses.fields(GroupConfig):
        how = graph.CONFIG_FIELDS.get(f.name)
        assert how is not None, f"GroupConfig.{f.name} is not in graph.CONFIG_FIELDS"
        changed = dataclasses.replace(base, **{f.name: others[f.name]})
        described = describe(group.params, group.info, changed) != before
        group.config = changed
        try:
            graph.check_traceable(group)
            refused = ""
        except FullyShardNotImplementedError as e:
            refused = str(e)
        finally:
            group.config = base
        assert described == (how == "described"), (f.name, how)
        assert bool(refused) == (how == "refused"), (f.name, how, refused)
        seen[f.name] = how
    assert group.description == before  # restoring the config renews it as it was
    return seen


def test_every_config_field_is_described_refused_or_without_effect_on_the_graph() -> None:
    from fully_shard.group import GroupConfig

    seen = run_distributed(_walk_config_fields, 2)[0]
    assert set(seen) == {f.name for f in __import__("dataclasses").fields(GroupConfig)}


def _configs_after_setters() -> dict[str, bool]:
    """A group's config object through set_requires_gradient_sync flips."""
    model = _Net(checkpointed=False, blocks=1)
    _shard(model, mesh_1d())
    group = model.blocks[0]._fsdp_state.groups[0]  # type: ignore[union-attr]
    first = group.config
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    off = group.config
    model.set_requires_gradient_sync(True)  # type: ignore[operator]
    back = group.config
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    return {
        "new object for new values": off is not first and off != first,
        "the first again": back is first,
        "the second again": group.config is off,
    }


def test_setters_give_back_the_config_object_of_equal_options() -> None:
    """The graph path guards on each group's config by identity (one guard, not one per
    field): a setter that restores earlier options restores the earlier object, so that an
    option flipped per micro-batch finds its graph again instead of recompiling."""
    for r in run_distributed(_configs_after_setters, 2):
        assert all(r.values()), r


class _SpyComm:
    """Records what the eager engine sends: (op, dtype, numel, the Reduction)."""

    def __init__(self) -> None:
        from fully_shard import TorchComm

        self.inner = TorchComm()
        self.records: list[tuple[str, torch.dtype, int, Any]] = []

    def all_gather(self, output: Any, input: Any, group: Any, async_op: bool) -> Any:
        self.records.append(("all_gather", input.dtype, input.numel(), None))
        return self.inner.all_gather(output, input, group, async_op)

    def reduce_scatter(self, output: Any, input: Any, group: Any, reduction: Any, **kw: Any) -> Any:
        self.records.append(("reduce_scatter", input.dtype, input.numel(), reduction))
        return self.inner.reduce_scatter(output, input, group, reduction, **kw)

    def all_reduce(self, tensor: Any, group: Any, reduction: Any, **kw: Any) -> Any:
        self.records.append(("all_reduce", tensor.dtype, tensor.numel(), reduction))
        return self.inner.all_reduce(tensor, group, reduction, **kw)


def _both_runtimes_read_one_description(option: str) -> list[str]:
    """What the eager engine sends is what each group's description says (dtypes, buffer
    lengths, the reduction), and the graph path's plan is that very description."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net(checkpointed=False)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _shard(model, mesh_1d(), **({"mp_policy": mp} if option == "bf16" else {}))
    if option == "divide":
        model.set_gradient_divide_factor(3.0)  # type: ignore[operator]
    spy = _SpyComm()
    model.set_comm(spy)  # type: ignore[operator]
    loss_fn(model(_batch(0, 2)[0]), _batch(0, 2)[1]).backward()
    model.set_comm(spy.inner)  # type: ignore[operator]  # torch's collectives: traceable
    groups = [g for m in model.modules() if hasattr(m, "_fsdp_state") for g in m._fsdp_state.groups]
    gathers, reduces = [], []
    for g in groups:
        d = g.description
        assert graph._plan_for(g) is d  # the traced runtime executes the same object
        gathers.append((d.wire_dtype, d.gather_total))
        reduces.append((d.reduce_dtype, d.world * sum(s.padded_numel for s in d.slots), d))
    got_gathers = {(dtype, n) for op, dtype, n, _ in spy.records if op == "all_gather"}
    assert got_gathers == set(gathers), (got_gathers, gathers)
    for op, dtype, n, reduction in spy.records:
        if op == "reduce_scatter":
            match = [d for rd, total, d in reduces if (rd, total) == (dtype, n)]
            assert match and reduction == match[0].reduction.reduce_scatter, (dtype, n, reduction)
    return sorted({str(dtype) for _, dtype, _, _ in spy.records})


@pytest.mark.parametrize("option", ["fp32", "bf16", "divide"])
def test_eager_sends_what_the_description_says(option: str) -> None:
    dtypes = run_distributed(_both_runtimes_read_one_description, 2, option)[0]
    assert ("torch.bfloat16" in dtypes) == (option == "bf16"), dtypes
