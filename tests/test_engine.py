"""The engine's behaviour, one test per rule: what is communicated, what is alive, what is seen.

Most tests use ``Net``: a root group that owns ``stem`` (13, 7) + (13,) and one group per block
of ``layers`` (13 -> 5 -> 11 -> 3, so dim 0 is uneven for every W in 2..4), wrapped bottom-up
like a transformer. A test builds it, deep-copies an unsharded replica, shards it and attaches
a ``CountingComm``; every rank sees the same global batch and takes its own rows, so the
replica's gradient is the average over ranks of the sharded model's local gradients.

Expected byte counts are computed here from the replica's parameter shapes and the sharding
rule of DESIGN.md (``ceil(dim0 / W)`` rows per rank, float32), never from the engine.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

from fully_shard import (
    CountingComm,
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)
from harness import device_mesh, mesh_1d, run_distributed
from models import MLPBlock, ModelArgs, Transformer
from parity import check_parity, global_and_rank_rows, make_token_batch, wrap_layers_then_root

DIMS = (7, 13, 5, 11, 3)
ROWS = 2  # rows per rank per micro-batch
ELEM = 4  # bytes of a float32
ATOL, RTOL = 1e-6, 1e-5


class Net(nn.Module):
    """``stem`` (owned by the root group) then one ``MLPBlock`` per block group.

    ``generate`` uses the root's own parameters outside ``forward``, like a decoding loop.
    """

    def __init__(self, dims: tuple[int, ...] = DIMS, *, use_checkpoint: bool = False) -> None:
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.stem = nn.Linear(dims[0], dims[1])  # weight (13, 7)
        self.layers = nn.ModuleList(
            MLPBlock(a, b, activation="tanh") for a, b in itertools.pairwise(dims[1:])
        )

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.stem(x))  # (B, 7) -> (B, 13)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False) if self.use_checkpoint else layer(h)
        return h  # (B, 3)

    def generate(self, x: Tensor, temperature: float = 0.5) -> Tensor:
        h = torch.tanh(self.stem(x))  # the root's parameters, outside forward
        for layer in self.layers:
            h = layer(h)
        return torch.softmax(h / temperature, dim=-1)


# -- helpers (run inside a rank) --------------------------------------------------------------


def _shard_net(model: Net, **options: Any) -> CountingComm:
    wrap_layers_then_root(fully_shard, **options)(model, mesh_1d())
    comm = CountingComm()
    model.set_comm(comm)  # type: ignore[operator]  # an FSDPModule method after fully_shard
    return comm


def _setup(
    *, use_checkpoint: bool = False, frozen_block: int | None = None, **options: Any
) -> tuple[Net, Net, CountingComm]:
    """(sharded model, unsharded replica, its counter), identical initial values on every rank.

    ``frozen_block`` is frozen (``requires_grad_(False)``) before sharding, as users do.
    """
    torch.manual_seed(0)
    model = Net(use_checkpoint=use_checkpoint)
    if frozen_block is not None:
        model.layers[frozen_block].requires_grad_(False)
    replica = copy.deepcopy(model)
    return model, replica, _shard_net(model, **options)


#: (global batch of W * ROWS rows, this rank's ROWS of it); `_batch(seed)` for another one.
_batch = functools.partial(global_and_rank_rows, DIMS[0], ROWS)


def _loss(out: Tensor) -> Tensor:
    return out.pow(2).mean()


def _groups(model: Net) -> list[nn.Module]:
    """The FSDP modules, root first, then the blocks in forward order."""
    return [model, *model.layers]


def _group_shapes(replica: Net) -> list[list[torch.Size]]:
    """Parameter shapes per group, from the unsharded replica: the root owns what no block does."""
    blocks = [[p.shape for p in block.parameters()] for block in replica.layers]
    in_blocks = {id(p) for block in replica.layers for p in block.parameters()}
    root = [p.shape for p in replica.parameters() if id(p) not in in_blocks]
    return [root, *blocks]


def _padded_shard_bytes(shapes: list[torch.Size], world: int) -> int:
    """One rank's all-gather input: ceil(dim0 / W) rows of every parameter, float32."""
    return sum(math.ceil(s[0] / world) * math.prod(s[1:]) * ELEM for s in shapes)


