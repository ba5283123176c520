"""Bad inputs given to torch's ``fully_shard`` and to ours: do we raise what torch raises?

Each case of the catalogue runs on both (2 gloo ranks). Where torch raises a ``TypeError``,
``ValueError``, ``NotImplementedError``, ``RuntimeError`` or ``AssertionError`` on purpose,
ours must be an instance of the same class (ours is also a ``FullyShardError`` with a message
saying what to do). Every other outcome is listed below, and the test checks each is still
what it says, so a change on either side shows up here.

Torch raises ``AssertionError`` (``fully_shard`` twice on one module, ``shard_placement_fn``
returning ``Shard(5)`` on a 2-D weight or ``Shard(1)`` on a 1-D bias): ours is a
``FullyShardAssertionError``, both the ``ValueError`` it is and the ``AssertionError`` torch
raises. Meshes: a 3-D mesh (``ValueError`` in both), parameters still on the meta device at the
first forward (``RuntimeError`` in both), ``FSDPMeshInfo`` without ``shard_mesh_dim`` and
``HSDPMeshInfo`` without ``replicate_mesh_dim`` (``AssertionError`` in both), and with
``dp_mesh_dims`` a dim name the mesh lacks, a mesh without dim names, or plain parameters
(``ValueError`` in both).

Torch accepts silently (ours raises before changing anything, or before the first gather):
  ``mp_policy`` a dict or a dtype, ``offload_policy`` a string, parameters of mixed dtypes,
  parameters on meta and CPU mixed; an all-gather extension with only a pre hook, one whose
  pre hook takes neither of torch's argument lists, and one sharded on dim 1;
  ``dp_mesh_dims`` naming only a replicate dim, ``DataParallelMeshDims(shard=3)``, an
  ``HSDPMeshInfo`` for a ``(shard, replicate)`` mesh (dims in the order ours does not read).

Both accept: ``ignored_params`` holding a parameter of another module (skipped).

Torch fails by accident (an ``AttributeError``, ``IndexError``, ``AssertionError``,
``ValueError`` or ``RuntimeError`` from deep inside; ours raises its ``FullyShard*Error`` of
the class that fits, and does not copy the accident: a caller does not catch ``AttributeError``
from ``fully_shard``): ``mesh`` a string or a process group, a tensor as the module, an empty
list, a list holding a non-module, ``ignored_params`` a tensor, ``FSDPMeshInfo`` of a string or
of a dim the mesh lacks, ``dp_mesh_dims`` a dict, a mesh info on an unnamed 3-D mesh, an
all-gather extension inside a tensor-parallel DTensor ("not enough values to unpack").

Not listed: an extension whose inputs cannot be padded on an uneven split (ours raises on every
rank, tests/test_extensions.py; torch's ``fully_shard`` hangs one rank in the all-gather), and
the cases that need an ``int`` ``reshard_after_forward`` below the shard world size (4 ranks,
this file runs on 2; ours is checked in tests/test_extensions.py and
tests/test_reshard_int.py).

Torch raises a ``ValueError`` for a wrong type: ``reshard_after_forward="yes"`` and
``shard_placement_fn`` returning an int. Ours is a ``FullyShardArgumentTypeError``, both a
``TypeError`` (what it is) and a ``ValueError`` (what torch raises).

Not in torch (``quantization_policy``): ours only, a ``ValueError`` for a bad policy value
(``all_gather="int4"``, ``block_size=0``) and a ``TypeError`` for a value of the wrong type
(``all_gather=8``, ``block_size="256"``) or a policy that is not a ``QuantizationPolicy``.

Torch refuses, ours accepts: a non-contiguous parameter (``NotImplementedError`` in torch);
ours trains it at parity (tests/test_containers.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference, tests only
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fully_shard as ours
from extension_stubs import QMLP, BadSignature, Int8BlockWeight, PreOnly
from fully_shard import (
    FullyShardError,
    FullyShardNotImplementedError,
    FullyShardStateError,
    FullyShardTypeError,
    FullyShardValueError,
    QuantizationPolicy,
    fully_shard,
)
from harness import device_mesh, mesh_1d, run_distributed
from parity import needs_torch_fsdp2_on_cpu

pytestmark = needs_torch_fsdp2_on_cpu

ShardFn = Callable[..., Any]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))


def _with(p: nn.Parameter) -> nn.Module:
    model = _net()
    model.extra = p
    return model


def _twice(fs: ShardFn) -> Any:
    return fs(fs(_net(), mesh=mesh_1d()), mesh=mesh_1d())


class _Extension(BadSignature):
    def fsdp_pre_all_gather(  # type: ignore[override]  # torch's full argument list
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any
    ) -> Any:
        return (self,), None


def _tensor_parallel_extension(fs: ShardFn) -> Any:
    """An ``Int8BlockWeight`` as the local tensor of a TP ``Shard(0)`` DTensor, then forward."""
    torch.manual_seed(0)
    layer = QMLP(even=True).layers[0]  # weight (8, 6): 4 rows per TP rank
    root = device_mesh((1, dist.get_world_size()), ("dp", "tp"))
    tp = root["tp"]
    local = layer.weight.detach().chunk(tp.size())[tp.get_local_rank()].clone()
    layer.weight = nn.Parameter(DTensor.from_local(Int8BlockWeight(local, []), tp, [Shard(0)]))
    layer.quantized_gather = True
    return fs(layer, mesh=root["dp"])(torch.randn(2, layer.in_features))


def _extension(kind: type[torch.Tensor]) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6))  # (6, 4): dim 1 splits evenly over 2 ranks
    model[0].weight = nn.Parameter(model[0].weight.detach().as_subclass(kind))
    return model


def _forward(model: Any) -> Any:
    return model(torch.randn(2, model[0].in_features))


def _api(fs: ShardFn) -> dict[str, Any]:
    """The mesh-info classes and ``DataParallelMeshDims`` that go with ``fs``: torch's or ours."""
    if fs is torch_fully_shard:
        from torch.distributed.fsdp import DataParallelMeshDims as TorchDims
        from torch.distributed.fsdp._fully_shard import _fsdp_common

        return {
            "FSDPMeshInfo": _fsdp_common.FSDPMeshInfo,
            "HSDPMeshInfo": _fsdp_common.HSDPMeshInfo,
            "ShardPlacementResult": _fsdp_common.ShardPlacementResult,
            "DataParallelMeshDims": TorchDims,
        }
    names = ("FSDPMeshInfo", "HSDPMeshInfo", "ShardPlacementResult", "DataParallelMeshDims")
    return {name: getattr(ours, name) for name in names}


