"""The catalogue of bad inputs: each raises a clear error and leaves the module as it was.

Every case builds a fresh model, takes a snapshot of everything ``fully_shard`` could change
(classes, parameter objects and values, hooks, instance attributes), makes the bad call and
checks the exception type and message, then checks the snapshot is unchanged and that a
valid ``fully_shard`` call on the same model still trains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fully_shard import (
    CPUOffloadPolicy,
    FullyShardError,
    FullyShardStateError,
    FullyShardTypeError,
    FullyShardValueError,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from harness import mesh_1d, run_distributed
from models import SmallNet
from parity import assert_same, snapshot


def still_trains(model: nn.Module) -> None:
    """A valid fully_shard call after the failed one works, and a step runs."""
    mesh = mesh_1d()
    fully_shard(model.inner, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(4, 5)).sum().backward()
    for p in model.parameters():
        assert p.grad is not None


@dataclass(frozen=True)
class Case:
    """One bad call: what to pass, which error, which words the message must contain."""

    name: str
    call: Callable[[SmallNet], object]
    error: type[Exception]
    words: tuple[str, ...]


def _replicate_fn(p: nn.Parameter) -> Any:
    return Replicate()


def _shard2_fn(p: nn.Parameter) -> Shard:
    return Shard(2)


def _mixed_devices(m: SmallNet) -> object:
    m.out.bias = nn.Parameter(torch.empty(3, device="meta"))
    return fully_shard(m, mesh=mesh_1d())


def _mixed_dtypes(m: SmallNet) -> object:
    m.out.bias = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    return fully_shard(m, mesh=mesh_1d())


def _scalar_param(m: SmallNet) -> object:
    m.scale = nn.Parameter(torch.tensor(1.0))
    return fully_shard(m, mesh=mesh_1d())


def _dtensor_param(m: SmallNet) -> object:
    mesh = mesh_1d()
    m.out.weight = nn.Parameter(distribute_tensor(m.out.weight.detach(), mesh, [Shard(0)]))
    return fully_shard(m.out, mesh=mesh)


def _tied_across_groups(m: SmallNet) -> object:
    m.out.weight = nn.Parameter(torch.randn(3, 7))
    m.extra = nn.Linear(7, 3)
    m.extra.weight = m.out.weight
    fully_shard(m.out, mesh=mesh_1d())
    return fully_shard(m, mesh=mesh_1d())


def _three_d_mesh(m: SmallNet) -> object:
    return fully_shard(m, mesh=init_device_mesh("cpu", (1, 1, dist.get_world_size())))


CASES = [
    Case("not a module", lambda m: fully_shard("net"), FullyShardTypeError, ("nn.Module", "str")),  # type: ignore[call-overload]
    Case("empty list", lambda m: fully_shard([]), FullyShardValueError, ("empty list",)),
    Case(
        "list with a non-module",
        lambda m: fully_shard([m.out, 3]),  # type: ignore[list-item]
        FullyShardTypeError,
        ("item 1", "int"),
    ),
    Case(
        "same module twice in a list",
        lambda m: fully_shard([m.out, m.out], mesh=mesh_1d()),
        FullyShardValueError,
        ("same module twice",),
    ),
    Case(
        "mesh of the wrong type",
        lambda m: fully_shard(m, mesh="dp"),  # type: ignore[arg-type]
        FullyShardTypeError,
        ("DeviceMesh", "str"),
    ),
    Case("3-D mesh", _three_d_mesh, FullyShardValueError, ("3-D mesh", 'mesh["dp"]')),
    Case(
        "reshard_after_forward a string",
        lambda m: fully_shard(m, mesh=mesh_1d(), reshard_after_forward="yes"),  # type: ignore[arg-type]
        FullyShardTypeError,
        ("reshard_after_forward", "'yes'"),
    ),
    Case(
        "reshard_after_forward not a divisor",
        lambda m: fully_shard(m, mesh=mesh_1d(), reshard_after_forward=3),
        FullyShardValueError,
        ("reshard_after_forward=3", "divide"),
    ),
    Case(
        "reshard_after_forward an int below 1",
        lambda m: fully_shard(m, mesh=mesh_1d(), reshard_after_forward=0),
        FullyShardValueError,
        ("reshard_after_forward=0", "divide"),
    ),
    Case(
        "shard_placement_fn not callable",
        lambda m: fully_shard(m, mesh=mesh_1d(), shard_placement_fn=42),  # type: ignore[arg-type]
        FullyShardTypeError,
        ("shard_placement_fn", "callable"),
    ),
    Case(
        "shard_placement_fn returns Replicate",
        lambda m: fully_shard(m, mesh=mesh_1d(), shard_placement_fn=_replicate_fn),
        FullyShardTypeError,
        ("Replicate", "inner.0.weight", "Shard(dim)"),
    ),
    Case(
        "shard_placement_fn dim out of range",
        lambda m: fully_shard(m, mesh=mesh_1d(), shard_placement_fn=_shard2_fn),
        FullyShardValueError,
        ("Shard(2)", "inner.0.weight", "(7, 5)"),
    ),
    Case(
        "mp_policy of the wrong type",
        lambda m: fully_shard(m, mesh=mesh_1d(), mp_policy="bf16"),  # type: ignore[arg-type]
        FullyShardTypeError,
        ("mp_policy", "MixedPrecisionPolicy", "str"),
    ),
    Case(
        "offload_policy of the wrong type",
        lambda m: fully_shard(m, mesh=mesh_1d(), offload_policy=True),  # type: ignore[arg-type]
        FullyShardTypeError,
        ("offload_policy", "OffloadPolicy", "bool"),
    ),
    Case(
        "MixedPrecisionPolicy with an integer dtype",
        lambda m: MixedPrecisionPolicy(param_dtype=torch.int32),
        FullyShardValueError,
        ("param_dtype=torch.int32", "floating-point"),
    ),
    Case(
        "MixedPrecisionPolicy with a string dtype",
        lambda m: MixedPrecisionPolicy(reduce_dtype="bf16"),  # type: ignore[arg-type]
        FullyShardTypeError,
        ("reduce_dtype", "torch.dtype"),
    ),
    Case(
        "CPUOffloadPolicy pin_memory not a bool",
        lambda m: CPUOffloadPolicy(pin_memory="yes"),  # type: ignore[arg-type]
        FullyShardTypeError,
        ("pin_memory", "bool"),
    ),
    Case(
        "ignored_params a tensor",
        lambda m: fully_shard(m, mesh=mesh_1d(), ignored_params=torch.zeros(2)),  # type: ignore[arg-type]
        FullyShardTypeError,
        ("ignored_params", "Tensor"),
    ),
    Case(
        "ignored_params holds a plain tensor",
        lambda m: fully_shard(m, mesh=mesh_1d(), ignored_params={torch.zeros(2)}),  # type: ignore[arg-type]
        FullyShardTypeError,
        ("ignored_params", "nn.Parameters"),
    ),
    Case(
        "parameters on different devices",
        _mixed_devices,
        FullyShardValueError,
        ("different devices", "out.bias@meta"),
    ),
    Case(
        "parameters of different dtypes",
        _mixed_dtypes,
        FullyShardValueError,
        ("different dtypes", "out.bias:torch.float64", "param_dtype"),
    ),
    Case("a 0-dim parameter", _scalar_param, FullyShardValueError, ("'scale'", "0-dimensional")),
    Case(
        "param_persistence_threshold negative",
        lambda m: fully_shard(m, mesh=mesh_1d(), param_persistence_threshold=-1),
        FullyShardValueError,
        ("param_persistence_threshold=-1", "negative", ">= 0"),
    ),
    Case(
        "param_persistence_threshold a bool",
        lambda m: fully_shard(m, mesh=mesh_1d(), param_persistence_threshold=True),
        FullyShardTypeError,
        ("param_persistence_threshold", "True", "bool"),
    ),
    Case(
        "param_persistence_threshold a float",
        lambda m: fully_shard(m, mesh=mesh_1d(), param_persistence_threshold=1e4),  # type: ignore[arg-type]
        FullyShardTypeError,
        ("param_persistence_threshold", "10000.0", "float"),
    ),
    Case(
        "a parameter that is already a DTensor",
        _dtensor_param,
        FullyShardValueError,
        ("'weight'", "already a DTensor", "same dims as the fully_shard mesh", 'root["dp"]'),
    ),
]

# Cases whose setup itself changes the model (it adds the offending parameter, or shards a
# submodule first) compare against the state right before the bad call instead.
SETUP_CASES = [
    Case(
        "tied to a parameter sharded by an earlier call",
        _tied_across_groups,
        FullyShardValueError,
        ("'extra.weight'", "tied", "one group"),
    ),
    Case(
        "fully_shard twice on one module",
        lambda m: fully_shard(m.out, mesh=mesh_1d()),
        FullyShardValueError,
        ("already applied", "Linear"),
    ),
]


def _run_case(index: int) -> str:
    case = CASES[index]
    torch.manual_seed(0)
    model = SmallNet()
    if case.name in ADDED_PARAM:
        # The case adds its offending parameter itself; _run_added_param_case checks that the
        # module stays unchanged from there on.
        with pytest.raises(case.error) as info:
            case.call(model)
        message = str(info.value)
    else:
        before = snapshot(model)
        with pytest.raises(case.error) as info:
            case.call(model)
        message = str(info.value)
        assert_same(before, snapshot(model))
        still_trains(model)
    assert isinstance(info.value, FullyShardError)
    for word in case.words:
        assert word in message, f"{case.name}: {word!r} not in {message!r}"
    return message


def _run_added_param_case(index: int) -> None:
    """Cases that add a bad parameter: the module with it stays as it was, and fixing the
    parameter (removing it) makes the same module shardable."""
    case = CASES[index]
    torch.manual_seed(0)
    model = SmallNet()
    call = case.call
    # Re-run the case's own setup step by step: add the parameter, snapshot, then call.
    if call is _mixed_devices:
        model.out.bias = nn.Parameter(torch.empty(3, device="meta"))
    elif call is _mixed_dtypes:
        model.out.bias = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    elif call is _scalar_param:
        model.scale = nn.Parameter(torch.tensor(1.0))
    elif call is _dtensor_param:
        mesh = mesh_1d()
        model.out.weight = nn.Parameter(
            distribute_tensor(model.out.weight.detach(), mesh, [Shard(0)])
        )
    before = snapshot(model)
    target = model.out if call is _dtensor_param else model
    with pytest.raises(case.error):
        fully_shard(target, mesh=mesh_1d())
    assert_same(before, snapshot(model))
    # Repair the offending parameter and shard the very same module.
    if call is _scalar_param:
        del model.scale
    elif call is _dtensor_param:
        model.out.weight = nn.Parameter(torch.randn(3, 7))
    else:
        model.out.bias = nn.Parameter(torch.zeros(3))
    still_trains(model)


def _run_setup_case(index: int) -> None:
    case = SETUP_CASES[index]
    torch.manual_seed(0)
    model = SmallNet()
    if case.call is _tied_across_groups:
        model.out.weight = nn.Parameter(torch.randn(3, 7))
        model.extra = nn.Linear(7, 3)
        model.extra.weight = model.out.weight
        fully_shard(model.out, mesh=mesh_1d())
        before = snapshot(model)
        with pytest.raises(case.error) as info:
            fully_shard(model, mesh=mesh_1d())
        assert_same(before, snapshot(model))
        # The fix the message suggests: shard the tied pair in one group (the root).
        fresh = SmallNet()
        fresh.extra = nn.Linear(7, 3)
        fresh.extra.weight = fresh.out.weight
        fully_shard(fresh, mesh=mesh_1d())
        fresh(torch.randn(2, 5)).sum().backward()
    else:
        fully_shard(model.out, mesh=mesh_1d())
        before = snapshot(model)
        with pytest.raises(case.error) as info:
            case.call(model)
        assert_same(before, snapshot(model))
        fully_shard(model, mesh=mesh_1d())
        model(torch.randn(2, 5)).sum().backward()
    for word in case.words:
        assert word in str(info.value), f"{case.name}: {word!r} not in {info.value}"


ADDED_PARAM = {
    "parameters on different devices",
    "parameters of different dtypes",
    "a 0-dim parameter",
    "a parameter that is already a DTensor",
}


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_bad_input(index: int) -> None:
    run_distributed(_run_case, 2, index)
    if CASES[index].name in ADDED_PARAM:
        run_distributed(_run_added_param_case, 2, index)


@pytest.mark.parametrize("index", range(len(SETUP_CASES)), ids=[c.name for c in SETUP_CASES])
def test_bad_input_after_setup(index: int) -> None:
    run_distributed(_run_setup_case, 2, index)


def test_catalogue_size() -> None:
    assert len(CASES) + len(SETUP_CASES) >= 15


def _bad_runtime_calls() -> None:
    model = SmallNet()
    fully_shard(model, mesh=mesh_1d())
    with pytest.raises(FullyShardTypeError, match="reshard_after_forward must be a bool"):
        model.set_reshard_after_forward("no")  # type: ignore[arg-type]
    with pytest.raises(FullyShardTypeError, match="requires_gradient_sync must be a bool"):
        model.set_requires_gradient_sync(1)  # type: ignore[arg-type]
    with pytest.raises(FullyShardTypeError, match="has no all_gather"):
        model.set_comm(object())  # type: ignore[arg-type]
    with pytest.raises(FullyShardTypeError, match="call fully_shard"):
        register_fsdp_forward_method(nn.Linear(2, 2), "forward")
    with pytest.raises(FullyShardValueError, match="no method 'generate'"):
        register_fsdp_forward_method(model, "generate")
    # none of the rejected calls changed anything: a step still works
    model(torch.randn(3, 5)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    # A meta-built block under a root: the first forward names the parameter from the root
    # (its state_dict() key), not from the block that fully_shard was called on.
    root = nn.Sequential(nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 3, device="meta")))
    fully_shard(root[1], mesh=mesh_1d())
    fully_shard(root, mesh=mesh_1d())
    with pytest.raises(FullyShardStateError, match=r"parameter '1\.0\.weight' is still on"):
        root(torch.randn(2, 5))


def test_bad_runtime_calls() -> None:
    run_distributed(_bad_runtime_calls, 2)


def test_mesh_none_without_distributed() -> None:
    # The pytest process itself never initialises torch.distributed.
    assert not dist.is_initialized()
    model = SmallNet()
    before = snapshot(model)
    with pytest.raises(FullyShardStateError, match="torchrun") as info:
        fully_shard(model)
    assert "init_process_group" in str(info.value)
    assert_same(before, snapshot(model))


# -- inputs checked with their exact message ----------------------------------------------------


def _cuda_mesh_on_a_cpu_process(m: SmallNet) -> object:
    # A mesh object for a device type this process cannot use (no backend is created).
    mesh = DeviceMesh("cuda", torch.arange(dist.get_world_size()), _init_backend=False)
    return fully_shard(m, mesh=mesh)


def _meta_bias(m: SmallNet) -> None:
    m.inner[0].bias = nn.Parameter(torch.empty(7, device="meta"))


def _half_bias(m: SmallNet) -> None:
    m.inner[0].bias = nn.Parameter(torch.zeros(7, dtype=torch.float16))


@dataclass(frozen=True)
class ExactCase:
    """A bad call and its whole message. ``setup`` puts the offending parameter in place
    first; the module must then stay as it was, and shard once the parameter is fixed."""

    name: str
    call: Callable[[SmallNet], object]
    error: type[Exception]
    message: str
    setup: Callable[[SmallNet], None] | None = None


def _shard_root(m: SmallNet) -> object:
    return fully_shard(m, mesh=mesh_1d())


EXACT_CASES = [
    ExactCase(
        "None instead of a module",
        lambda m: fully_shard(None),  # type: ignore[call-overload]
        FullyShardTypeError,
        "fully_shard expects an nn.Module or a list of nn.Modules, got NoneType",
    ),
    ExactCase(
        "a tensor instead of a module",
        lambda m: fully_shard(torch.zeros(3)),  # type: ignore[call-overload]
        FullyShardTypeError,
        "fully_shard expects an nn.Module or a list of nn.Modules, got Tensor",
    ),
    ExactCase(
        "a dict of modules",
        lambda m: fully_shard({"inner": m.inner}),  # type: ignore[call-overload]
        FullyShardTypeError,
        "fully_shard expects an nn.Module or a list of nn.Modules, got dict",
    ),
    ExactCase(
        "the module class instead of an instance",
        lambda m: fully_shard(nn.Linear),  # type: ignore[call-overload]
        FullyShardTypeError,
        "fully_shard got the class Linear, not a module; construct it first, e.g. "
        "fully_shard(Linear(...))",
    ),
    ExactCase(
        "parameters on mixed devices in one group",
        _shard_root,
        FullyShardValueError,
        "the parameters of one fully_shard group are on different devices (inner.0.weight@cpu, "
        "inner.0.bias@meta, out.weight@cpu, out.bias@cpu); move the module to one device (or "
        "the meta device) first",
        setup=_meta_bias,
    ),
    ExactCase(
        "parameters of mixed dtypes in one group",
        _shard_root,
        FullyShardValueError,
        "the trainable parameters of one fully_shard group would reduce their gradients in "
        "different dtypes (inner.0.weight:torch.float32, inner.0.bias:torch.float16, "
        "out.weight:torch.float32, out.bias:torch.float32) and one reduce-scatter needs one "
        "gradient dtype; set MixedPrecisionPolicy(reduce_dtype=...) (e.g. torch.float32, as "
        "torch 2.15 asks when param_dtype_override_fn keeps some parameters in their own "
        "dtype), freeze the odd ones (frozen parameters of any dtype can share a group), "
        "convert the module to one dtype, or shard them in separate calls",
        setup=_half_bias,
    ),
    ExactCase(
        "a mesh of a device type this process cannot use",
        _cuda_mesh_on_a_cpu_process,
        FullyShardValueError,
        "the mesh is on device type 'cuda', which this process cannot use "
        "(torch.cuda.is_available() is not True); build the mesh with init_device_mesh('cpu', "
        "...) to run on CPU with gloo, or start the ranks on a machine with cuda devices",
    ),
]


def _run_exact_case(index: int) -> None:
    case = EXACT_CASES[index]
    torch.manual_seed(0)
    model = SmallNet()
    if case.setup is not None:
        case.setup(model)
    before = snapshot(model)
    with pytest.raises(case.error) as info:
        case.call(model)
    assert isinstance(info.value, FullyShardError)
    assert str(info.value) == case.message, f"{case.name}: {info.value}"
    assert_same(before, snapshot(model))
    if case.setup is not None:
        model.inner[0].bias = nn.Parameter(torch.zeros(7))
    still_trains(model)


@pytest.mark.parametrize("index", range(len(EXACT_CASES)), ids=[c.name for c in EXACT_CASES])
def test_bad_input_exact_message(index: int) -> None:
    run_distributed(_run_exact_case, 2, index)


def test_mesh_none_without_distributed_exact_message() -> None:
    assert not dist.is_initialized()
    model = SmallNet()
    before = snapshot(model)
    with pytest.raises(FullyShardStateError) as info:
        fully_shard(model)
    assert str(info.value) == (
        "fully_shard(mesh=None) needs torch.distributed to be initialised: launch the ranks "
        "with `torchrun --nproc-per-node N script.py` and call "
        "`torch.distributed.init_process_group()` (backend 'gloo' on CPU, 'nccl' on GPU) "
        "before fully_shard, or pass mesh=init_device_mesh(...)"
    )
    assert_same(before, snapshot(model))