def _rows(dim0: int, world: int, rank: int) -> int:
    """Rows rank ``rank`` holds when dim0 is split like ``torch.chunk`` (DESIGN.md, step 1)."""
    c = math.ceil(dim0 / world)
    return max(0, min(c * (rank + 1), dim0) - c * rank)


def _residency(module: nn.Module) -> str:
    """ "sharded" or "gathered": what the group of ``module`` shows and holds, checked consistent.

    Sharded: every slot shows the sharded DTensor parameter and the unsharded tensor's storage
    is freed. Gathered: every slot shows the unsharded parameter and its storage is allocated.
    """
    found = set()
    for sp in module._fsdp_state.group.params:
        mod, name = sp.slots[0]
        shown = mod._parameters[name]
        unsharded = sp.unsharded_param
        alive = unsharded is not None and unsharded.untyped_storage().size() > 0
        if shown is sp.sharded_param and not alive:
            found.add("sharded")
        elif unsharded is not None and shown is unsharded and alive:
            found.add("gathered")
        else:
            raise AssertionError(
                f"{sp.fqn}: shows {type(shown).__name__}, unsharded storage alive={alive}"
            )
    if len(found) != 1:
        raise AssertionError(f"group of {type(module).__name__} is partly gathered: {found}")
    return found.pop()


def _expect(what: str, got: object, want: object) -> None:
    """``assert got == want`` with both values in the message (ranks run without pytest's
    assertion rewriting)."""
    if got != want:
        raise AssertionError(f"rank {dist.get_rank()}: {what}: got {got!r}, expected {want!r}")


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _assert_grads(model: nn.Module, replica: nn.Module, scale: float = 1.0) -> None:
    """Every sharded gradient (all-gathered) equals ``scale`` x the replica's."""
    ref = dict(replica.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(
            _full(p.grad),
            scale * ref[name].grad,
            atol=ATOL,
            rtol=RTOL,
            msg=lambda m, n=name: f"{n}: {m}",
        )


# -- collectives ------------------------------------------------------------------------------


def _step_collectives(frozen_block: int | None) -> None:
    model, replica, comm = _setup(frozen_block=frozen_block)
    world = dist.get_world_size()
    shapes = _group_shapes(replica)
    ag_bytes = [_padded_shard_bytes(s, world) for s in shapes]
    n_blocks = len(model.layers)
    trainable = [g for i, g in enumerate(ag_bytes) if i - 1 != frozen_block]

    _, x = _batch()
    out = model(x)
    # Forward: one all-gather per group, root first, then the blocks in order.
    _expect(
        "[r.op for r in comm.records]",
        [r.op for r in comm.records],
        ["all_gather"] * (1 + n_blocks),
    )
    _expect("[r.nbytes for r in comm.records]", [r.nbytes for r in comm.records], ag_bytes)
    _expect("{r.dtype for r in comm.records}", {r.dtype for r in comm.records}, {torch.float32})
    comm.reset()

    _loss(out).backward()
    # Backward: the root kept its parameters (reshard_after_forward=None -> False for the root);
    # every block was resharded, so it all-gathers once more, in reverse order.
    ags = [r for r in comm.records if r.op == "all_gather"]
    rss = [r for r in comm.records if r.op == "reduce_scatter"]
    _expect(
        "comm.count_by_op()",
        comm.count_by_op(),
        {"all_gather": n_blocks, "reduce_scatter": len(trainable)},
    )
    _expect("[r.nbytes for r in ags]", [r.nbytes for r in ags], ag_bytes[:0:-1])
    # One reduce-scatter per group with trainable parameters: W x that group's shard bytes.
    _expect(
        "sorted(r.nbytes for r in rss)",
        sorted(r.nbytes for r in rss),
        sorted(world * b for b in trainable),
    )
    _expect(
        'comm.bytes_by_op()["reduce_scatter"]',
        comm.bytes_by_op()["reduce_scatter"],
        world * sum(trainable),
    )
    _expect("{r.dtype for r in comm.records}", {r.dtype for r in comm.records}, {torch.float32})


@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_all_gather_per_unshard_and_one_reduce_scatter_per_group(world: int) -> None:
    run_distributed(_step_collectives, world, None)


def test_frozen_group_all_gathers_for_backward_but_reduces_nothing() -> None:
    run_distributed(_step_collectives, 3, 1)


def _no_sync_then_sync(reshard_after_forward: bool | None) -> None:
    model, replica, comm = _setup(reshard_after_forward=reshard_after_forward)
    n_blocks = len(model.layers)
    (gx1, x1), (gx2, x2) = _batch(1), _batch(2)

    model.set_requires_gradient_sync(False)
    out = model(x1)
    comm.reset()
    _loss(out).backward()
    # Nothing is reduced; only groups freed after forward gather again.
    expected = {} if reshard_after_forward is False else {"all_gather": n_blocks}
    _expect("comm.count_by_op()", comm.count_by_op(), expected)
    assert all(p.grad is None for p in model.parameters())

    model.set_requires_gradient_sync(True)
    out = model(x2)
    comm.reset()
    _loss(out).backward()
    # The synced backward reduces the accumulated sum once: one reduce-scatter per group.
    _expect(
        'comm.count_by_op().get("reduce_scatter")',
        comm.count_by_op().get("reduce_scatter"),
        1 + n_blocks,
    )

    _loss(replica(gx1)).backward()
    _loss(replica(gx2)).backward()
    _assert_grads(model, replica)


@pytest.mark.parametrize("reshard_after_forward", [False, None])
def test_backward_without_gradient_sync_communicates_nothing(
    reshard_after_forward: bool | None,
) -> None:
    run_distributed(_no_sync_then_sync, 2, reshard_after_forward)


# -- gradients --------------------------------------------------------------------------------


def _grads_accumulate() -> None:
    model, replica, _ = _setup()
    gx, x = _batch()
    for _ in range(2):
        _loss(model(x)).backward()
    _loss(replica(gx)).backward()
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor), name
        assert p.grad.placements == p.placements == (Shard(0),), name
        assert p.grad.device_mesh is p.device_mesh, name
        assert p.grad.shape == p.shape and p.grad.to_local().shape == p.to_local().shape, name
    _assert_grads(model, replica, scale=2.0)


