"""Meshes as torchtitan makes them: slices of meshes unflattened from one 1-D world mesh.

torchtitan's ``ParallelDims.build_mesh()`` builds ``world = init_device_mesh(device, (W,),
("world",))`` and unflattens it several times: ``(batch, tp)`` for the data, ``(dp_replicate,
fsdp, tp)`` for the dense parameters, ``(dp_replicate, efsdp, ep)`` for the experts. ``fsdp``,
``tp``, ``efsdp`` and ``ep`` are slices of those, whose common parent is the world mesh that
names none of them. ``fully_shard`` composes such meshes from their ranks and layout
(``fully_shard.mesh.compose_meshes``): each parameter that tensor or expert parallelism made a
DTensor becomes one DTensor on the concatenated ``(dp dims..., own dims...)`` mesh, with the
placements torch's ``fully_shard`` gives it, checked here against torch's own on the same
meshes.

Every case trains against an unsharded model (``check_parity``, 3 AdamW steps, 1e-5):

- dense: a Llama-style ``Transformer`` with tensor parallelism (colwise / rowwise, as
  ``tp_plan.apply_tp``) and FSDP (``fsdp=2 x tp=2``) or HSDP (``dp_replicate=2 x fsdp=1 x
  tp=2``) at W = 4;
- mixture of experts: a dense first block and an MoE block (router, routed experts, a shared
  expert), sharded the way torchtitan's ``apply_fsdp_to_decoder`` does (a placement function
  that returns torch's ``ShardPlacementResult`` with the ``efsdp`` mesh for the experts and
  the ``fsdp`` mesh for the rest): EP 2 at W = 2 and W = 4, EP 4 at W = 4, experts on dim 1
  when they are fewer than ``efsdp x ep``, bf16 experts, and experts on a 2-D ``(ep, etp)``
  mesh (EP splits the experts, TP their hidden dim).

Then checkpoints: DCP saves at EP 2 (and TP + FSDP) and loads at EP 4 (and FSDP alone), the
model and the optimizer state; and gradient clipping by mesh dims, as torchtitan's
``clip_grad_norm_(ep_enabled=True)`` computes it.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from fully_shard import MixedPrecisionPolicy, ShardPlacementResult, fully_shard
from fully_shard._compat import can_concatenate_meshes, strided_shard
from harness import device_mesh, run_distributed
from matrix import FULL_MATRIX
from models import ModelArgs, SoftMoE, Transformer
from parity import (
    assert_stats_within,
    check_parity,
    make_float_batch,
    make_token_batch,
    param_diffs,
)
from tp_plan import apply_tp

pytestmark = pytest.mark.skipif(
    not can_concatenate_meshes(),
    reason=f"torch {torch.__version__} cannot compose unflattened meshes (2.13 or newer can)",
)

ARGS = ModelArgs(vocab_size=34, dim=16, n_layers=2, n_heads=4, ffn_hidden=34, max_seq_len=8)
make_tokens = functools.partial(make_token_batch, vocab_size=ARGS.vocab_size, seq_len=6)
IN, DIM, HIDDEN, OUT = 7, 8, 12, 5
make_rows = functools.partial(make_float_batch, in_dim=IN, out_dim=OUT)

# Built once per worker process: unflattening creates process groups (a collective).
_MESHES: dict[tuple[int, ...], dict[str, DeviceMesh]] = {}


def titan_meshes(*, dp_replicate: int = 1, tp: int = 1, ep: int = 1) -> dict[str, DeviceMesh]:
    """The meshes ``ParallelDims.build_mesh()`` makes at this world size (pp = cp = 1)."""
    key = (dist.get_world_size(), dp_replicate, tp, ep)
    if key not in _MESHES:
        world_size = key[0]
        fsdp = world_size // (dp_replicate * tp)
        world = device_mesh((world_size,), ("world",))
        data = world._unflatten(0, (dp_replicate * fsdp, tp), ("batch", "tp"))
        dense = world._unflatten(0, (dp_replicate, fsdp, tp), ("dp_replicate", "fsdp", "tp"))
        efsdp = fsdp * tp // ep
        sparse = world._unflatten(0, (dp_replicate, efsdp, ep), ("dp_replicate", "efsdp", "ep"))
        dp = ("dp_replicate", "fsdp") if dp_replicate > 1 else ("fsdp",)
        _MESHES[key] = {
            "dp": dense[dp],
            "tp": data["tp"],
            "efsdp": sparse["efsdp"],
            "ep": sparse["ep"],
        }
    return _MESHES[key]


def _torch_fully_shard() -> Any | None:
    """torch's ``fully_shard`` where it can shard on CPU, for the placements it makes."""
    if not hasattr(torch.cpu.Stream, "record_event"):
        return None
    from torch.distributed.fsdp import fully_shard as theirs

    return theirs


