"""torch 2.13's ``FSDPModule`` methods, run side by side with torch's ``fully_shard``.

Each scenario builds one model and trains three copies for a few SGD steps on W gloo ranks:

- ``ours``: sharded by ``fully_shard.fully_shard``, configured with the method under test,
- ``torch``: sharded by ``torch.distributed.fsdp.fully_shard``, configured the same way
  (the same method name and arguments: the drop-in promise),
- ``ref``: unsharded, on the whole global batch (its gradient is the mean over ranks).

After every micro-batch the gradients of ours and torch's are compared exactly (``None`` on
both or bit-equal: the same collectives on gloo give the same bits); after the last one of a
step also against the reference, scaled by what the method makes of the mean (``factor=1``:
the sum, ``W`` times the mean); at the end every parameter against torch's.

Where torch cannot run a scenario on CPU (a custom divide factor needs NCCL's
``PREMUL_SUM``, which gloo lacks) the test says so and compares with the reference only.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference, tests only

# torch exports its comm protocols only from the private module behind set_custom_*; a
# user's subclass of them must work with ours, so the test subclasses them too.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as TorchAllGather
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as TorchReduceScatter
from torch.distributed.tensor import DTensor

from fully_shard import (
    AllGather,
    CountingComm,
    DataParallelMeshDims,
    FSDPModule,
    FullyShardTypeError,
    FullyShardValueError,
    MixedPrecisionPolicy,
    ReduceScatter,
    fully_shard,
    share_comm_ctx,
)
from fully_shard.collectives import Reduction, plan_reduction
from harness import device_mesh, mesh_1d, run_distributed
from parity import needs_torch_fsdp2_on_cpu

DIM, ROWS, VOCAB = 8, 2, 16
TIMEOUT = 90.0  # seconds: a mismatched collective must fail the test, not hang it

Configure = Callable[[nn.Module, str], None]
"""``configure(model, kind)``: call the method under test; ``kind`` is 'ours' or 'torch'."""


class Blocks(nn.Module):
    """``stem`` (root group), then ``layers`` of Linear + tanh (one group each)."""

    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.stem = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(n_layers)
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        for layer in self.layers:
            h = layer(h)
        return h


def _mesh(shape: Sequence[int] | None) -> DeviceMesh:
    if shape is None:
        return mesh_1d()
    return device_mesh(tuple(shape), ("replicate", "shard"))


def _wrap(model: nn.Module, shard: Callable[..., Any], mesh: DeviceMesh, **options: Any) -> None:
    for layer in model.get_submodule("layers").children():
        shard(layer, mesh=mesh, **options)
    shard(model, mesh=mesh, **options)


def _full(t: Tensor | None) -> Tensor | None:
    if t is None:
        return None
    return t.full_tensor() if isinstance(t, DTensor) else t


def _same(what: str, got: Tensor | None, want: Tensor | None, atol: float = 0.0) -> None:
    if (got is None) != (want is None):
        raise AssertionError(f"{what}: one side is None ({got is None} vs {want is None})")
    if got is not None and want is not None:
        torch.testing.assert_close(got, want, atol=atol, rtol=0.0 if atol == 0 else 1e-5, msg=what)


def _float_batch(step: int, n: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, DIM, generator=gen), torch.randn(n, DIM, generator=gen)


def _side_by_side(
    make: Callable[[], nn.Module],
    configure: Configure | None = None,
    *,
    mesh_shape: Sequence[int] | None = None,
    steps: int = 3,
    micro: int = 1,
    per_micro: Callable[[nn.Module, int, int], None] | None = None,
    ref_scale: float = 1.0,
    with_torch: bool = True,
    options: tuple[dict[str, Any], dict[str, Any]] = ({}, {}),
    batch: Callable[[int, int], tuple[Tensor, Tensor]] = _float_batch,
    ref_atol: float = 1e-5,
    wrap: Callable[..., None] | None = None,
) -> dict[str, Any]:
    """Train ours (and torch's) and the reference; raise on the first difference.

    ``per_micro(model, i, micro)`` runs on both sharded models before micro-batch ``i``.
    ``ref_scale``: what ours' gradient is in units of the reference's (the mean).
    Returns ``{"ours": model, "torch": model}`` for further checks.
    """
    mesh = _mesh(mesh_shape)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    base = make()
    sharded = {"ours": copy.deepcopy(base)}
    if with_torch:
        sharded["torch"] = copy.deepcopy(base)
    wrap = wrap or _wrap
    wrap(sharded["ours"], fully_shard, mesh, **options[0])
    if with_torch:
        wrap(sharded["torch"], torch_fully_shard, mesh, **options[1])
    for kind, model in sharded.items():
        if configure is not None:
            configure(model, kind)
    models = {**sharded, "ref": base}
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    for step in range(steps):
        x, target = batch(step, world * micro * ROWS)
        ref_loss = ((base(x).float() - target) ** 2).mean()
        ref_loss.backward()
        for i in range(micro):
            lo = (rank * micro + i) * ROWS
            for model in sharded.values():
                if per_micro is not None:
                    per_micro(model, i, micro)
                loss = ((model(x[lo : lo + ROWS]).float() - target[lo : lo + ROWS]) ** 2).mean()
                (loss / micro).backward()
            if with_torch:
                theirs = dict(sharded["torch"].named_parameters())
                for n, p in sharded["ours"].named_parameters():
                    _same(
                        f"step {step} micro {i}: grad {n} vs torch",
                        _full(p.grad),
                        _full(theirs[n].grad),
                    )
        ref = dict(base.named_parameters())
        for n, p in sharded["ours"].named_parameters():
            want = None if ref[n].grad is None else ref[n].grad * ref_scale
            _same(f"step {step}: grad {n} vs reference", _full(p.grad), want, ref_atol)
        for p in base.parameters():  # the reference steps on what the method computes
            if p.grad is not None:
                p.grad.mul_(ref_scale)
        for opt in optims.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
    if with_torch:
        theirs = dict(sharded["torch"].named_parameters())
        for n, p in sharded["ours"].named_parameters():
            _same(f"param {n} vs torch", _full(p.detach()), _full(theirs[n].detach()))
    return sharded


def _call(name: str, *args: Any, **kwargs: Any) -> Configure:
    """``configure`` that calls ``model.<name>(*args, **kwargs)`` on both models."""

    def configure(model: nn.Module, kind: str) -> None:
        getattr(model, name)(*args, **kwargs)

    return configure


pytestmark = needs_torch_fsdp2_on_cpu


# -- divide factor and force-sum ----------------------------------------------------------------


def _divide_factor(factor: float, force_sum: bool) -> None:
    def configure(model: nn.Module, kind: str) -> None:
        for m in model.modules():
            if isinstance(m, FSDPModule) or (
                kind == "torch" and hasattr(m, "set_gradient_divide_factor")
            ):
                m.set_gradient_divide_factor(factor)  # type: ignore[operator]
                if force_sum:
                    m.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]

    world = dist.get_world_size()
    # factor == W averages on gloo (AVG); any other factor needs PREMUL_SUM, which only NCCL
    # has, unless sums are forced: torch then cannot run it here, so the reference decides.
    with_torch = force_sum or factor == world
    _side_by_side(Blocks, configure, ref_scale=world / factor, with_torch=with_torch)


@pytest.mark.parametrize(
    ("world", "factor", "force_sum"),
    [
        (2, 1.0, True),
        (4, 1.0, True),
        (2, 2.0, False),
        (3, 3.0, True),
        (2, 1.0, False),
        (4, 8.0, False),
    ],
)
def test_gradient_divide_factor(world: int, factor: float, force_sum: bool) -> None:
    """factor 1 is the sum over ranks; factor W the mean; other factors scale it."""
    run_distributed(_divide_factor, world, factor, force_sum, timeout=TIMEOUT)


def _force_sum_only() -> None:
    def configure(model: nn.Module, kind: str) -> None:
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms") and isinstance(m, nn.Module):
                m.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]

    _side_by_side(Blocks, configure)


@pytest.mark.parametrize("world", [2, 3])
def test_force_sum_reduction_for_comms(world: int) -> None:
    run_distributed(_force_sum_only, world, timeout=TIMEOUT)


def _fp16_reduce() -> None:
    # fp16 reduce dtype: the division is split before and after the sum, as torch does.
    ours = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float16)}
    theirs = {"mp_policy": TorchMixedPrecisionPolicy(reduce_dtype=torch.float16)}
    _side_by_side(Blocks, options=(ours, theirs), ref_atol=2e-3)


def test_fp16_reduction_divides_before_and_after_like_torch() -> None:
    run_distributed(_fp16_reduce, 4, timeout=TIMEOUT)


def test_plan_reduction_divides_by_the_factor_in_total() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for shard, rep in ((1, 1), (2, 1), (4, 2), (3, 1), (8, 4)):
            for factor in (None, 1.0, 3.0, float(shard), 6.0):
                for force in (False, True):
                    plan = plan_reduction(dtype, shard, rep, factor=factor, force_sum=force)
                    total = plan.reduce_scatter.divisor(shard) * plan.all_reduce.divisor(rep)
                    total *= plan.post_divide or 1.0
                    want = shard * rep if factor is None else factor
                    assert total == pytest.approx(want), (dtype, shard, rep, factor, force, plan)
                    if force or dtype in (torch.float16, torch.float64):
                        assert plan.reduce_scatter.op == "sum" and plan.all_reduce.op == "sum"
    fp16 = plan_reduction(torch.float16, 16, 1)
    assert fp16.reduce_scatter == Reduction("sum", pre_divide=4.0) and fp16.post_divide == 4.0


def _deprecated_alias() -> None:
    model = Blocks()
    _wrap(model, fully_shard, mesh_1d())
    with pytest.warns(DeprecationWarning, match="set_gradient_divide_factor"):
        model.set_reduce_scatter_divide_factor(2.0)  # type: ignore[operator]
    assert model._fsdp_state.group.config.gradient_divide_factor == 2.0  # type: ignore[union-attr]


def test_set_reduce_scatter_divide_factor_is_deprecated() -> None:
    run_distributed(_deprecated_alias, 1)


# -- HSDP: requires_all_reduce ----------------------------------------------------------------


def _all_reduce_last_micro(model: nn.Module, i: int, micro: int) -> None:
    model.set_requires_all_reduce(i == micro - 1)  # type: ignore[operator]


def _hsdp_requires_all_reduce() -> None:
    _side_by_side(Blocks, mesh_shape=(2, 2), micro=3, per_micro=_all_reduce_last_micro)


def test_hsdp_requires_all_reduce_false_then_true() -> None:
    """Micro-batches 1-2 only reduce-scatter (sharded grads untouched, on both), the last
    adds their partial sums and all-reduces once."""
    run_distributed(_hsdp_requires_all_reduce, 4, timeout=TIMEOUT)


def _gradient_sync_resets_all_reduce() -> None:
    model = Blocks()
    _wrap(model, fully_shard, _mesh((2, 2)))
    model.set_requires_all_reduce(False)  # type: ignore[operator]
    model.set_requires_gradient_sync(True)  # type: ignore[operator]
    for m in model.modules():
        if isinstance(m, FSDPModule):
            assert m._fsdp_state.group.config.requires_all_reduce


def test_set_requires_gradient_sync_sets_all_reduce_too() -> None:
    run_distributed(_gradient_sync_resets_all_reduce, 4)


# -- all-reduce hook --------------------------------------------------------------------------


def _halve(t: Tensor) -> None:
    t.mul_(0.5)


def _all_reduce_hook(mesh_shape: tuple[int, int] | None) -> int:
    calls = {"ours": 0, "torch": 0}

    def configure(model: nn.Module, kind: str) -> None:
        def hook(t: Tensor) -> None:
            calls[kind] += 1
            _halve(t)

        for m in model.modules():
            if hasattr(m, "set_all_reduce_hook") and isinstance(m, nn.Module):
                m.set_all_reduce_hook(hook)  # type: ignore[operator]

    _side_by_side(Blocks, configure, mesh_shape=mesh_shape, ref_scale=0.5)
    if calls["ours"] != calls["torch"] or calls["ours"] == 0:
        raise AssertionError(f"hook calls: {calls}")
    return calls["ours"]


@pytest.mark.parametrize(("world", "mesh_shape"), [(2, None), (4, (2, 2))])
def test_all_reduce_hook(world: int, mesh_shape: tuple[int, int] | None) -> None:
    """Called once per group per backward with the reduced buffer, which it may edit."""
    calls = run_distributed(_all_reduce_hook, world, mesh_shape, timeout=TIMEOUT)
    assert calls == [3 * 3] * world  # 3 groups x 3 steps


# -- custom all-gather / reduce-scatter ---------------------------------------------------------


def _all_gather(out: Tensor, inp: Tensor, group: Any, async_op: bool) -> Any:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter(out: Tensor, inp: Tensor, group: Any, op: Any) -> Any:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=op, group=group)


class _Counts:
    def __init__(self) -> None:
        self.calls = 0
        self.allocs: list[tuple[tuple[int, ...], torch.dtype]] = []

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        self.allocs.append((tuple(size), dtype))
        return torch.empty(*size, dtype=dtype, device=device)


class _CountingAllGather(_Counts):
    """An all-gather that counts its calls and allocations, then gathers as torch does."""

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Any, async_op: bool = False
    ) -> Any:
        self.calls += 1
        return _all_gather(output_tensor, input_tensor, group, async_op)


class _CountingReduceScatter(_Counts):
    """A reduce-scatter that counts its calls and allocations, then reduces as torch does."""

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        self.calls += 1
        return _reduce_scatter(output_tensor, input_tensor, group, op)


class TorchStyleAllGather(_CountingAllGather, TorchAllGather):
    """A subclass of torch's own AllGather: accepted by ours too."""


class TorchStyleReduceScatter(_CountingReduceScatter, TorchReduceScatter):
    """A subclass of torch's own ReduceScatter: accepted by ours too."""


class OurAllGather(_CountingAllGather, AllGather):
    """A subclass of our AllGather."""


class OurReduceScatter(_CountingReduceScatter, ReduceScatter):
    """A subclass of our ReduceScatter."""


def _custom_comms(our_classes: bool) -> list[int]:
    comms: dict[str, tuple[_Counts, _Counts]] = {}
    counter = CountingComm()

    def configure(model: nn.Module, kind: str) -> None:
        if kind == "ours" and our_classes:
            ag, rs = OurAllGather(), OurReduceScatter()
        else:
            ag, rs = TorchStyleAllGather(), TorchStyleReduceScatter()
        comms[kind] = (ag, rs)
        for layer in model.get_submodule("layers").children():
            layer.set_custom_all_gather(ag)  # type: ignore[operator]
            layer.set_custom_reduce_scatter(rs)  # type: ignore[operator]
        if kind == "ours":
            model.set_comm(counter)  # type: ignore[operator]  # sees the root's own collectives

    _side_by_side(Blocks, configure)
    (ag, rs), (tag, trs) = comms["ours"], comms["torch"]
    if (ag.calls, rs.calls) != (tag.calls, trs.calls):
        raise AssertionError(f"calls: ours {(ag.calls, rs.calls)}, torch {(tag.calls, trs.calls)}")
    if ag.allocs != tag.allocs or rs.allocs != trs.allocs:
        raise AssertionError(
            f"allocations differ: {ag.allocs, rs.allocs} vs {tag.allocs, trs.allocs}"
        )
    # The root's own group keeps the default comm (set on the layers only).
    return [ag.calls, rs.calls, counter.count_by_op().get("all_gather", 0)]


@pytest.mark.parametrize("our_classes", [True, False], ids=["our-protocols", "torch-subclasses"])
def test_custom_all_gather_and_reduce_scatter(our_classes: bool) -> None:
    """Both layers' all-gathers (forward + backward) and reduce-scatters go through the
    user's objects, with its buffers; the root group's stay on the default comm."""
    ag_calls, rs_calls, root_gathers = run_distributed(
        _custom_comms, 2, our_classes, timeout=TIMEOUT
    )[0]
    assert (ag_calls, rs_calls, root_gathers) == (2 * 2 * 3, 2 * 3, 3)


class _Trace:
    def __init__(self) -> None:
        self.ops: list[str] = []

    def begin(self, group: Any, kind: str) -> None:
        pass

    def end(self, group: Any, kind: str) -> None:
        pass

    def collective(self, group: Any, call: Any, issue: Callable[[], Any]) -> Any:
        self.ops.append(call.op)
        return issue()


def _custom_comm_is_observed() -> list[str]:
    model = Blocks(n_layers=1)
    _wrap(model, fully_shard, mesh_1d())
    layer = model.layers[0]
    ag, rs = OurAllGather(), OurReduceScatter()
    layer.set_custom_all_gather(ag)  # type: ignore[operator]
    layer.set_custom_reduce_scatter(rs)  # type: ignore[operator]
    trace = _Trace()
    group = layer._fsdp_state.group  # type: ignore[union-attr]
    group.observers += (trace,)
    model(torch.randn(ROWS, DIM)).sum().backward()
    assert ag.calls == 2 and rs.calls == 1
    return trace.ops


def test_custom_comms_go_through_the_observers() -> None:
    assert run_distributed(_custom_comm_is_observed, 2)[0] == [
        "all_gather",
        "all_gather",
        "reduce_scatter",
    ]


# -- unshard_in_backward ---------------------------------------------------------------------------


class EmbedNet(nn.Module):
    """An embedding (its own group: backward never reads its weight), then Linear blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2))

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return h


def _wrap_embed(
    model: nn.Module, shard: Callable[..., Any], mesh: DeviceMesh, **options: Any
) -> None:
    shard(model.get_submodule("embed"), mesh=mesh, **options)
    _wrap(model, shard, mesh, **options)


def _token_batch(step: int, n: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (n, 3), generator=gen), torch.randn(n, 3, DIM, generator=gen)


def _unshard_in_backward() -> list[int]:
    gathers = []
    for flag in (True, False):
        counter = CountingComm()

        def configure(
            model: nn.Module, kind: str, flag: bool = flag, counter: CountingComm = counter
        ) -> None:
            model.get_submodule("embed").set_unshard_in_backward(flag)  # type: ignore[operator]
            if kind == "ours":
                model.set_comm(counter)  # type: ignore[operator]

        _side_by_side(EmbedNet, configure, batch=_token_batch, wrap=_wrap_embed)
        gathers.append(counter.count_by_op()["all_gather"])
    return gathers


def test_unshard_in_backward_false_skips_the_embeddings_backward_gather() -> None:
    gathered_for_backward, skipped = run_distributed(_unshard_in_backward, 2, timeout=TIMEOUT)[0]
    assert gathered_for_backward - skipped == 3  # one all-gather fewer per step (3 steps)


def _unshard_in_backward_when_backward_needs_it() -> str:
    model = Blocks(n_layers=1)
    _wrap(model, fully_shard, mesh_1d())
    model.layers[0].set_unshard_in_backward(False)  # type: ignore[operator]
    x = torch.randn(ROWS, DIM, requires_grad=True)
    with pytest.raises(RuntimeError) as info:
        model(x).sum().backward()
    model.reset_iter_state()  # type: ignore[operator]
    return type(info.value).__name__


def test_unshard_in_backward_false_when_backward_reads_the_weight_raises() -> None:
    """A Linear's weight is needed for its input's gradient: autograd finds freed storage."""
    run_distributed(_unshard_in_backward_when_backward_needs_it, 2, timeout=TIMEOUT)


# -- reduce_scatter_unused_params ---------------------------------------------------------------


class Branchy(nn.Module):
    """One group whose ``extra`` branch runs only where ``use_extra`` is set (per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, DIM)
        self.extra = nn.Linear(DIM, DIM)
        self.use_extra = True

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.base(x))
        return self.extra(h) if self.use_extra else h