@pytest.mark.parametrize("world", [2, 3])
def test_grads_are_sharded_dtensors_that_accumulate(world: int) -> None:
    run_distributed(_grads_accumulate, world)


def _python_calls(fn: Any) -> int:
    """Python functions entered while ``fn()`` runs (``sys.setprofile``'s ``call`` events)."""
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def _second_model_steps_like_the_first() -> None:
    # DTensor's sharding-propagation cache compares the specs of a hit in Python unless they
    # are the objects it stored: a second model of the same layout (a reference model, EMA
    # weights) must step its optimizer at the first one's cost.
    steps = []
    for _ in range(2):
        model, _, _ = _setup()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
        steps.append((model, opt))
    _, x = _batch()
    counts = []
    for model, opt in steps:
        for _ in range(2):  # the first step fills the caches
            _loss(model(x)).backward()
            calls = _python_calls(opt.step)
            opt.zero_grad()
        counts.append(calls)
    _expect("Python calls in optimizer.step(), first and second model", counts[1], counts[0])


def test_a_second_model_of_one_layout_steps_at_the_first_ones_cost() -> None:
    run_distributed(_second_model_steps_like_the_first, 2)


# -- memory -----------------------------------------------------------------------------------


def _nothing_unsharded_stays_alive() -> None:
    model, _, _ = _setup()
    root, *blocks = _groups(model)
    _, x = _batch()
    out = model(x)
    _expect(
        "[_residency(b) for b in blocks]",
        [_residency(b) for b in blocks],
        ["sharded"] * len(blocks),
    )
    _expect("_residency(root)", _residency(root), "gathered")  # the root keeps them for backward
    _loss(out).backward()
    _expect(
        "[_residency(g) for g in _groups(model)]",
        [_residency(g) for g in _groups(model)],
        ["sharded"] * (1 + len(blocks)),
    )
    for g in _groups(model):
        for sp in g._fsdp_state.group.params:
            assert sp.unsharded_param is not None and sp.unsharded_param.grad is None, sp.fqn


@pytest.mark.parametrize("world", [2, 3])
def test_resharding_frees_unsharded_storage(world: int) -> None:
    run_distributed(_nothing_unsharded_stays_alive, world)


