"""Per-parameter meshes: ``shard_placement_fn`` returning a ``ShardPlacementResult`` with a mesh.

A mixture-of-experts toy at W = 4: the experts of ``moe`` are sharded over a sub-mesh of 2
ranks, the router and the dense layers around it over all 4, in one ``fully_shard`` call,
which then owns two groups (one all-gather and one reduce-scatter per mesh). Two layouts:

- ``ep``: expert parallel. The experts are DTensors ``Shard(0)`` on ``root["ep"]`` (2 of the 4
  experts per EP rank, each rank computing its own experts for every token of its EP group)
  and ``fully_shard`` shards them further over ``root["efsdp"]``, the 2 ranks that hold the
  same experts. EP peers see the same batch, the ``efsdp`` ranks different ones.
- ``hsdp``: the experts are plain parameters sharded over a 2-D ``(replicate, shard)`` mesh of
  2 x 2 (sharded over 2 ranks, replicated over the other 2); every rank sees its own batch.

Each is checked against an unsharded replica (``check_parity``, 5 AdamW steps, 1e-5) and
against torch's ``fully_shard`` given torch's own ``ShardPlacementResult`` (same losses and
parameters step by step, same local shards). Ours also accepts torch's result object, and
our ``ShardPlacementResult`` takes torch's field names (``placement=``, ``mesh_info=`` with
our ``FSDPMeshInfo`` / ``HSDPMeshInfo``) as well as ours.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from example_runner import run_example
from fully_shard import (
    CountingComm,
    DataParallelMeshDims,
    FSDPMeshInfo,
    FSDPModule,
    FullyShardNotImplementedError,
    FullyShardTypeError,
    FullyShardValueError,
    HSDPMeshInfo,
    ShardPlacementResult,
    fully_shard,
    trace,
)
from harness import device_mesh, run_distributed
from models import SoftMoE
from parity import (
    assert_same,
    assert_stats_within,
    assert_trains_like_torch,
    check_parity,
    make_float_batch,
    needs_torch_fsdp2_on_cpu,
    snapshot,
)

IN, DIM, HIDDEN, EXPERTS, OUT = 7, 8, 12, 4, 5
make_batch = functools.partial(make_float_batch, in_dim=IN, out_dim=OUT)
LAYOUTS = ["ep", "hsdp"]


def MoE() -> SoftMoE:
    return SoftMoE(DIM, HIDDEN, EXPERTS)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.moe = MoE()
        self.out = nn.Linear(DIM, OUT)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.inp(x))
        return self.out(h + self.moe(h))  # type: ignore[no-any-return]


def _world() -> DeviceMesh:
    return device_mesh((4,), ("dp",))


def _ep_root() -> DeviceMesh:
    return device_mesh((2, 2), ("ep", "efsdp"))


def _expert_mesh(layout: str) -> DeviceMesh:
    """The mesh the experts are sharded over by fully_shard (2 shard ranks either way)."""
    return _ep_root()["efsdp"] if layout == "ep" else device_mesh((2, 2), ("rep", "shard"))


def _data_mesh(layout: str) -> DeviceMesh:
    """The ranks that see different batches (check_parity's split)."""
    return _ep_root()["efsdp"] if layout == "ep" else _world()


def _is_expert(p: nn.Parameter) -> bool:
    return p.dim() == 3


def _placement_fn(layout: str, result: str) -> Any:
    """``result``: "mesh" (ours, our field), "mesh_info" (ours, torch's field names and our
    FSDPMeshInfo / HSDPMeshInfo), "torch" (torch's result and mesh infos)."""
    mesh = _expert_mesh(layout)
    if result == "mesh":
        return lambda p: ShardPlacementResult(Shard(0), mesh) if _is_expert(p) else None
    if result == "mesh_info":
        ours = (
            FSDPMeshInfo(mesh, shard_mesh_dim=0)
            if mesh.ndim == 1
            else HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
        )
        assert ours.shard_mesh_size == 2 and ours.shard_mesh_rank == mesh.get_local_rank(-1)
        return lambda p: (
            ShardPlacementResult(placement=Shard(0), mesh_info=ours) if _is_expert(p) else None
        )
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo as TorchFSDPMeshInfo,
    )
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        HSDPMeshInfo as TorchHSDPMeshInfo,
    )
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        ShardPlacementResult as TorchResult,
    )

    info = (
        TorchFSDPMeshInfo(mesh, shard_mesh_dim=0)
        if mesh.ndim == 1
        else TorchHSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    )
    return lambda p: TorchResult(Shard(0), info) if _is_expert(p) else None


def _shard(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    layout: str,
    torch_impl: bool = False,
    result: str = "mesh",
) -> None:
    assert isinstance(model, Net)
    if layout == "ep":
        ep = _ep_root()["ep"]
        for name in ("w_in", "w_out"):
            p = getattr(model.moe, name)
            setattr(model.moe, name, nn.Parameter(distribute_tensor(p.detach(), ep, [Shard(0)])))
    if torch_impl:
        from torch.distributed.fsdp import fully_shard as impl
    else:
        impl = fully_shard
    fn = _placement_fn(layout, "torch" if torch_impl else result)
    impl(model.moe, mesh=_world(), shard_placement_fn=fn)
    impl(model, mesh=_world())