def _unused_params() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = Branchy()
    models = {"ours": copy.deepcopy(ref), "torch": copy.deepcopy(ref)}
    fully_shard(models["ours"], mesh=mesh_1d())
    torch_fully_shard(models["torch"], mesh=mesh_1d())
    for m in models.values():
        m.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
        m.use_extra = rank == 0  # rank 1 never touches extra
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, target = _float_batch(step, world * ROWS)
        total = torch.zeros(())
        for r in range(world):  # the reference: each rank's loss with that rank's branch
            ref.use_extra = r == 0
            rows = slice(r * ROWS, (r + 1) * ROWS)
            total = total + ((ref(x[rows]) - target[rows]) ** 2).mean()
        (total / world).backward()
        mine = slice(rank * ROWS, (rank + 1) * ROWS)
        for m in models.values():
            ((m(x[mine]) - target[mine]) ** 2).mean().backward()
        theirs, refs = dict(models["torch"].named_parameters()), dict(ref.named_parameters())
        for n, p in models["ours"].named_parameters():
            _same(f"step {step} grad {n} vs torch", _full(p.grad), _full(theirs[n].grad))
            _same(f"step {step} grad {n} vs reference", _full(p.grad), refs[n].grad, 1e-5)
        for opt in (*optims.values(), ref_opt):
            opt.step()
            opt.zero_grad(set_to_none=True)