def _local_bytes() -> int:
    model, replica, _ = _setup()
    world, rank = dist.get_world_size(), dist.get_rank()
    expected = sum(
        _rows(p.shape[0], world, rank) * math.prod(p.shape[1:]) * ELEM for p in replica.parameters()
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, x = _batch()
    _loss(model(x)).backward()
    opt.step()
    total = 0
    for name, p in model.named_parameters():
        local = p.to_local()
        assert local.shape[0] == _rows(p.shape[0], world, rank), name
        # No padding rows hide behind the local tensor.
        assert local.untyped_storage().nbytes() == local.numel() * ELEM, name
        total += local.numel() * local.element_size()
    _expect("total", total, expected)
    return total


@pytest.mark.parametrize("world", [3, 4])
def test_each_rank_stores_only_its_shard_rows(world: int) -> None:
    per_rank = run_distributed(_local_bytes, world)
    torch.manual_seed(0)
    _expect("sum(per_rank)", sum(per_rank), sum(p.numel() * ELEM for p in Net().parameters()))


# -- what the module sees ---------------------------------------------------------------------


def _sees_plain_tensors() -> None:
    model, replica, _ = _setup()
    seen: list[tuple[str, bool, torch.Size]] = []

    def record(where: str) -> Any:
        def hook(module: nn.Module, *_: Any) -> None:
            for p in (module.weight, module.bias):
                seen.append((where, isinstance(p, DTensor), p.shape))

        return hook

    linear = model.layers[1].linear  # inside a block group, not the group's module itself
    linear.register_forward_pre_hook(record("pre"))
    linear.register_forward_hook(record("post"))
    _, x = _batch()
    _loss(model(x)).backward()
    full = [replica.layers[1].linear.weight.shape, replica.layers[1].linear.bias.shape]
    _expect("seen", seen, [("pre", False, s) for s in full] + [("post", False, s) for s in full])
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p, nn.Parameter), name


def test_forward_sees_plain_full_tensors_outside_dtensors() -> None:
    run_distributed(_sees_plain_tensors, 2)


def _own_call_or_module_call() -> None:
    """A sharded module whose only hooks are ours is called by ``FSDPModule.__call__`` itself,
    not through ``nn.Module._call_impl``; any other hook (its own, a global one) or a patched
    ``nn.Module.__call__`` (``torch.fx``'s tracer patches it) sends it back through
    ``_call_impl``, in torch's order: our pre-hook first, then the user's."""
    model, replica, _ = _setup()
    impl_calls: list[str] = []
    original = nn.Module._call_impl

    def counting(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self, FSDPModule):
            impl_calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    seen: list[tuple[str, bool]] = []
    module_call = nn.Module.__call__
    nn.Module._call_impl = counting  # type: ignore[method-assign]
    try:
        for step in range(4):
            handles = []
            if step == 1:  # the block's own hooks, after ours
                block = model.layers[1]
                handles.append(
                    block.register_forward_pre_hook(
                        lambda m, a: seen.append(("pre", isinstance(m.linear.weight, DTensor)))
                    )
                )
                handles.append(
                    block.register_forward_hook(lambda m, a, o: seen.append(("post", True)))
                )
            if step == 2:  # a global hook reaches every module
                handles.append(nn.modules.module.register_module_forward_hook(lambda m, a, o: None))
            if step == 3:  # as torch.fx patches it while it traces
                nn.Module.__call__ = lambda self, *a, **k: module_call(self, *a, **k)  # type: ignore[method-assign]
            gx, x = _batch(step)
            _loss(model(x)).backward()
            _loss(replica(gx)).backward()
            _assert_grads(model, replica)  # both accumulate: never cleared
            for h in handles:
                h.remove()
            nn.Module.__call__ = module_call  # type: ignore[method-assign]
            every = ["FSDPNet"] + ["FSDPMLPBlock"] * len(model.layers)
            through = [[], ["FSDPMLPBlock"], every, every]
            _expect(f"step {step}: modules through _call_impl", impl_calls, through[step])
            impl_calls.clear()
    finally:
        nn.Module._call_impl = original  # type: ignore[method-assign]
        nn.Module.__call__ = module_call  # type: ignore[method-assign]
    _expect("the block's own hooks", seen, [("pre", False), ("post", True)])


def test_a_module_with_only_our_hooks_skips_module_call_impl() -> None:
    run_distributed(_own_call_or_module_call, 2)


# -- reshard_after_forward ----------------------------------------------------------------------