def _assert_layouts_like_torch(ours: nn.Module, theirs: nn.Module) -> list[str]:
    """Same mesh dims, placements and local shard for every parameter as torch's."""
    theirs_params = dict(theirs.named_parameters())
    seen = []
    for name, p in ours.named_parameters():
        q = theirs_params[name]
        assert isinstance(p, DTensor) and isinstance(q, DTensor), name
        assert p.device_mesh.mesh_dim_names == q.device_mesh.mesh_dim_names, name
        assert p.placements == q.placements, (name, p.placements, q.placements)
        assert torch.equal(p.to_local(), q.to_local()), name
        seen.append(f"{name}: {p.placements}")
    return seen


# -- dense: tensor parallel + FSDP / HSDP ----------------------------------------------------


def _shard_dense(model: nn.Module, dp: DeviceMesh, *, impl: Any = fully_shard, **dims: int) -> None:
    assert isinstance(model, Transformer)
    apply_tp(model, titan_meshes(**dims)["tp"])
    for layer in model.layers:
        impl(layer, mesh=dp)
    impl(model, mesh=dp)


def _dense(dp_replicate: int) -> dict[str, Any]:
    dims = {"dp_replicate": dp_replicate, "tp": 2}
    dp = titan_meshes(**dims)["dp"]
    shard = functools.partial(_shard_dense, **dims)
    stats = dict(check_parity(lambda: Transformer(ARGS), shard, make_tokens, dp, steps=3))
    theirs_impl = _torch_fully_shard()
    if theirs_impl is not None:
        torch.manual_seed(0)
        ours, theirs = Transformer(ARGS), Transformer(ARGS)
        theirs.load_state_dict(ours.state_dict())
        _shard_dense(ours, dp, **dims)
        _shard_dense(theirs, dp, impl=theirs_impl, **dims)
        stats["layouts"] = _assert_layouts_like_torch(ours, theirs)
    return stats


@pytest.mark.parametrize(
    "dp_replicate", [pytest.param(1, id="fsdp2xtp2"), pytest.param(2, id="hsdp2x1xtp2")]
)
def test_tp_fsdp_on_unflattened_meshes(dp_replicate: int) -> None:
    results = run_distributed(_dense, 4, dp_replicate, timeout=120)
    for stats in results:
        assert_stats_within(stats, 1e-5, grads=False)
    layouts = results[0].get("layouts")
    if layouts is not None:  # torch's own FSDP2 runs on this CPU torch
        assert "layers.0.attention.wq.weight: (_StridedShard(dim=0, sf=2), Shard(dim=0))" in [
            line.replace("Replicate(), ", "", 1) for line in layouts
        ]


# -- mixture of experts with expert parallelism ----------------------------------------------


class MoENet(nn.Module):
    """A dense first block, an MoE block (router, routed experts, a shared expert), a head."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.layers = nn.ModuleList(
            [nn.Linear(DIM, DIM), SoftMoE(DIM, HIDDEN, experts, shared=True)]
        )
        self.out = nn.Linear(DIM, OUT)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.inp(x))
        h = h + F.gelu(self.layers[0](h))
        return self.out(h + self.layers[1](h))  # type: ignore[no-any-return]


def _placement_fn(moe: SoftMoE, meshes: dict[str, DeviceMesh], result: str) -> Any:
    """torchtitan's ``apply_fsdp_to_decoder`` placement function for an MoE block, EP > 1:
    experts on ``efsdp`` (dim 1 when they are fewer than ``efsdp x ep``), the rest on ``dp``,
    with torch's ``ShardPlacementResult`` / ``FSDPMeshInfo`` (``result="torch"``) or ours."""
    experts = {moe.w_in, moe.w_out}
    efsdp, ep = meshes["efsdp"], meshes["ep"]
    placement = Shard(1) if efsdp.size() * ep.size() > moe.w_in.shape[0] else Shard(0)
    if result == "torch":
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            FSDPMeshInfo,
        )
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            ShardPlacementResult as TorchResult,
        )

        expert_info = FSDPMeshInfo(efsdp, shard_mesh_dim=0)
        dense_info = FSDPMeshInfo(meshes["dp"], shard_mesh_dim=0)
        return lambda p: (
            TorchResult(placement=placement, mesh_info=expert_info)
            if p in experts
            else TorchResult(placement=Shard(0), mesh_info=dense_info)
        )
    return lambda p: ShardPlacementResult(placement, efsdp) if p in experts else None