def test_reduce_scatter_unused_params_with_conditional_control_flow() -> None:
    """Rank 0 uses ``extra``, rank 1 does not: both reduce-scatter the same layout (zeros
    for rank 1's missing gradient) and nobody hangs (hard timeout)."""
    run_distributed(_unused_params, 2, timeout=TIMEOUT)


def _unused_everywhere_default() -> None:
    # Default (as torch): a parameter no rank used keeps grad None.
    torch.manual_seed(0)
    ref = Branchy()
    ref.use_extra = False
    models = {"ours": copy.deepcopy(ref), "torch": copy.deepcopy(ref)}
    fully_shard(models["ours"], mesh=mesh_1d())
    torch_fully_shard(models["torch"], mesh=mesh_1d())
    for flag in (False, True):
        for m in models.values():
            m.set_reduce_scatter_unused_params(flag)  # type: ignore[operator]
            m.zero_grad(set_to_none=True)
            m(torch.randn(ROWS, DIM)).sum().backward()
        ours, theirs = models["ours"].extra.weight.grad, models["torch"].extra.weight.grad
        _same(f"unused everywhere, flag {flag}", _full(ours), _full(theirs))
        assert (ours is None) == (not flag)


def test_parameter_unused_on_every_rank() -> None:
    run_distributed(_unused_everywhere_default, 2, timeout=TIMEOUT)