def _reshard_after_forward(flag: bool | None) -> None:
    model, _, comm = _setup(reshard_after_forward=flag)
    groups = _groups(model)
    _, x = _batch()
    out = model(x)
    # None: False for the root, True for the others. Which group is the root is only known
    # after lazy init (the first forward), so this is read after it.
    assert [g._fsdp_state.is_root for g in groups] == [g is model for g in groups]
    frees = [flag if flag is not None else not g._fsdp_state.is_root for g in groups]
    _expect(
        "[_residency(g) for g in groups]",
        [_residency(g) for g in groups],
        ["sharded" if f else "gathered" for f in frees],
    )
    comm.reset()
    _loss(out).backward()
    _expect(
        'comm.count_by_op().get("all_gather", 0)',
        comm.count_by_op().get("all_gather", 0),
        sum(frees),
    )
    _expect(
        "[_residency(g) for g in groups]",
        [_residency(g) for g in groups],
        ["sharded"] * len(groups),
    )


@pytest.mark.parametrize("flag", [True, False, None])
def test_reshard_after_forward_decides_what_backward_gathers(flag: bool | None) -> None:
    run_distributed(_reshard_after_forward, 2, flag)


# -- explicit unshard / reshard -------------------------------------------------------------------


def _explicit_unshard() -> None:
    model, replica, comm = _setup()
    gx, x = _batch()
    _loss(model(x)).backward()  # first iteration: lazy init
    model.zero_grad()
    block, ref_block = model.layers[0], replica.layers[0]

    assert block.unshard() is None
    assert not isinstance(block.linear.weight, DTensor)
    torch.testing.assert_close(block.linear.weight, ref_block.linear.weight, atol=0, rtol=0)
    _expect("_residency(block)", _residency(block), "gathered")
    block.reshard()
    _expect("_residency(block)", _residency(block), "sharded")
    assert isinstance(block.linear.weight, DTensor)

    comm.reset()
    handle = block.unshard(async_op=True)
    assert isinstance(handle, UnshardHandle)
    handle.wait()
    _expect("comm.count_by_op()", comm.count_by_op(), {"all_gather": 1})
    torch.testing.assert_close(block.linear.bias, ref_block.linear.bias, atol=0, rtol=0)

    # The forward finds the block gathered: only the other groups all-gather.
    comm.reset()
    out = model(x)
    _expect("comm.count_by_op()", comm.count_by_op(), {"all_gather": len(model.layers)})
    torch.testing.assert_close(_full(out), replica(gx)[dist.get_rank() * ROWS :][:ROWS])


def test_explicit_unshard_and_reshard() -> None:
    run_distributed(_explicit_unshard, 2)


def _unshard_before_first_forward() -> None:
    model, replica, comm = _setup()
    gx, x = _batch()
    handle = model.layers[0].unshard(async_op=True)
    assert handle is not None
    handle.wait()
    out = model(x)
    _expect("comm.count_by_op()", comm.count_by_op(), {"all_gather": 1 + len(model.layers)})
    torch.testing.assert_close(out, replica(gx)[dist.get_rank() * ROWS :][:ROWS])


def test_unshard_before_the_first_forward() -> None:
    run_distributed(_unshard_before_first_forward, 2)


# -- reshard_after_backward ---------------------------------------------------------------------


def _keep_after_backward() -> None:
    model, replica, comm = _setup()
    gx, x = _batch()
    model.set_reshard_after_backward(False)
    _loss(model(x)).backward()
    _expect(
        "[_residency(g) for g in _groups(model)]",
        [_residency(g) for g in _groups(model)],
        ["gathered"] * (1 + len(model.layers)),
    )
    comm.reset()
    out = model(x)
    _expect('comm.count_by_op().get("all_gather", 0)', comm.count_by_op().get("all_gather", 0), 0)
    torch.testing.assert_close(out, replica(gx)[dist.get_rank() * ROWS :][:ROWS])


def test_reshard_after_backward_false_keeps_params_for_next_forward() -> None:
    run_distributed(_keep_after_backward, 2)


# -- register_fsdp_forward_method ---------------------------------------------------------------


