"""``fully_shard(..., mesh=world, dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...))``.

torch 2.13's full-SPMD-mesh mode: every parameter is already a DTensor on ``world`` (here
``Replicate()`` on the data-parallel dims and a tensor-parallel layout on ``"tp"`` where there
is one), ``shard`` names the dim(s) to shard over (a tuple is flattened into one dim),
``replicate`` the HSDP dim(s). Every scenario runs at W = 4 and is checked

- against an unsharded replica (``check_parity``: loss, every gradient, every parameter over
  2 AdamW steps, 1e-5), and
- against torch's own ``fully_shard`` with the same arguments (it runs on CPU gloo): the same
  losses and parameters step by step (2 steps), and, with ``shard_placement_fn`` asking for
  torch's ``Shard(0)``, the same placements, mesh dims and local tensor of every parameter.

Two steps check a step taken from the optimizer state and the sharded parameters that the first
one left; ``nox -s soak`` trains 5 steps against the replica and 4 against torch.

Bad inputs (names not in the mesh, overlap, plain or foreign parameters, a sharded dp dim, ...)
raise before anything is changed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from fully_shard import (
    DataParallelMeshDims,
    FullyShardNotImplementedError,
    FullyShardTypeError,
    FullyShardValueError,
    fully_shard,
)
from fully_shard._compat import can_concatenate_meshes
from harness import device_mesh, run_distributed
from matrix import FULL_MATRIX, thinned
from parity import (
    assert_same,
    assert_stats_within,
    assert_trains_like_torch,
    check_parity,
    make_float_batch,
    needs_torch_fsdp2_on_cpu,
    snapshot,
)

DIMS = [7, 12, 5]  # in, hidden (split by tp and dp), out
# AdamW steps against the unsharded replica and against torch: a step after a step
PARITY_STEPS, TORCH_STEPS = (5, 4) if FULL_MATRIX else (2, 2)
make_batch = functools.partial(make_float_batch, in_dim=DIMS[0], out_dim=DIMS[-1])


class SPMDMLP(nn.Module):
    """Column- then row-parallel MLP whose parameters may be DTensors on one full mesh.

    Plain parameters (the unsharded reference) compute on plain tensors. DTensor parameters:
    the input becomes a DTensor replicated on every mesh dim (this rank's own rows; the dp
    dims only ever see replicated values, so no dp collective runs in forward or backward),
    and the output is replicated over the TP dim and handed back as a plain tensor.
    """

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIMS[0], DIMS[1])
        self.down = nn.Linear(DIMS[1], DIMS[2], bias=False)

    def forward(self, x: Tensor) -> Tensor:
        w = self.up.weight
        if isinstance(w, DTensor):
            mesh = w.device_mesh
            x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
        y = self.down(F.gelu(self.up(x)))
        if isinstance(y, DTensor):
            y = y.redistribute(placements=[Replicate()] * y.device_mesh.ndim).to_local()
        return y  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Scenario:
    """A full mesh, the dp dims named in it, and whether it has a TP dim ``"tp"``."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    shard: str | tuple[str, ...]
    replicate: str | tuple[str, ...] | None = None

    @property
    def dims(self) -> DataParallelMeshDims:
        return DataParallelMeshDims(shard=self.shard, replicate=self.replicate)

    def mesh(self) -> DeviceMesh:
        return device_mesh(self.shape, self.names)

    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel ranks, in data order (for ``check_parity``'s batch split)."""
        dp = [n for n in self.names if n != "tp"]
        mesh = self.mesh()
        return mesh[dp[0]] if len(dp) == 1 else mesh[tuple(dp)]


SCENARIOS = {
    "fsdp-1d": Scenario((4,), ("dp",), shard="dp"),
    "fsdp+tp": Scenario((2, 2), ("dp", "tp"), shard="dp"),
    "hsdp+tp": Scenario((2, 2, 1), ("rep", "shard", "tp"), shard="shard", replicate="rep"),
    "flattened": Scenario((2, 2), ("dp_shard", "cp"), shard=("dp_shard", "cp")),
    "flattened+tp": Scenario((2, 1, 2), ("dp_shard", "cp", "tp"), shard=("dp_shard", "cp")),
    "replicate-after-shard": Scenario((2, 2), ("shard", "rep"), shard="shard", replicate="rep"),
}


def _placements(mesh: DeviceMesh, name: str, p: nn.Parameter) -> list[Placement]:
    """Replicate on every dim but ``"tp"``: column-parallel ``up``, row-parallel ``down``."""
    names = mesh.mesh_dim_names or ()
    out: list[Placement] = [Replicate()] * mesh.ndim
    if "tp" in names:
        out[names.index("tp")] = Shard(0) if name.startswith("up") else Shard(p.dim() - 1)
    return out


def _distribute(model: nn.Module, mesh: DeviceMesh) -> None:
    for module_name, module in model.named_children():
        for name, p in list(module.named_parameters(recurse=False)):
            placements = _placements(mesh, f"{module_name}.{name}", p)
            dt = distribute_tensor(p.detach(), mesh, placements)
            setattr(module, name, nn.Parameter(dt, requires_grad=p.requires_grad))


def _shard(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    scenario: str,
    torch_impl: bool = False,
    **options: Any,
) -> None:
    sc = SCENARIOS[scenario]
    mesh = sc.mesh()
    _distribute(model, mesh)
    if torch_impl:
        from torch.distributed.fsdp import DataParallelMeshDims as TorchDims
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        dims = TorchDims(shard=sc.shard, replicate=sc.replicate)
        torch_fully_shard(model, mesh=mesh, dp_mesh_dims=dims, **options)
    else:
        fully_shard(model, mesh=mesh, dp_mesh_dims=sc.dims, **options)


# -- parity against an unsharded replica -----------------------------------------------------


def _parity(scenario: str) -> dict[str, Any]:
    sc = SCENARIOS[scenario]
    stats = check_parity(
        SPMDMLP,
        functools.partial(_shard, scenario=scenario),
        make_batch,
        sc.dp_mesh(),
        steps=PARITY_STEPS,
    )
    return dict(stats)


# Dims flattened into one, or replicate after shard: a mesh no slice of the root names. torch
# builds it with DeviceMesh._concatenate (2.13 has it, 2.6 does not); without it we refuse.
NEEDS_NEW_MESH = {"flattened", "flattened+tp", "replicate-after-shard"}


def _refused(scenario: str) -> str:
    with pytest.raises(FullyShardNotImplementedError, match="without new process groups") as e:
        _shard(SPMDMLP(), SCENARIOS[scenario].dp_mesh(), scenario=scenario)
    return str(e.value)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_dp_mesh_dims_parity_with_unsharded(scenario: str) -> None:
    if scenario in NEEDS_NEW_MESH and not can_concatenate_meshes():
        for message in run_distributed(_refused, 4, scenario, timeout=120):
            assert f"this torch ({torch.__version__})" in message
        return
    for stats in run_distributed(_parity, 4, scenario, timeout=120):
        assert_stats_within(stats, 1e-5)


# -- against torch's fully_shard with the same arguments ------------------------------------


def _dp_coordinates(sc: Scenario) -> tuple[int, int]:
    flat = sc.dp_mesh().mesh.flatten().tolist()
    return len(flat), flat.index(dist.get_rank())


def _train_both(scenario: str, torch_placement: bool) -> list[str]:
    sc = SCENARIOS[scenario]
    options = {"shard_placement_fn": lambda p: Shard(0)} if torch_placement else {}
    torch.manual_seed(0)
    ours = SPMDMLP()
    theirs = SPMDMLP()
    theirs.load_state_dict(ours.state_dict())
    _shard(ours, sc.dp_mesh(), scenario=scenario, **options)
    _shard(theirs, sc.dp_mesh(), scenario=scenario, torch_impl=True)
    seen = []
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs_params[name]
        assert isinstance(p, DTensor) and isinstance(q, DTensor), name
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0, atol=0, msg=name)
        seen.append(f"{name}: {p.device_mesh.mesh_dim_names} {p.placements}")
        if torch_placement:
            assert p.device_mesh.mesh_dim_names == q.device_mesh.mesh_dim_names, name
            assert p.placements == q.placements, (name, p.placements, q.placements)
            assert torch.equal(p.to_local(), q.to_local()), name
    world, rank = _dp_coordinates(sc)
    assert_trains_like_torch(ours, theirs, make_batch, world, rank, steps=TORCH_STEPS)
    return seen