def _dp_mesh() -> DeviceMesh:
    return device_mesh((dist.get_world_size(),), ("dp",))


def _spmd_net(mesh: DeviceMesh) -> nn.Module:
    """``_net()`` with every parameter a ``Replicate()`` DTensor on ``mesh`` (full-SPMD mode)."""
    model = _net()
    for module in model:
        for name, p in list(module.named_parameters(recurse=False)):
            dt = distribute_tensor(p.detach(), mesh, [Replicate()] * mesh.ndim)
            setattr(module, name, nn.Parameter(dt))
    return model


def _with_dp_mesh_dims(fs: ShardFn, mesh: DeviceMesh | None = None, **dims: Any) -> Any:
    mesh = _dp_mesh() if mesh is None else mesh
    return fs(_spmd_net(mesh), mesh=mesh, dp_mesh_dims=_api(fs)["DataParallelMeshDims"](**dims))


def _with_mesh_info(fs: ShardFn, kind: str, mesh: DeviceMesh, **dims: int) -> Any:
    """Every parameter's ``shard_placement_fn`` answer: ``Shard(0)`` over one mesh info."""
    api = _api(fs)
    result = api["ShardPlacementResult"](Shard(0), api[kind](mesh, **dims))
    return _forward(fs(_net(), mesh=mesh_1d(), shard_placement_fn=lambda p: result))


# The call is not one torch's fully_shard can take (an argument it does not have): ours only.
NOT_IN_TORCH = type("NotInTorch", (), {"__repr__": lambda self: "NOT_IN_TORCH"})()