def _generate() -> None:
    model, replica, _ = _setup()
    gx, x = _batch()
    with pytest.raises(RuntimeError, match="DTensor"):
        model.generate(x)  # the root's parameters are still DTensors outside forward
    register_fsdp_forward_method(model, "generate")
    rows = slice(dist.get_rank() * ROWS, (dist.get_rank() + 1) * ROWS)

    with torch.no_grad():
        got = model.generate(x, temperature=0.25)
    torch.testing.assert_close(got, replica.generate(gx, temperature=0.25)[rows])
    _expect(
        "[_residency(g) for g in _groups(model)]",
        [_residency(g) for g in _groups(model)],
        ["sharded"] * (1 + len(model.layers)),
    )

    # With grad on it is a training step like forward: each rank's loss sums its own rows, so
    # the averaged gradient is that of the sum over all rows divided by W.
    model.generate(x).pow(2).sum().backward()
    replica.generate(gx).pow(2).sum().div(dist.get_world_size()).backward()
    _assert_grads(model, replica)


def test_registered_forward_method_gathers_like_forward() -> None:
    run_distributed(_generate, 2)


# -- activation checkpointing -------------------------------------------------------------------


def _checkpointed() -> None:
    model, replica, comm = _setup(use_checkpoint=True)
    n_blocks = len(model.layers)
    gx, x = _batch()
    out = model(x)
    _expect("comm.count_by_op()", comm.count_by_op(), {"all_gather": 1 + n_blocks})
    comm.reset()
    _loss(out).backward()
    # The recompute of each block finds it gathered again: one all-gather per block.
    _expect(
        "comm.count_by_op()",
        comm.count_by_op(),
        {"all_gather": n_blocks, "reduce_scatter": 1 + n_blocks},
    )
    _expect(
        "[_residency(g) for g in _groups(model)]",
        [_residency(g) for g in _groups(model)],
        ["sharded"] * (1 + n_blocks),
    )
    _loss(replica(gx)).backward()
    _assert_grads(model, replica)


@pytest.mark.parametrize("world", [2, 3])
def test_activation_checkpointing_regathers_for_recompute(world: int) -> None:
    run_distributed(_checkpointed, world)


# -- clip_grad_norm_ ----------------------------------------------------------------------------


def _clip() -> None:
    model, replica, _ = _setup()
    gx, x = _batch()
    _loss(model(x)).backward()
    _loss(replica(gx)).backward()
    max_norm = 1e-3
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(replica.parameters(), max_norm)
    assert ref_norm > 10 * max_norm  # the clip really scales
    torch.testing.assert_close(_full(norm), ref_norm, atol=ATOL, rtol=RTOL)
    _assert_grads(model, replica)


@pytest.mark.parametrize("world", [2, 3])
def test_clip_grad_norm_matches_replica(world: int) -> None:
    run_distributed(_clip, world)


# -- eval / no_grad -----------------------------------------------------------------------------


def _no_grad_forward(mode: str) -> None:
    model, replica, _ = _setup()
    model.eval()
    replica.eval()
    gx, x = _batch()
    ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with ctx:
        out = model(x)
    rows = slice(dist.get_rank() * ROWS, (dist.get_rank() + 1) * ROWS)
    with torch.no_grad():
        torch.testing.assert_close(out, replica(gx)[rows])
    # No backward will come: every group is resharded, the root too.
    _expect(
        "[_residency(g) for g in _groups(model)]",
        [_residency(g) for g in _groups(model)],
        ["sharded"] * (1 + len(model.layers)),
    )


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_forward_without_grad_reshards_everything(mode: str) -> None:
    run_distributed(_no_grad_forward, 2, mode)


# -- tied parameters ----------------------------------------------------------------------------


def _tied() -> None:
    args = ModelArgs(tie_embeddings=True)
    check_parity(
        lambda: Transformer(args),
        wrap_layers_then_root(fully_shard),
        make_token_batch,
        mesh_1d(),
        steps=2,
    )
    torch.manual_seed(0)
    model = Transformer(args)
    n_params = len(list(model.parameters()))
    wrap_layers_then_root(fully_shard)(model, mesh_1d())
    assert model.output.weight is model.tok_embeddings.weight
    assert isinstance(model.output.weight, DTensor)
    inside: list[bool] = []
    model.output.register_forward_pre_hook(
        lambda m, _: inside.append(m.weight is model.tok_embeddings.weight)
    )
    tokens, _ = make_token_batch(ROWS, torch.Generator().manual_seed(3))
    model(tokens).sum().backward()
    _expect("inside", inside, [True])
    assert model.output.weight is model.tok_embeddings.weight
    _expect("len(list(model.parameters()))", len(list(model.parameters())), n_params)
    assert isinstance(model.tok_embeddings.weight.grad, DTensor)