# -- knobs for CUDA / NCCL resources: accepted, numbers unchanged --------------------------------


def _resource_knobs(which: str) -> None:
    def configure(model: nn.Module, kind: str) -> None:
        if which == "separate_group":
            model.set_separate_reduce_scatter_group(True)  # type: ignore[operator]
        elif which == "max_buffers":
            model.set_reduce_scatter_max_input_buffers(2)  # type: ignore[operator]
        elif which == "pg_alloc":
            for m in model.modules():
                if hasattr(m, "set_allocate_memory_from_process_group_for_comm"):
                    m.set_allocate_memory_from_process_group_for_comm(True)  # type: ignore[operator]

    models = _side_by_side(Blocks, configure)
    if which == "separate_group":
        groups = {
            id(m._fsdp_state.group.config.reduce_scatter_group)
            for m in models["ours"].modules()
            if isinstance(m, FSDPModule)
        }
        assert len(groups) == 1, "one new process group, shared by every group of these ranks"


@pytest.mark.parametrize("which", ["separate_group", "max_buffers", "pg_alloc"])
def test_communication_resource_knobs_keep_the_numbers(which: str) -> None:
    run_distributed(_resource_knobs, 2, which, timeout=TIMEOUT)


def _post_optim_event() -> None:
    def configure(model: nn.Module, kind: str) -> None:
        if kind == "ours":  # torch's FSDP2 would make a CPU stream wait on it
            model.set_post_optim_event(torch.cpu.Event())  # type: ignore[operator]

    _side_by_side(Blocks, configure)