def _shard_moe(
    model: nn.Module,
    dp: DeviceMesh,
    *,
    ep: int,
    result: str,
    impl: Any = fully_shard,
    reshard: bool | int = True,
) -> None:
    assert isinstance(model, MoENet)
    meshes = titan_meshes(ep=ep)
    moe = model.layers[1]
    assert isinstance(moe, SoftMoE)
    for name in ("w_in", "w_out"):  # expert parallel: each EP rank holds experts / ep
        w = getattr(moe, name)
        setattr(moe, name, nn.Parameter(distribute_tensor(w.detach(), meshes["ep"], [Shard(0)])))
    mp = MixedPrecisionPolicy(cast_forward_inputs=False)
    blocks = {"mesh": dp, "mp_policy": mp, "reshard_after_forward": reshard}
    impl(model.layers[0], **blocks)
    impl(moe, **blocks, shard_placement_fn=_placement_fn(moe, meshes, result))
    impl(model, mesh=dp, mp_policy=mp)


def _moe(ep: int, experts: int, result: str, dtype: torch.dtype) -> dict[str, Any]:
    meshes = titan_meshes(ep=ep)

    def build() -> nn.Module:
        model = MoENet(experts)
        model.layers[1].w_in.data = model.layers[1].w_in.data.to(dtype)
        model.layers[1].w_out.data = model.layers[1].w_out.data.to(dtype)
        return model

    # EP peers see the same tokens (the soft MoE sums its experts over them); the efsdp ranks
    # see different ones. The dense parameters average over every rank, which is the same.
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    shard = functools.partial(_shard_moe, ep=ep, result=result)
    stats = dict(check_parity(build, shard, make_rows, meshes["efsdp"], steps=3, **tol))
    model = build()
    _shard_moe(model, meshes["dp"], ep=ep, result=result)
    w_in = model.layers[1].w_in
    stats["experts"] = (w_in.device_mesh.mesh_dim_names, w_in.placements, w_in.dtype)
    theirs_impl = _torch_fully_shard()
    if theirs_impl is not None and dtype == torch.float32:
        torch.manual_seed(0)
        ours, theirs = build(), build()
        theirs.load_state_dict(ours.state_dict())
        _shard_moe(ours, meshes["dp"], ep=ep, result=result)
        _shard_moe(theirs, meshes["dp"], ep=ep, result="torch", impl=theirs_impl)
        stats["layouts"] = _assert_layouts_like_torch(ours, theirs)
    return stats


MOE_CASES = [
    pytest.param(2, 2, 4, "torch", torch.float32, id="W2-ep2"),
    pytest.param(4, 2, 4, "torch", torch.float32, id="W4-ep2"),
    pytest.param(4, 4, 4, "ours", torch.float32, id="W4-ep4"),
    pytest.param(4, 2, 2, "torch", torch.float32, id="W4-ep2-experts-dim1"),
    pytest.param(4, 2, 4, "torch", torch.bfloat16, id="W4-ep2-bf16"),
]


@pytest.mark.parametrize(("world", "ep", "experts", "result", "dtype"), MOE_CASES)
def test_moe_with_expert_parallelism(
    world: int, ep: int, experts: int, result: str, dtype: torch.dtype
) -> None:
    if result == "torch":
        pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_common")
    results = run_distributed(_moe, world, ep, experts, result, dtype, timeout=120)
    for stats in results:
        assert_stats_within(stats, 1e-5 if dtype == torch.float32 else 2e-2)
    names, placements, got_dtype = results[0]["experts"]
    assert names == ("efsdp", "ep") and got_dtype == dtype
    # EP shards the experts first (the inner mesh dim); fully_shard splits each EP rank's
    # experts (a strided shard on dim 0) or their rows (dim 1)
    dim1 = world > experts  # efsdp x ep > experts: torchtitan shards the experts' rows
    want = (Shard(1), Shard(0)) if dim1 else (strided_shard(0, ep), Shard(0))
    assert tuple(placements) == want, placements


