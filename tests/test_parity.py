"""Parity: a sharded model trains exactly like an unsharded replica, step by step.

Every test runs `parity.check_parity` on W gloo ranks: the same initial values, a different
slice of the same global batch on every rank, and every step's loss, every gradient and the
final full parameters within `torch.allclose(atol=1e-6, rtol=1e-5)` of a replica trained on the
whole batch. Two models:

- ``mlp``: `MLPStack([7, 13, 1, 5, 3], activation="tanh")`: dim 0 is uneven for every W in 2..4
  and the width-1 layer leaves ranks with empty shards; tanh keeps every gradient nonzero.
  `wrap_layers_then_root` leaves the root group with no parameters of its own.
- ``transformer``: the small Llama-style `Transformer` with tied embeddings: the tied pair
  (`tok_embeddings.weight` is `output.weight`) and the final norm stay in the root group.

Every parity run trains 2 optimizer steps in the suite: the second runs on the optimizer state
and the sharded parameters the first one left, which is all that a longer run repeats.
``nox -s soak`` (``FULLY_SHARD_FULL_MATRIX=1``) trains as long as before (`_steps`): 5 steps,
3 for the embedding/head and gradient accumulation tests.

Each test case is one distributed job on a warm pool, so a case costs its training time only
(the pool and the workers' imports are paid once per W per session); a failure names W, the
model and the option in its test id and the step, rank and parameter in its message.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference, tests only
from torch.distributed.tensor import DTensor, Shard

import parity
from fully_shard import CountingComm, FSDPModule, FullyShardValueError, fully_shard
from harness import mesh_1d, run_distributed
from matrix import FULL_MATRIX, pairwise, thinned
from models import MLPStack, ModelArgs, RMSNorm, Transformer
from parity import (
    MakeBatch,
    ParityStats,
    check_parity,
    fsdp_gradient_sync,
    make_float_batch,
    make_token_batch,
    needs_torch_fsdp2_on_cpu,
)

MLP_DIMS = (7, 13, 1, 5, 3)
TRANSFORMER_ARGS = ModelArgs(tie_embeddings=True)
MODELS = ("mlp", "transformer")
Shard_ = Callable[[nn.Module, DeviceMesh], None]


def _steps(soak: int = 5) -> int:
    """Optimizer steps of a parity run: 2 in the suite (a step after a step), ``soak`` in
    ``nox -s soak``."""
    return soak if FULL_MATRIX else 2


# -- helpers (run inside a rank) --------------------------------------------------------------


def _build(model: str) -> nn.Module:
    if model == "mlp":
        return MLPStack(list(MLP_DIMS), activation="tanh")
    if model == "transformer":
        return Transformer(TRANSFORMER_ARGS)
    raise ValueError(f"unknown model {model!r}")


def _make_batch(model: str) -> MakeBatch:
    if model == "mlp":
        return functools.partial(make_float_batch, in_dim=MLP_DIMS[0], out_dim=MLP_DIMS[-1])
    return make_token_batch


def _n_layers(model: str) -> int:
    return len(MLP_DIMS) - 1 if model == "mlp" else TRANSFORMER_ARGS.n_layers


def _reshard_flags(pattern: str, n_groups: int) -> list[bool]:
    """``reshard_after_forward`` per group, blocks in forward order, then the root."""
    if pattern == "all_true":
        return [True] * n_groups
    if pattern == "all_false":
        return [False] * n_groups
    if pattern == "alternating":
        return [i % 2 == 0 for i in range(n_groups)]
    raise ValueError(f"unknown pattern {pattern!r}")


def _layers(model: nn.Module) -> nn.ModuleList:
    layers = model.get_submodule("layers")
    assert isinstance(layers, nn.ModuleList)
    return layers


def _wrap(
    flags: Sequence[bool | None] | None = None,
    groups: Sequence[Sequence[int]] | None = None,
    **options: Any,
) -> Shard_:
    """A `shard` for `check_parity`: each group of `model.layers` (one block each by default)
    gets its own `fully_shard` call, then the root. ``flags`` gives ``reshard_after_forward``
    per call (the root's last); ``options`` go to every call."""

    def shard(model: nn.Module, mesh: DeviceMesh) -> None:
        layers = _layers(model)
        blocks = groups if groups is not None else [[i] for i in range(len(layers))]
        per_call = list(flags) if flags is not None else [None] * (len(blocks) + 1)
        for block, flag in zip(blocks, per_call[:-1], strict=True):
            modules = [layers[i] for i in block]
            target = modules[0] if len(modules) == 1 else modules
            fully_shard(target, mesh=mesh, reshard_after_forward=flag, **options)
        fully_shard(model, mesh=mesh, reshard_after_forward=per_call[-1], **options)

    return shard


def _counted(shard: Shard_, counter: CountingComm) -> Shard_:
    """``shard``, then route every group's collectives through ``counter``."""

    def counted(model: nn.Module, mesh: DeviceMesh) -> None:
        shard(model, mesh)
        assert isinstance(model, FSDPModule)
        model.set_comm(counter)

    return counted


def _rows(dim_size: int, world: int, rank: int) -> int:
    """Rows rank ``rank`` holds of a dim of ``dim_size`` split like `torch.chunk` (DESIGN.md)."""
    chunk = math.ceil(dim_size / world)
    return max(0, min(chunk, dim_size - rank * chunk))


def _local(p: torch.Tensor) -> torch.Tensor:
    assert isinstance(p, DTensor)
    return p.to_local()


def _parity(model: str, shard: Shard_, **kwargs: Any) -> ParityStats:
    kwargs.setdefault("steps", _steps())
    return check_parity(lambda: _build(model), shard, _make_batch(model), mesh_1d(), **kwargs)


def _assert_nonvacuous(stats: list[ParityStats]) -> None:
    """Every trainable parameter had a nonzero gradient at some step on every rank."""
    for rank, s in enumerate(stats):
        assert s["zero_grad_params"] == [], f"rank {rank}: gradients always zero for these"


# -- reshard_after_forward per layer ----------------------------------------------------------


def _reshard_pattern(model: str, pattern: str) -> ParityStats:
    flags = _reshard_flags(pattern, _n_layers(model) + 1)
    return _parity(model, _wrap(flags))


@pytest.mark.parametrize(
    ("world", "model", "pattern"),
    pairwise([1, 2, 3, 4], MODELS, ["all_true", "all_false", "alternating"]),
)
def test_parity_with_reshard_after_forward_per_layer(world: int, model: str, pattern: str) -> None:
    _assert_nonvacuous(run_distributed(_reshard_pattern, world, model, pattern))


# -- sharding on another dim ------------------------------------------------------------------


def _last_dim_placement(dim: int) -> Callable[[nn.Parameter], Shard | None]:
    return lambda p: Shard(dim) if p.dim() == 2 else None


def _shard_dim(model: str, dim: int) -> ParityStats:
    inner = _wrap(shard_placement_fn=_last_dim_placement(dim))

    def shard(m: nn.Module, mesh: DeviceMesh) -> None:
        inner(m, mesh)
        world, rank = mesh.size(), mesh.get_local_rank()
        for name, p in m.named_parameters():
            assert isinstance(p, DTensor), name
            want = 1 if p.dim() == 2 else 0
            assert p.placements == (Shard(want),), f"{name}: {p.placements}"
            local = p.to_local()
            assert local.shape[want] == _rows(p.shape[want], world, rank), (name, local.shape)

    return _parity(model, shard)


@pytest.mark.parametrize(
    ("model", "world", "dim"),
    [("mlp", 4, 1), ("mlp", 2, -1), ("transformer", 3, 1)],
    ids=["mlp-w4-Shard(1)", "mlp-w2-Shard(-1)", "transformer-w3-Shard(1)"],
)
def test_parity_sharding_2d_weights_on_the_last_dim(model: str, world: int, dim: int) -> None:
    _assert_nonvacuous(run_distributed(_shard_dim, world, model, dim))


# -- frozen parameters ------------------------------------------------------------------------

# Parameters built with requires_grad=False: a whole group ("block"), or single parameters
# mixed into groups with trainable ones ("mixed"; for the transformer the tied embedding, so
# the root group and the frozen head share one frozen parameter).
FROZEN = {
    ("mlp", "block"): ("layers.1.",),
    ("mlp", "mixed"): ("layers.0.linear.bias", "layers.2.linear.weight"),
    ("transformer", "mixed"): ("tok_embeddings.weight", "layers.0.attention.wq.weight"),
}


def _frozen(model: str, which: str) -> ParityStats:
    prefixes = FROZEN[model, which]

    def build() -> nn.Module:
        m = _build(model)
        for name, p in m.named_parameters():
            if name.startswith(prefixes):
                p.requires_grad_(False)
        return m

    def shard(m: nn.Module, mesh: DeviceMesh) -> None:
        _wrap()(m, mesh)
        frozen = [n for n, p in m.named_parameters() if not p.requires_grad]
        assert frozen and all(n.startswith(prefixes) for n in frozen), frozen

    # check_parity asserts after every backward that each frozen parameter's grad is None.
    return check_parity(build, shard, _make_batch(model), mesh_1d(), steps=_steps())


@pytest.mark.parametrize(("model", "which"), list(FROZEN), ids=[f"{m}-{w}" for m, w in FROZEN])
def test_parity_with_frozen_parameters_whose_grads_stay_none(model: str, which: str) -> None:
    _assert_nonvacuous(run_distributed(_frozen, 2, model, which))


# -- ignored parameters -----------------------------------------------------------------------

IGNORED = {"mlp": "layers.1.linear.weight", "transformer": "norm.weight"}


def _ignored(model: str) -> ParityStats:
    name = IGNORED[model]

    def shard(m: nn.Module, mesh: DeviceMesh) -> None:
        p = m.get_parameter(name)
        # Every call whose module(s) hold the parameter must ignore it, the root's included:
        # otherwise that call would own it.
        for block in _layers(m):
            owns = any(q is p for q in block.parameters())
            fully_shard(block, mesh=mesh, ignored_params={p} if owns else None)
        fully_shard(m, mesh=mesh, ignored_params={p})
        assert m.get_parameter(name) is p and not isinstance(p, DTensor)
        others = [n for n, q in m.named_parameters() if n != name and not isinstance(q, DTensor)]
        assert others == [], others

    return _parity(model, shard)


@pytest.mark.parametrize(("model", "world"), [("mlp", 2), ("transformer", 2)])
def test_parity_with_ignored_params_left_unsharded(model: str, world: int) -> None:
    _assert_nonvacuous(run_distributed(_ignored, world, model))


# -- the embedding and the output head wrapped apart from the root -----------------------------


def _embedding_and_head(impl: str, together: bool) -> Shard_:
    """Blocks, then the embedding and the head (one call for both, or one each), then the root."""
    shard_fn = fully_shard if impl == "ours" else torch_fully_shard

    def shard(model: nn.Module, mesh: DeviceMesh) -> None:
        for layer in _layers(model):
            shard_fn(layer, mesh=mesh)
        embedding, head = model.get_submodule("tok_embeddings"), model.get_submodule("output")
        if together:
            shard_fn([embedding, head], mesh=mesh)
        else:
            shard_fn(embedding, mesh=mesh)
            shard_fn(head, mesh=mesh)
        shard_fn(model, mesh=mesh)

    return shard


def _head_apart(impl: str, tied: bool, together: bool) -> ParityStats:
    args = dataclasses.replace(TRANSFORMER_ARGS, tie_embeddings=tied)
    shard = _embedding_and_head(impl, together)
    return check_parity(
        lambda: Transformer(args), shard, make_token_batch, mesh_1d(), steps=_steps(3)
    )


def _tied_head_apart_is_refused() -> None:
    """Separate calls on a tied pair: torch refuses at the first forward (ValueError), ours
    at the call that would untie them (a ValueError too), with nothing changed."""
    mesh = mesh_1d()
    for impl in ("torch", "ours"):
        torch.manual_seed(0)
        model = Transformer(TRANSFORMER_ARGS)
        shard_fn = fully_shard if impl == "ours" else torch_fully_shard
        shard_fn(model.tok_embeddings, mesh=mesh)
        original = model.output.weight
        tokens = torch.zeros(2, 4, dtype=torch.long)
        if impl == "torch":
            shard_fn(model.output, mesh=mesh)
            shard_fn(model, mesh=mesh)
            with pytest.raises(ValueError, match="shared with a parameter already managed"):
                model(tokens)
            continue
        with pytest.raises(FullyShardValueError, match="tied to 'weight' of the Embedding") as e:
            shard_fn(model.output, mesh=mesh)
        assert isinstance(e.value, ValueError) and "fully_shard([" in str(e.value)
        assert not isinstance(model.output, FSDPModule) and model.output.weight is original
        assert not isinstance(original, DTensor)


@needs_torch_fsdp2_on_cpu
@pytest.mark.parametrize("world", [2, 3])
def test_tied_embedding_and_head_in_separate_calls_are_refused_never_untied(world: int) -> None:
    run_distributed(_tied_head_apart_is_refused, world)


# world x (tied in one call | untied apart) x implementation: every pair of values once in the
# suite, the whole product in nox -s soak.
_HEAD_APART = [
    pytest.param(world, tied, tied, impl, id=f"{world}-{pair}-{impl}", marks=marks)
    for world, (tied, pair), (impl, marks) in [
        (2, (True, "tied-one-call"), ("ours", ())),
        (3, (False, "untied-apart"), ("ours", ())),
        (2, (False, "untied-apart"), ("torch", needs_torch_fsdp2_on_cpu)),
        (3, (True, "tied-one-call"), ("torch", needs_torch_fsdp2_on_cpu)),
        (3, (True, "tied-one-call"), ("ours", ())),
        (2, (False, "untied-apart"), ("ours", ())),
        (3, (False, "untied-apart"), ("torch", needs_torch_fsdp2_on_cpu)),
        (2, (True, "tied-one-call"), ("torch", needs_torch_fsdp2_on_cpu)),
    ]
]


@pytest.mark.parametrize(
    ("world", "tied", "together", "impl"), thinned(_HEAD_APART, _HEAD_APART[:4])
)
def test_embedding_and_head_wrapped_apart_from_the_root_train_at_parity(
    world: int, tied: bool, together: bool, impl: str
) -> None:
    """The fix the error suggests (a tied pair in one call) and an untied pair in two calls
    train like the unsharded model, ours and torch's alike."""
    _assert_nonvacuous(run_distributed(_head_apart, world, impl, tied, together))


# -- a list of modules as one group -----------------------------------------------------------


def _list_group(model: str) -> ParityStats:
    groups = [[0, 1], *([i] for i in range(2, _n_layers(model)))]

    def shard(m: nn.Module, mesh: DeviceMesh) -> None:
        _wrap(groups=groups)(m, mesh)
        first, second = m.get_submodule("layers.0"), m.get_submodule("layers.1")
        assert isinstance(first, FSDPModule) and isinstance(second, FSDPModule)
        assert first._fsdp_state is second._fsdp_state  # one group for both

    return _parity(model, shard)


@pytest.mark.parametrize(("model", "world"), [("mlp", 3), ("transformer", 2)])
def test_parity_with_a_list_of_blocks_as_one_group(model: str, world: int) -> None:
    _assert_nonvacuous(run_distributed(_list_group, world, model))


def _list_group_collectives() -> tuple[int, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard([model[0], model[1]], mesh=mesh_1d())  # reshards after forward (not the root)
    fully_shard(model, mesh=mesh_1d())  # owns model[2]; the root keeps it until backward
    assert isinstance(model, FSDPModule)
    counter = CountingComm()
    model.set_comm(counter)
    out = model(torch.randn(2, 4))
    forward = counter.count_by_op().get("all_gather", 0)
    out.sum().backward()
    return forward, counter.count_by_op().get("all_gather", 0) - forward


def test_a_list_group_gathers_once_for_forward_and_once_for_backward() -> None:
    """A group is the unit of communication (DESIGN.md): the list [a, b] is gathered before
    a's forward and freed after b's, like torch FSDP2's group forward hooks."""
    forward, backward = run_distributed(_list_group_collectives, 2)[0]
    assert (forward, backward) == (2, 1)  # forward: the root and the pair; backward: the pair


# -- optimizers -------------------------------------------------------------------------------


def _optimizer_factory(
    foreach: bool, built: list[torch.optim.Optimizer]
) -> Callable[[str, Iterable[nn.Parameter], float], torch.optim.Optimizer]:
    """`parity._make_optimizer` with ``foreach`` pinned (the template leaves torch's default:
    the per-parameter loop on CPU); same hyper-parameters as the template's."""

    def make(name: str, params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        trainable = [p for p in params if p.requires_grad]
        opt: torch.optim.Optimizer
        if name == "adamw":
            opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.01, foreach=foreach)
        elif name == "sgd":
            opt = torch.optim.SGD(trainable, lr=lr, momentum=0.9, foreach=foreach)
        else:
            raise ValueError(name)
        built.append(opt)
        return opt

    return make


def _optimizer(model: str, name: str, foreach: bool) -> ParityStats:
    built: list[torch.optim.Optimizer] = []
    with mock.patch.object(parity, "_make_optimizer", _optimizer_factory(foreach, built)):
        stats = _parity(model, _wrap(), optimizer=name)
    assert len(built) == 2 and all(o.param_groups[0]["foreach"] is foreach for o in built)
    return stats


@pytest.mark.parametrize(
    ("model", "world", "name", "foreach"),
    [
        ("mlp", 2, "sgd", False),
        ("mlp", 2, "sgd", True),
        ("mlp", 2, "adamw", False),
        ("mlp", 2, "adamw", True),
        ("transformer", 2, "adamw", True),
    ],
    ids=lambda v: f"foreach={v}" if isinstance(v, bool) else str(v),
)
def test_parity_with_optimizer(model: str, world: int, name: str, foreach: bool) -> None:
    _assert_nonvacuous(run_distributed(_optimizer, world, model, name, foreach))


# -- gradient accumulation --------------------------------------------------------------------

ACCUM = 3


def _accumulate(model: str, sync_last_only: bool, reshard: bool) -> tuple[ParityStats, int]:
    counter = CountingComm()
    flags = [reshard] * (_n_layers(model) + 1)
    stats = _parity(
        model,
        _counted(_wrap(flags), counter),
        steps=_steps(3),
        grad_accum=ACCUM,
        set_gradient_sync=fsdp_gradient_sync if sync_last_only else None,
    )
    return stats, counter.count_by_op().get("reduce_scatter", 0)


@pytest.mark.parametrize(
    ("model", "world", "sync_last_only", "reshard"),
    [
        ("mlp", 3, True, True),
        ("mlp", 3, True, False),
        ("mlp", 2, False, True),
        ("transformer", 2, True, True),
    ],
    ids=["mlp-w3-sync_last", "mlp-w3-sync_last-no_reshard", "mlp-w2-sync_every", "tf-w2-sync_last"],
)
def test_gradient_accumulation_without_sync_equals_one_step_on_all_micro_batches(
    model: str, world: int, sync_last_only: bool, reshard: bool
) -> None:
    """k - 1 backward passes with `set_requires_gradient_sync(False)`, then one with True,
    step like the replica's one backward over all k micro-batches (and reduce only once)."""
    results = run_distributed(_accumulate, world, model, sync_last_only, reshard)
    _assert_nonvacuous([stats for stats, _ in results])
    groups = _n_layers(model) + (1 if model == "transformer" else 0)
    per_step = groups * (1 if sync_last_only else ACCUM)
    assert results[0][1] == _steps(3) * per_step


# -- meta-device initialisation ---------------------------------------------------------------


def _meta_init(model: str) -> ParityStats:
    def build() -> nn.Module:
        with torch.device("meta"):
            return _build(model)

    def shard(m: nn.Module, mesh: DeviceMesh) -> None:
        _wrap()(m, mesh)
        assert all(p.device.type == "meta" for p in m.parameters())
        m.to_empty(device="cpu")
        if isinstance(m, Transformer):
            m.tie_weights()
        m.reset_parameters()  # type: ignore[operator]  # both test models have it
        world, rank = mesh.size(), mesh.get_local_rank()
        for name, p in m.named_parameters():
            assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
            local = p.to_local()
            rows = _rows(p.shape[0], world, rank)
            assert local.device.type == "cpu", name
            assert local.shape == (rows, *p.shape[1:]), (name, tuple(local.shape), rows)
            # Only this rank's rows are allocated: no padding or full tensor behind the shard.
            assert local.untyped_storage().nbytes() == local.numel() * local.element_size()
            # reset_parameters() filled the shard (an empty one may hold NaNs or anything).
            assert bool(torch.isfinite(local).all()), name
        for mod_name, mod in m.named_modules():
            if isinstance(mod, RMSNorm):
                assert bool((_local(mod.weight) == 1).all()), mod_name
            elif isinstance(mod, nn.Linear) and not (
                isinstance(m, Transformer) and mod is m.output
            ):
                bound = 1 / math.sqrt(mod.in_features)  # nn.Linear's default init bound
                for p in mod.parameters():
                    assert bool((_local(p).abs() <= bound).all()), mod_name
        if isinstance(m, Transformer):
            assert m.output.weight is m.tok_embeddings.weight

    return check_parity(
        build, shard, _make_batch(model), mesh_1d(), steps=_steps(), reference_from_sharded=True
    )


@pytest.mark.parametrize(("model", "world"), [("mlp", 4), ("transformer", 3)])
def test_meta_device_init_allocates_only_local_rows_and_trains_at_parity(
    model: str, world: int
) -> None:
    _assert_nonvacuous(run_distributed(_meta_init, world, model))