# -- parity against an unsharded replica -----------------------------------------------------


def _parity(layout: str, result: str) -> dict[str, Any]:
    stats = check_parity(
        Net,
        functools.partial(_shard, layout=layout, result=result),
        make_batch,
        _data_mesh(layout),
        steps=5,
    )
    return dict(stats)


@pytest.mark.parametrize("result", ["mesh", "mesh_info", "torch"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_experts_on_a_sub_mesh_train_like_unsharded(layout: str, result: str) -> None:
    if result == "torch":
        pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_common")
    for stats in run_distributed(_parity, 4, layout, result, timeout=120):
        assert_stats_within(stats, 1e-5)


def _groups_and_collectives(layout: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    _shard(model, _world(), layout=layout)
    assert isinstance(model, FSDPModule) and isinstance(model.moe, FSDPModule)
    groups = model.moe._fsdp_state.groups
    counter = CountingComm()
    model.set_comm(counter)
    with trace.record(model) as rec:
        model(torch.randn(3, IN)).sum().backward()
    gathered = sorted({e.group for e in rec.recording().events_of("all_gather")})
    placements = {n: str(p.placements) for n, p in model.moe.named_parameters()}
    meshes = {n: p.device_mesh.mesh_dim_names for n, p in model.moe.named_parameters()}
    return {
        "groups": [(g.label, g.info.shard_size, g.info.replicate_size) for g in groups],
        "params": [[p.fqn for p in g.params] for g in groups],
        "placements": placements,
        "meshes": meshes,
        "counts": counter.count_by_op(),
        "traced": gathered,
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_call_owns_one_group_per_mesh(layout: str) -> None:
    got = run_distributed(_groups_and_collectives, 4, layout)[0]
    expert_group = ("moe@efsdp", 2, 1) if layout == "ep" else ("moe@shard", 2, 2)
    assert got["groups"] == [("moe", 4, 1), expert_group]
    assert got["params"] == [["router.weight", "router.bias"], ["w_in", "w_out"]]
    assert got["traced"] == sorted(["root", "moe", expert_group[0]])  # each group on the timeline
    if layout == "ep":
        # Shard(0) asked for on top of EP's Shard(0): EP (outer dim) splits the experts first,
        # fully_shard (inner) splits each EP rank's experts, so plain Shard describes it
        assert got["meshes"]["w_in"] == ("ep", "efsdp")
        assert got["placements"]["w_in"] == "(Shard(dim=0), Shard(dim=0))"
    else:
        assert got["meshes"]["w_in"] == ("rep", "shard")
        assert got["placements"]["w_in"] == "(Replicate(), Shard(dim=0))"
    assert got["meshes"]["router.weight"] == ("dp",)
    # root (inp, out) + moe's two groups: each gathered in forward and again in backward but
    # the root's, each reduced once; the HSDP expert group all-reduces over its replicas too.
    assert got["counts"] == {
        "all_gather": 1 + 2 * 2,
        "reduce_scatter": 3,
        **({"all_reduce": 1} if layout == "hsdp" else {}),
    }


# -- against torch's fully_shard ------------------------------------------------------------


def _train_both(layout: str) -> int:
    torch.manual_seed(0)
    ours, theirs = Net(), Net()
    theirs.load_state_dict(ours.state_dict())
    _shard(ours, _world(), layout=layout)
    _shard(theirs, _world(), layout=layout, torch_impl=True)
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs_params[name]
        assert isinstance(p, DTensor) and isinstance(q, DTensor), name
        # torch puts the dp dims first on its own concatenated mesh, we keep the root's
        # order: the same local shard either way.
        assert torch.equal(p.to_local(), q.to_local()), (name, p.placements, q.placements)
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0, atol=0, msg=name)
    data = _data_mesh(layout)
    steps = 4
    assert_trains_like_torch(
        ours, theirs, make_batch, data.size(), data.get_local_rank(), steps=steps
    )
    return steps


@needs_torch_fsdp2_on_cpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_param_meshes_match_torch(layout: str) -> None:
    assert run_distributed(_train_both, 4, layout, timeout=120) == [4] * 4


# -- validation ------------------------------------------------------------------------------


class _NotAMeshInfo:
    mesh = "not a mesh"


def _bad_cases() -> list[str]:
    messages = []
    sub = _expert_mesh("ep")

    def check(call: Any, error: type[Exception], words: tuple[str, ...], model: nn.Module) -> None:
        before = snapshot(model)
        with pytest.raises(error) as info:
            call(model)
        assert_same(before, snapshot(model))
        for word in words:
            assert word in str(info.value), (word, str(info.value))
        messages.append(str(info.value))

    def with_fn(fn: Any, **kwargs: Any) -> Any:
        return lambda m: fully_shard(m, mesh=_world(), shard_placement_fn=fn, **kwargs)

    # the placement of a result must be a Shard (checked when the result is built)
    with pytest.raises(FullyShardTypeError, match="must be a Shard"):
        ShardPlacementResult(Replicate(), sub)  # type: ignore[arg-type]
    with pytest.raises(FullyShardTypeError, match="must be a DeviceMesh"):
        ShardPlacementResult(Shard(0), "dp")  # type: ignore[arg-type]
    with pytest.raises(FullyShardTypeError, match="pass mesh= or mesh_info="):
        ShardPlacementResult(Shard(0))
    with pytest.raises(FullyShardValueError, match="and a mesh_info on mesh"):
        ShardPlacementResult(Shard(0), _world(), FSDPMeshInfo(sub, shard_mesh_dim=0))
    # torch raises AssertionError for a mesh info without its dims: ours is one too
    with pytest.raises(AssertionError, match="needs shard_mesh_dim"):
        FSDPMeshInfo(sub)
    with pytest.raises(AssertionError, match="needs replicate_mesh_dim"):
        HSDPMeshInfo(_expert_mesh("hsdp"), shard_mesh_dim=1)
    with pytest.raises(FullyShardValueError, match="not a dim of the 1-D mesh"):
        FSDPMeshInfo(sub, shard_mesh_dim=1)
    with pytest.raises(FullyShardNotImplementedError, match="full-SPMD-mesh mode"):
        FSDPMeshInfo(sub, shard_mesh_dim=0, dp_mesh_dims=DataParallelMeshDims(shard="efsdp"))
    # a (shard, replicate) order fully_shard does not read: refused with the parameter's name
    check(
        with_fn(
            lambda p: (
                ShardPlacementResult(
                    None, HSDPMeshInfo(_expert_mesh("hsdp"), shard_mesh_dim=0, replicate_mesh_dim=1)
                )
                if _is_expert(p)
                else None
            )
        ),
        FullyShardValueError,
        ("'w_in'", "shards mesh dim 0 and replicates dim 1"),
        MoE(),
    )
    # reshard_after_forward=4 divides the world mesh but not the 2-rank expert mesh
    check(
        with_fn(
            lambda p: ShardPlacementResult(None, sub) if _is_expert(p) else None,
            reshard_after_forward=4,
        ),
        FullyShardValueError,
        ("reshard_after_forward=4", "shard world size 2"),
        MoE(),
    )
    # a torch-style result whose mesh_info has no mesh
    torch_like = type("TorchLike", (), {"placement": Shard(0), "mesh_info": _NotAMeshInfo()})
    check(
        with_fn(lambda p: torch_like() if _is_expert(p) else None),
        FullyShardTypeError,
        ("'w_in'", "mesh_info", "ShardPlacementResult(placement, mesh)"),
        MoE(),
    )
    # per-parameter meshes and dp_mesh_dims together
    full = device_mesh((2, 2), ("dp", "tp"))
    spmd = MoE()
    for name, p in list(spmd.named_parameters()):
        owner = spmd.router if name.startswith("router") else spmd
        setattr(
            owner,
            name.split(".")[-1],
            nn.Parameter(distribute_tensor(p.detach(), full, [Replicate(), Replicate()])),
        )
    check(
        lambda m: fully_shard(
            m,
            mesh=full,
            dp_mesh_dims=DataParallelMeshDims(shard="dp"),
            shard_placement_fn=lambda p: ShardPlacementResult(None, sub) if p.dim() == 3 else None,
        ),
        FullyShardNotImplementedError,
        ("'w_in'", "dp_mesh_dims", "per-parameter meshes"),
        spmd,
    )
    # one hook / custom comm for groups on two meshes is ambiguous
    moe = MoE()
    fully_shard(
        moe,
        mesh=_world(),
        shard_placement_fn=lambda p: ShardPlacementResult(None, sub) if _is_expert(p) else None,
    )
    assert isinstance(moe, FSDPModule)
    for call in (
        lambda: moe.set_all_reduce_hook(lambda t: None),
        lambda: moe.set_custom_all_gather(_Comm()),
        lambda: moe.set_custom_reduce_scatter(_Comm()),
    ):
        with pytest.raises(FullyShardValueError, match="2 meshes") as info:
            call()
        messages.append(str(info.value))
    assert all(g.config.all_reduce_hook is None for g in moe._fsdp_state.groups)
    return messages


class _Comm:
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("never issued")


def test_bad_per_param_meshes_are_refused_before_anything_changes() -> None:
    messages = run_distributed(_bad_cases, 4)[0]
    assert len(messages) == 7


def test_moe_example_at_4_ranks() -> None:
    """examples/moe_experts.py on the warm 4-rank pool: EP 2 x expert-FSDP 2."""
    out = run_distributed(run_example, 4, "moe_experts.py", ["--steps", "3"], timeout=120)[0]
    assert "moe: 2 groups, sharded over 4 ranks (router.weight, router.bias), 2 ranks" in out
    diff = re.search(r"max \|sharded - unsharded\| over all parameters: (\S+)", out)
    assert diff is not None and float(diff.group(1)) <= 1e-5, out