def _moe_resharding_to_two_ranks() -> dict[str, Any]:
    """``reshard_after_forward=2`` on torchtitan's meshes: the dense blocks keep a 2-rank
    piece of the 4-rank split between forward and backward, the experts (over 2 ranks) all of
    theirs; the post-forward groups are found from the meshes' ranks."""
    shard = functools.partial(_shard_moe, ep=2, result="ours", reshard=2)
    meshes = titan_meshes(ep=2)
    stats = dict(check_parity(lambda: MoENet(4), shard, make_rows, meshes["efsdp"], steps=3))
    model = MoENet(4)
    shard(model, meshes["dp"])
    subgroups = [g.config.post_forward for g in model.layers[0]._fsdp_state.groups]
    stats["pieces"] = [
        (sub.size, sorted(dist.get_process_group_ranks(sub.group))) for sub in subgroups
    ]
    return stats


def test_reshard_after_forward_to_two_ranks_on_unflattened_meshes() -> None:
    for rank, stats in enumerate(run_distributed(_moe_resharding_to_two_ranks, 4)):
        assert_stats_within(stats, 1e-5)
        # the dense block's pieces: consecutive fsdp ranks (the world in order here)
        assert stats["pieces"] == [(2, [0, 1] if rank < 2 else [2, 3])], stats["pieces"]


def _shard_ep_by_tp(model: nn.Module, dp: DeviceMesh) -> None:
    """Experts on a 2-D ``(ep, etp)`` mesh: EP splits the experts, TP their hidden dim."""
    assert isinstance(model, MoENet)
    world = device_mesh((4,), ("world",))
    sparse = world._unflatten(0, (1, 2, 2), ("efsdp", "ep", "etp"))
    own, moe = sparse["ep", "etp"], model.layers[1]
    assert isinstance(moe, SoftMoE)
    moe.w_in = nn.Parameter(distribute_tensor(moe.w_in.detach(), own, [Shard(0), Shard(2)]))
    moe.w_out = nn.Parameter(distribute_tensor(moe.w_out.detach(), own, [Shard(0), Shard(1)]))
    experts = {moe.w_in, moe.w_out}
    fully_shard(model.layers[0], mesh=dp)
    efsdp = sparse["efsdp"]
    fully_shard(
        moe,
        mesh=dp,
        shard_placement_fn=lambda p: (
            ShardPlacementResult(Shard(0), efsdp) if p in experts else None
        ),
    )
    fully_shard(model, mesh=dp)


def _ep_by_tp() -> dict[str, Any]:
    # every rank sees the same rows: the efsdp dim has one rank (a 1-rank data mesh)
    data = device_mesh((4,), ("world",))._unflatten(0, (1, 4), ("data", "rest"))["data"]
    stats = dict(check_parity(lambda: MoENet(4), _shard_ep_by_tp, make_rows, data, steps=3))
    model = MoENet(4)
    _shard_ep_by_tp(model, titan_meshes()["dp"])
    w_in = model.layers[1].w_in
    stats["experts"] = (w_in.device_mesh.mesh_dim_names, w_in.placements)
    return stats


def test_experts_on_an_ep_by_tp_mesh() -> None:
    results = run_distributed(_ep_by_tp, 4)
    for stats in results:
        assert_stats_within(stats, 1e-5)
    names, placements = results[0]["experts"]
    assert names == ("efsdp", "ep", "etp")
    assert tuple(placements) == (strided_shard(0, 2), Shard(0), Shard(2)), placements


# -- checkpoints across layouts, and clipping by mesh dims -----------------------------------


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x, y = make_rows(4, torch.Generator().manual_seed(seed))
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Tensor]:
    model_sd, optim_sd = get_state_dict(model, opt)
    out = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        for k, v in state.items():
            out[f"optim.{fqn}.{k}"] = v
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in out.items()
        if isinstance(v, Tensor)
    }