# name -> (call, the class torch raises or None, the class ours raises or None)
CASES: dict[str, tuple[Callable[[ShardFn], Any], type | None, type | None]] = {
    # torch raises on purpose: ours must be an instance of the same class
    "reshard_after_forward=3 on 2 ranks": (
        lambda fs: fs(_net(), mesh=mesh_1d(), reshard_after_forward=3),
        ValueError,
        FullyShardValueError,
    ),
    "reshard_after_forward=0": (
        lambda fs: fs(_net(), mesh=mesh_1d(), reshard_after_forward=0),
        ValueError,
        FullyShardValueError,
    ),
    "a scalar parameter": (
        lambda fs: fs(_with(nn.Parameter(torch.tensor(1.0))), mesh=mesh_1d()),
        ValueError,
        FullyShardValueError,
    ),
    "a module class": (lambda fs: fs(nn.Linear, mesh=mesh_1d()), TypeError, FullyShardTypeError),
    "a ModuleList": (
        lambda fs: fs(nn.ModuleList([nn.Linear(2, 2)]), mesh=mesh_1d()),
        ValueError,
        FullyShardValueError,
    ),
    "a ModuleDict": (
        lambda fs: fs(nn.ModuleDict({"a": nn.Linear(2, 2)}), mesh=mesh_1d()),
        ValueError,
        FullyShardValueError,
    ),
    "shard_placement_fn not callable": (
        lambda fs: fs(_net(), mesh=mesh_1d(), shard_placement_fn=3),
        TypeError,
        FullyShardTypeError,
    ),
    # torch accepts silently
    "mp_policy a dict": (
        lambda fs: fs(_net(), mesh=mesh_1d(), mp_policy={"param_dtype": torch.bfloat16}),
        None,
        FullyShardTypeError,
    ),
    "mp_policy a dtype": (
        lambda fs: fs(_net(), mesh=mesh_1d(), mp_policy=torch.bfloat16),
        None,
        FullyShardTypeError,
    ),
    "offload_policy a string": (
        lambda fs: fs(_net(), mesh=mesh_1d(), offload_policy="cpu"),
        None,
        FullyShardTypeError,
    ),
    "mixed dtypes": (
        lambda fs: fs(_with(nn.Parameter(torch.zeros(3, dtype=torch.float64))), mesh=mesh_1d()),
        None,
        FullyShardValueError,
    ),
    "mixed devices (meta and cpu)": (
        lambda fs: fs(_with(nn.Parameter(torch.zeros(3, device="meta"))), mesh=mesh_1d()),
        None,
        FullyShardValueError,
    ),
    # torch fails by accident
    "mesh a string": (lambda fs: fs(_net(), mesh="dp"), AttributeError, FullyShardTypeError),
    "mesh a process group": (
        lambda fs: fs(_net(), mesh=dist.group.WORLD),
        AttributeError,
        FullyShardTypeError,
    ),
    "a tensor as the module": (
        lambda fs: fs(torch.zeros(3), mesh=mesh_1d()),
        AttributeError,
        FullyShardTypeError,
    ),
    "an empty list": (lambda fs: fs([], mesh=mesh_1d()), IndexError, FullyShardValueError),
    "a list holding a non-module": (
        lambda fs: fs([nn.Linear(2, 2), 3], mesh=mesh_1d()),
        AttributeError,
        FullyShardTypeError,
    ),
    "shard_placement_fn returns Shard(5)": (
        lambda fs: fs(_net(), mesh=mesh_1d(), shard_placement_fn=lambda p: Shard(5)),
        AssertionError,
        FullyShardValueError,
    ),
    "ignored_params a tensor": (
        lambda fs: fs(_net(), mesh=mesh_1d(), ignored_params=torch.zeros(2)),
        RuntimeError,
        FullyShardTypeError,
    ),
    "fully_shard twice": (_twice, AssertionError, FullyShardValueError),
    "shard_placement_fn returns Shard(1) for a 1-D parameter": (
        lambda fs: fs(
            _net(), mesh=mesh_1d(), shard_placement_fn=lambda p: Shard(1) if p.dim() == 1 else None
        ),
        AssertionError,
        FullyShardValueError,
    ),
    # meshes: torch raises on purpose, the same class
    "a 3-D mesh": (
        lambda fs: fs(_net(), mesh=init_device_mesh("cpu", (1, 1, dist.get_world_size()))),
        ValueError,
        FullyShardValueError,
    ),
    "meta parameters at the first forward": (
        lambda fs: _forward(fs(nn.Sequential(nn.Linear(5, 3, device="meta")), mesh=mesh_1d())),
        RuntimeError,
        FullyShardStateError,
    ),
    "FSDPMeshInfo without shard_mesh_dim": (
        lambda fs: _api(fs)["FSDPMeshInfo"](mesh_1d()),
        AssertionError,
        FullyShardValueError,  # a FullyShardAssertionError
    ),
    "HSDPMeshInfo without replicate_mesh_dim": (
        lambda fs: _api(fs)["HSDPMeshInfo"](device_mesh((1, 2), ("r", "s")), shard_mesh_dim=1),
        AssertionError,
        FullyShardValueError,  # a FullyShardAssertionError
    ),
    "dp_mesh_dims naming a dim the mesh lacks": (
        lambda fs: _with_dp_mesh_dims(fs, shard="data"),
        ValueError,
        FullyShardValueError,
    ),
    "dp_mesh_dims on a mesh without dim names": (
        lambda fs: _with_dp_mesh_dims(fs, mesh_1d(), shard="dp"),
        ValueError,
        FullyShardValueError,
    ),
    "dp_mesh_dims with plain parameters": (
        lambda fs: fs(
            _net(), mesh=_dp_mesh(), dp_mesh_dims=_api(fs)["DataParallelMeshDims"](shard="dp")
        ),
        ValueError,
        FullyShardValueError,
    ),
    # meshes: torch fails by accident
    "FSDPMeshInfo of a string": (
        lambda fs: _api(fs)["FSDPMeshInfo"]("dp", shard_mesh_dim=0),
        AttributeError,
        FullyShardTypeError,
    ),
    "FSDPMeshInfo shard_mesh_dim=1 of a 1-D mesh": (
        lambda fs: _api(fs)["FSDPMeshInfo"](mesh_1d(), shard_mesh_dim=1),
        IndexError,
        FullyShardValueError,
    ),
    "dp_mesh_dims a dict": (
        lambda fs: fs(_spmd_net(_dp_mesh()), mesh=_dp_mesh(), dp_mesh_dims={"shard": "dp"}),
        AttributeError,
        FullyShardTypeError,
    ),
    "a mesh info on an unnamed 3-D mesh": (
        lambda fs: _with_mesh_info(fs, "FSDPMeshInfo", device_mesh((1, 1, 2)), shard_mesh_dim=2),
        AssertionError,  # torch: "Expected mesh_dim_names to not be None"
        FullyShardValueError,
    ),
    # meshes: torch accepts silently
    "dp_mesh_dims naming only a replicate dim": (
        lambda fs: _with_dp_mesh_dims(fs, replicate="dp"),
        None,
        FullyShardNotImplementedError,
    ),
    "DataParallelMeshDims(shard=3)": (
        lambda fs: _api(fs)["DataParallelMeshDims"](shard=3),
        None,
        FullyShardTypeError,
    ),
    "an HSDPMeshInfo for a (shard, replicate) mesh": (
        lambda fs: _with_mesh_info(
            fs,
            "HSDPMeshInfo",
            device_mesh((2, 1), ("s", "r")),
            shard_mesh_dim=0,
            replicate_mesh_dim=1,
        ),
        None,
        FullyShardValueError,
    ),
    # all-gather extensions: torch accepts (gathers the tensor plainly or fails later), ours
    # refuses before the first all-gather
    "an extension with a pre hook only": (
        lambda fs: fs(_extension(PreOnly), mesh=mesh_1d()),
        None,
        FullyShardTypeError,
    ),
    "an extension pre hook with a bad signature": (
        lambda fs: _forward(fs(_extension(BadSignature), mesh=mesh_1d())),
        None,
        FullyShardTypeError,
    ),
    "an extension inside a tensor-parallel DTensor": (
        _tensor_parallel_extension,
        ValueError,  # torch, by accident: "not enough values to unpack (expected 2, got 1)"
        FullyShardNotImplementedError,
    ),
    "an extension parameter sharded on dim 1": (
        lambda fs: _forward(
            fs(_extension(_Extension), mesh=mesh_1d(), shard_placement_fn=lambda p: Shard(-1))
        ),
        None,
        FullyShardNotImplementedError,
    ),
    # quantization: an argument torch does not have
    "QuantizationPolicy(all_gather='int4')": (
        lambda fs: fs(
            _net(), mesh=mesh_1d(), quantization_policy=QuantizationPolicy(all_gather="int4")
        ),
        NOT_IN_TORCH,
        FullyShardValueError,
    ),
    "QuantizationPolicy(block_size=0)": (
        lambda fs: fs(_net(), mesh=mesh_1d(), quantization_policy=QuantizationPolicy(block_size=0)),
        NOT_IN_TORCH,
        FullyShardValueError,
    ),
    "QuantizationPolicy(all_gather=8)": (
        lambda fs: fs(_net(), mesh=mesh_1d(), quantization_policy=QuantizationPolicy(all_gather=8)),
        NOT_IN_TORCH,
        FullyShardTypeError,
    ),
    "QuantizationPolicy(block_size='256')": (
        lambda fs: fs(
            _net(), mesh=mesh_1d(), quantization_policy=QuantizationPolicy(block_size="256")
        ),
        NOT_IN_TORCH,
        FullyShardTypeError,
    ),
    "quantization_policy a string": (
        lambda fs: fs(_net(), mesh=mesh_1d(), quantization_policy="int8"),
        NOT_IN_TORCH,
        FullyShardTypeError,
    ),
    # torch raises a ValueError for a wrong type; ours is both a TypeError and a ValueError
    "reshard_after_forward a string": (
        lambda fs: fs(_net(), mesh=mesh_1d(), reshard_after_forward="yes"),
        ValueError,
        FullyShardTypeError,
    ),
    "shard_placement_fn returns an int": (
        lambda fs: fs(_net(), mesh=mesh_1d(), shard_placement_fn=lambda p: 0),
        ValueError,
        FullyShardTypeError,
    ),
    # both accept: skipped, so one set can serve every call of a wrap (tests/test_ignored_ddp.py)
    "ignored_params of another module": (
        lambda fs: fs(_net(), mesh=mesh_1d(), ignored_params={nn.Parameter(torch.zeros(2))}),
        None,
        None,
    ),
    # torch refuses, ours accepts (and trains it at parity: tests/test_containers.py)
    "a non-contiguous parameter": (
        lambda fs: fs(_with(nn.Parameter(torch.zeros(3, 4).t())), mesh=mesh_1d()),
        NotImplementedError,
        None,
    ),
}