def test_set_post_optim_event_on_cpu() -> None:
    run_distributed(_post_optim_event, 2, timeout=TIMEOUT)


def _share_comm_ctx() -> None:
    torch.manual_seed(0)
    stages = [Blocks(), Blocks()]
    for stage in stages:
        _wrap(stage, fully_shard, mesh_1d())
    share_comm_ctx(stages)  # type: ignore[arg-type]
    share_comm_ctx([])
    for stage in stages:
        stage(torch.randn(ROWS, DIM)).sum().backward()
    with pytest.raises(FullyShardValueError, match="item 1 is a Linear"):
        share_comm_ctx([stages[0], nn.Linear(2, 2)])  # type: ignore[list-item]
    with pytest.raises(FullyShardTypeError, match="list of FSDPModules"):
        share_comm_ctx(stages[0])  # type: ignore[arg-type]


def test_share_comm_ctx() -> None:
    run_distributed(_share_comm_ctx, 2)


def test_data_parallel_mesh_dims_as_torch() -> None:
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

    for kwargs in ({"shard": "dp"}, {"replicate": "rep"}, {"shard": ("a", "b"), "replicate": "c"}):
        ours, theirs = DataParallelMeshDims(**kwargs), TorchDims(**kwargs)
        assert (ours.shard_names, ours.replicate_names) == (
            theirs.shard_names,
            theirs.replicate_names,
        )
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        DataParallelMeshDims()
    with pytest.raises(FullyShardTypeError, match="mesh dim name"):
        DataParallelMeshDims(shard=3)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DataParallelMeshDims(shard="dp").shard = "other"  # not frozen, like torch's