def _checkpoint_across_layouts(path: str) -> list[str]:
    compared = []
    for kind, save_as, load_as in (
        ("moe", {"ep": 2}, {"ep": 4}),
        ("dense", {"tp": 2}, {}),
    ):
        models, opts = [], []
        for dims in (save_as, load_as):
            torch.manual_seed(0)
            if kind == "moe":
                model: nn.Module = MoENet(4)
                _shard_moe(model, titan_meshes(**dims)["dp"], result="ours", **dims)
            else:
                model = MoENet(4)  # the experts stay plain: tensor parallel dense layers
                if dims:
                    colwise = ColwiseParallel(output_layouts=Replicate())
                    plan = {"inp": colwise, "layers.0": colwise}
                    parallelize_module(model, titan_meshes(**dims)["tp"], plan)
                for m in (model.layers[0], model):
                    fully_shard(m, mesh=titan_meshes(**dims)["dp"])
            models.append(model)
            opts.append(torch.optim.AdamW(model.parameters(), lr=1e-2))
        _train_step(models[0], opts[0], seed=1)
        saved = _full_state(models[0], opts[0])
        where = f"{path}/{kind}"
        model_sd, optim_sd = get_state_dict(models[0], opts[0])
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=where)
        _train_step(models[1], opts[1], seed=2)  # some state to overwrite
        model_sd, optim_sd = get_state_dict(models[1], opts[1])
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=where)
        set_state_dict(
            models[1], opts[1], model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        loaded = _full_state(models[1], opts[1])
        assert saved.keys() == loaded.keys(), sorted(saved.keys() ^ loaded.keys())
        for k, v in saved.items():
            torch.testing.assert_close(loaded[k], v, rtol=0, atol=0, msg=f"{kind}: {k}")
        compared.append(f"{kind}: {len(saved)} tensors")
    return compared


def test_checkpoint_saved_at_one_layout_loads_at_another(tmp_path: Path) -> None:
    got = run_distributed(_checkpoint_across_layouts, 4, str(tmp_path), timeout=180)[0]
    assert [line.split(":")[0] for line in got] == ["moe", "dense"], got


def _clip_by_mesh_dims() -> tuple[float, float]:
    """torchtitan's ``clip_grad_norm_(ep_enabled=True)``: the norm of the parameters whose
    mesh has an ``ep`` dim and of the others, each over its own mesh, combined."""
    meshes = titan_meshes(ep=2)
    torch.manual_seed(0)
    model, reference = MoENet(4), MoENet(4)
    reference.load_state_dict(model.state_dict())
    _shard_moe(model, meshes["dp"], ep=2, result="ours")
    x, y = make_rows(8, torch.Generator().manual_seed(3))
    rank = meshes["efsdp"].get_local_rank()  # EP peers see the same rows
    F.mse_loss(model(x[4 * rank : 4 * rank + 4]), y[4 * rank : 4 * rank + 4]).backward()
    F.mse_loss(reference(x), y).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    on_ep = ["ep" in (p.device_mesh.mesh_dim_names or ()) for p in params]
    assert sum(on_ep) == 2  # the experts
    norms = []
    for want_ep in (True, False):
        part = [p for p, ep in zip(params, on_ep, strict=True) if ep == want_ep]
        norm = torch.nn.utils.get_total_norm([p.grad for p in part])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = math.sqrt(sum(float(n) ** 2 for n in norms))
    want = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    return total, float(want)


def test_grad_norm_by_mesh_dims_equals_the_unsharded_norm() -> None:
    for total, want in run_distributed(_clip_by_mesh_dims, 4):
        assert math.isclose(total, want, rel_tol=1e-5), (total, want)


# -- the one graph ---------------------------------------------------------------------------


def _moe_in_one_graph() -> tuple[float, float, int]:
    """EP 2 at W = 4 under ``torch.compile(fullgraph=True)``: the experts' gathers and
    reductions and EP's sum over the expert ranks in one graph, beside our eager engine and
    the unsharded model (the sequence-parallel Llama of ``test_graph`` runs on unflattened
    ``(dp, tp)`` meshes the same way)."""
    torch._dynamo.reset()
    meshes = titan_meshes(ep=2)
    torch.manual_seed(0)
    compiled, eager, reference = MoENet(4), MoENet(4), MoENet(4)
    eager.load_state_dict(compiled.state_dict())
    reference.load_state_dict(compiled.state_dict())
    for model in (compiled, eager):
        _shard_moe(model, meshes["dp"], ep=2, result="ours")
    run = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    models = (run, eager, reference)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (compiled, eager, reference)]
    rank = meshes["efsdp"].get_local_rank()  # EP peers see the same rows
    for step in range(3):
        x, y = make_rows(8, torch.Generator().manual_seed(step))
        mine = slice(4 * rank, 4 * rank + 4)
        for model, opt, rows in zip(models, opts, (mine, mine, slice(None)), strict=True):
            F.mse_loss(model(x[rows]), y[rows]).backward()
            opt.step()
            opt.zero_grad()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return max(param_diffs(compiled, eager)), max(param_diffs(compiled, reference)), frames


@pytest.mark.skipif(not FULL_MATRIX, reason="a 20 s compile: nox -s soak runs it")
def test_moe_with_expert_parallelism_in_one_graph() -> None:
    for to_eager, to_reference, graphs in run_distributed(_moe_in_one_graph, 4, timeout=300):
        assert to_eager < 1e-5 and to_reference < 1e-5, (to_eager, to_reference)
        assert graphs == 1, graphs  # one frame, compiled once, no graph break