def test_tied_embedding_and_head_stay_tied_with_correct_grads() -> None:
    run_distributed(_tied, 2)


# -- recovery -----------------------------------------------------------------------------------


def _boom(module: nn.Module, args: Any) -> None:
    raise RuntimeError("boom")


def _reset_after_exception() -> None:
    model, replica, _ = _setup()
    gx, x = _batch()
    handle = model.layers[1].linear.register_forward_pre_hook(_boom)
    with pytest.raises(RuntimeError, match="boom"):
        model(x)
    model.reset_iter_state()
    _expect(
        "[_residency(g) for g in _groups(model)]",
        [_residency(g) for g in _groups(model)],
        ["sharded"] * (1 + len(model.layers)),
    )
    handle.remove()
    _loss(model(x)).backward()
    _loss(replica(gx)).backward()
    _assert_grads(model, replica)


@pytest.mark.parametrize("world", [2, 3])
def test_reset_iter_state_recovers_from_an_exception_in_forward(world: int) -> None:
    run_distributed(_reset_after_exception, world)


# -- zero-size parameters -----------------------------------------------------------------------


class WithEmpty(nn.Module):
    """A block whose ``empty`` parameter has no elements (and, optionally, nothing else)."""

    def __init__(self, alone: bool) -> None:
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0, 4))
        self.linear = None if alone else nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = x if self.linear is None else self.linear(x)
        return y + self.empty.sum()


def _zero_size(alone: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(WithEmpty(alone), nn.Linear(4, 3))
    replica = copy.deepcopy(model)
    fully_shard(model[0], mesh=mesh_1d())
    fully_shard(model, mesh=mesh_1d())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, replica)]
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in range(2):
        gx = torch.randn(world * ROWS, 4, generator=torch.Generator().manual_seed(step))
        for opt in opts:
            opt.zero_grad()
        _loss(model(gx[rank * ROWS : (rank + 1) * ROWS])).backward()
        _loss(replica(gx)).backward()
        _assert_grads(model, replica)
        for opt in opts:
            opt.step()
    empty = model[0].empty
    assert isinstance(empty, DTensor)
    assert empty.shape == (0, 4) and empty.to_local().shape == (0, 4)
    assert empty.grad is not None and empty.grad.shape == (0, 4)
    for name, p in model.named_parameters():
        torch.testing.assert_close(_full(p), dict(replica.named_parameters())[name], msg=name)


@pytest.mark.parametrize("alone", [False, True], ids=["with_others", "alone"])
def test_zero_size_parameter_is_sharded_and_trains(alone: bool) -> None:
    run_distributed(_zero_size, 3, alone)


# -- repr and class -----------------------------------------------------------------------------


def _reprs() -> tuple[str, str]:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    block = MLPBlock(7, 13)  # weight (13, 7)
    fully_shard(block, mesh=device_mesh((world,), ("dp",)))
    sp = block._fsdp_state.group.params[0]
    sharded = repr(sp)
    block.unshard()
    unsharded = repr(sp)
    block.reshard()
    _expect("sp.fqn", sp.fqn, "linear.weight")
    rows = _rows(13, world, rank)
    assert sharded == (
        f"ShardedParam(linear.weight, global=(13, 7), local=({rows}, 7), Shard(0)@dp, SHARDED)"
    )
    return sharded, unsharded


def test_sharded_param_repr_shows_the_sharding() -> None:
    results = run_distributed(_reprs, 2)
    assert results[0][0] == (
        "ShardedParam(linear.weight, global=(13, 7), local=(7, 7), Shard(0)@dp, SHARDED)"
    )
    assert results[1][1] == (
        "ShardedParam(linear.weight, global=(13, 7), local=(6, 7), Shard(0)@dp, UNSHARDED)"
    )


def _class_swap() -> None:
    model, _, _ = _setup()
    for m in model.layers:
        assert isinstance(m, FSDPModule) and isinstance(m, MLPBlock)
        _expect("type(m).__name__", type(m).__name__, "FSDPMLPBlock")
        assert type(m) is type(model.layers[0])  # one class per original class
        assert type(m.linear) is nn.Linear  # modules inside a group keep their class
    assert isinstance(model, FSDPModule) and isinstance(model, Net)
    _expect("type(model).__name__", type(model).__name__, "FSDPNet")


def test_class_swap_keeps_the_original_class() -> None:
    run_distributed(_class_swap, 2)