# Each scenario against torch once in the suite, the two placement choices alternating; both
# for every scenario in nox -s soak.
_AGAINST_TORCH = [(sc, placement) for sc in SCENARIOS for placement in (True, False)]


@needs_torch_fsdp2_on_cpu
@pytest.mark.parametrize(
    ("scenario", "torch_placement"),
    thinned(_AGAINST_TORCH, [(sc, i % 2 == 0) for i, sc in enumerate(SCENARIOS)]),
    ids=lambda v: {True: "shard-dim-0", False: "default"}.get(v, v) if isinstance(v, bool) else v,
)
def test_dp_mesh_dims_matches_torch(scenario: str, torch_placement: bool) -> None:
    seen = run_distributed(_train_both, 4, scenario, torch_placement, timeout=120)[0]
    assert len(seen) == 3, seen


# -- validation: everything is refused before anything changes -------------------------------


def _bad_case(case: str) -> str:
    mesh = device_mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = SPMDMLP()
    if case != "plain parameter":
        _distribute(model, mesh)
    if case == "DTensor on another mesh":
        other = device_mesh((4,), ("x",))
        model.down.weight = nn.Parameter(distribute_tensor(torch.ones(5, 12), other, [Replicate()]))
    if case == "sharded on a dp dim":
        model.down.weight = nn.Parameter(
            distribute_tensor(torch.ones(5, 12), mesh, [Shard(0), Replicate()])
        )
    kwargs: dict[str, Any] = {"mesh": mesh}
    error: type[Exception] = FullyShardValueError
    words: tuple[str, ...]
    if case == "name not in the mesh":
        kwargs["dp_mesh_dims"] = DataParallelMeshDims(shard="data")
        words = ("'data'", "not a dim", "('dp', 'tp')")
    elif case == "shard and replicate overlap":
        kwargs["dp_mesh_dims"] = DataParallelMeshDims(shard="dp", replicate=("dp",))
        words = ("both shard and replicate", "'dp'")
    elif case == "names out of the mesh's order":
        kwargs["dp_mesh_dims"] = DataParallelMeshDims(shard=("tp", "dp"))
        words = ("mesh's order", "('dp', 'tp')")
    elif case == "replicate only":
        kwargs["dp_mesh_dims"] = DataParallelMeshDims(replicate="dp")
        error, words = FullyShardNotImplementedError, ("no shard dim", "DistributedDataParallel")
    elif case == "mesh without names":
        kwargs["mesh"] = device_mesh((4,))
        kwargs["dp_mesh_dims"] = DataParallelMeshDims(shard="dp")
        words = ("mesh_dim_names",)
    elif case == "not a DataParallelMeshDims":
        kwargs["dp_mesh_dims"] = {"shard": "dp"}
        error, words = FullyShardTypeError, ("DataParallelMeshDims", "dict")
    elif case == "reshard_after_forward as an int":
        kwargs["dp_mesh_dims"] = DataParallelMeshDims(shard="dp")
        kwargs["reshard_after_forward"] = 2
        error, words = FullyShardNotImplementedError, ("reshard_after_forward=2", "True or False")
    elif case == "plain parameter":
        kwargs["dp_mesh_dims"] = DataParallelMeshDims(shard="dp")
        words = ("'up.weight'", "plain tensor", "Replicate()")
    elif case == "DTensor on another mesh":
        kwargs["dp_mesh_dims"] = DataParallelMeshDims(shard="dp")
        words = ("'down.weight'", "not on the mesh given to fully_shard")
    elif case == "sharded on a dp dim":
        kwargs["dp_mesh_dims"] = DataParallelMeshDims(shard="dp")
        words = ("'down.weight'", "Shard(dim=0)", "'dp'", "Replicate()")
    else:
        raise ValueError(case)
    before = snapshot(model)
    with pytest.raises(error) as info:
        fully_shard(model, **kwargs)
    assert_same(before, snapshot(model))
    message = str(info.value)
    for word in words:
        assert word in message, (case, word, message)
    return message


BAD_CASES = [
    "name not in the mesh",
    "shard and replicate overlap",
    "names out of the mesh's order",
    "replicate only",
    "mesh without names",
    "not a DataParallelMeshDims",
    "reshard_after_forward as an int",
    "plain parameter",
    "DTensor on another mesh",
    "sharded on a dp dim",
]


def test_bad_dp_mesh_dims_are_refused_before_anything_changes() -> None:
    messages = run_distributed(_bad_cases, 4)[0]
    assert len(messages) == len(BAD_CASES)


def _bad_cases() -> list[str]:
    messages = [_bad_case(case) for case in BAD_CASES]
    # The same module with valid arguments shards and trains afterwards.
    mesh = device_mesh((2, 2), ("dp", "tp"))
    model = SPMDMLP()
    _distribute(model, mesh)
    fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    model(torch.randn(3, DIMS[0])).sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())
    return messages