# Torch raises these on purpose, and ours must be an instance of the class it raises.
SAME_CLASS = set(list(CASES)[:7]) | {
    "reshard_after_forward a string",
    "shard_placement_fn returns an int",
    "shard_placement_fn returns Shard(5)",
    "shard_placement_fn returns Shard(1) for a 1-D parameter",
    "fully_shard twice",
    "a 3-D mesh",
    "meta parameters at the first forward",
    "FSDPMeshInfo without shard_mesh_dim",
    "HSDPMeshInfo without replicate_mesh_dim",
    "dp_mesh_dims naming a dim the mesh lacks",
    "dp_mesh_dims on a mesh without dim names",
    "dp_mesh_dims with plain parameters",
}


def _raised(call: Callable[[ShardFn], Any], fs: ShardFn) -> BaseException | None:
    try:
        call(fs)
    except Exception as e:
        return e
    return None


def _run(name: str) -> None:
    call, torch_class, our_class = CASES[name]
    ours = _raised(call, fully_shard)
    theirs = None if torch_class is NOT_IN_TORCH else _raised(call, torch_fully_shard)
    if torch_class is NOT_IN_TORCH:
        pass
    elif torch_class is None:
        assert theirs is None, f"{name}: torch now raises {theirs!r}"
    else:
        assert isinstance(theirs, torch_class), f"{name}: torch raised {theirs!r}"
    if our_class is None:
        assert ours is None, f"{name}: ours raised {ours!r}"
        return
    assert isinstance(ours, our_class) and isinstance(ours, FullyShardError), repr(ours)
    if name in SAME_CLASS:
        assert isinstance(ours, type(theirs)), f"{name}: torch {theirs!r}, ours {ours!r}"


@pytest.mark.parametrize("name", list(CASES))
def test_error_class_like_torchs(name: str) -> None:
    run_distributed(_run, 2, name)
