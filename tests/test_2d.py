"""2-D meshes: HSDP ``(replicate, shard)`` and tensor parallel + fully_shard ``(dp, tp)``.

Every test compares against an unsharded model computing the same thing: parity through
``check_parity`` (per-step loss, every gradient, final parameters), the exact layout of every
TP+FSDP parameter (its local tensor is exactly the slice the placements promise), and DCP
checkpoints that move from TP+FSDP at W = 4 to FSDP-only at W = 2 and to an unsharded model
at W = 1, after which training continues with the same losses.

Training runs take 2 optimizer steps (parity), and 1 before a DCP save and 2 after the load:
a second step runs on the optimizer state and the sharded parameters the first one left (or
loaded), which is all that a longer run repeats. With ``FULLY_SHARD_FULL_MATRIX=1`` they take
5, 2 and 3, as they used to.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fully_shard import (
    CountingComm,
    FSDPModule,
    FullyShardNotImplementedError,
    FullyShardValueError,
    fully_shard,
)
from fully_shard._compat import can_concatenate_meshes, strided_shard_handles_uneven
from harness import device_mesh, mesh_1d, run_distributed
from matrix import FULL_MATRIX
from models import MLPStack, ModelArgs, Transformer
from parity import (
    assert_same,
    assert_stats_within,
    check_parity,
    make_token_batch,
    snapshot,
    train_on_rank_rows,
    wrap_layers_then_root,
)
from tp_plan import apply_tp_then_fully_shard, chunk_piece

# The same-dim case below is uneven: torch releases whose _StridedShard cannot describe that
# (2.6) make fully_shard refuse it, which test_uneven_strided_split_is_refused_... checks.
SAME_DIM = pytest.param(
    True,
    id="same-dim-strided",
    marks=pytest.mark.skipif(
        not strided_shard_handles_uneven(),
        reason=f"torch {torch.__version__} cannot describe an uneven strided layout",
    ),
)

STEPS = 5 if FULL_MATRIX else 2  # optimizer steps of a parity run (a step after a step)

# vocab 34 and ffn_hidden 34: 17 rows per TP rank, which two dp ranks split 9 + 8 (uneven).
ARGS = ModelArgs(vocab_size=34, dim=16, n_layers=2, n_heads=4, ffn_hidden=34, max_seq_len=8)
make_batch = functools.partial(make_token_batch, vocab_size=ARGS.vocab_size, seq_len=6)


def _root() -> DeviceMesh:
    return device_mesh((2, 2), ("dp", "tp"))


def _same_dim(p: nn.Parameter) -> Shard:
    """Shard on dim 0 even where TP shards dim 0 too (the strided case)."""
    return Shard(0)


def _shard_tp_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, same_dim: bool = False) -> None:
    assert isinstance(model, Transformer)
    root = _root()
    assert dp_mesh == root["dp"]
    apply_tp_then_fully_shard(model, root, _same_dim if same_dim else None)


# -- HSDP ------------------------------------------------------------------------------------


def _hsdp_parity(model_name: str) -> dict[str, Any]:
    mesh = device_mesh((2, 2), ("replicate", "shard"))
    if model_name == "mlp":
        dims = [7, 13, 5, 3]

        def build() -> nn.Module:
            return MLPStack(dims)

        def batch(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
            return torch.randn(n, dims[0], generator=gen), torch.randn(n, dims[-1], generator=gen)

        stats = check_parity(build, wrap_layers_then_root(fully_shard), batch, mesh, steps=STEPS)
    else:
        stats = check_parity(
            lambda: Transformer(ARGS),
            wrap_layers_then_root(fully_shard),
            make_batch,
            mesh,
            steps=STEPS,
        )
    return dict(stats)


@pytest.mark.parametrize("model_name", ["mlp", "transformer"])
def test_hsdp_2x2_parity(model_name: str) -> None:
    for stats in run_distributed(_hsdp_parity, 4, model_name):
        assert_stats_within(stats, 1e-5, grads=False)


def _hsdp_layout_and_collectives() -> dict[str, int]:
    mesh = device_mesh((2, 2), ("replicate", "shard"))
    torch.manual_seed(0)
    model = MLPStack([7, 13, 5, 3])
    wrap_layers_then_root(fully_shard)(model, mesh)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        assert p.device_mesh == mesh, name
        assert p.placements == (Replicate(), Shard(0)), (name, p.placements)
    comm = CountingComm()
    assert isinstance(model, FSDPModule)
    model.set_comm(comm)
    model(torch.randn(2, 7)).sum().backward()
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
    return comm.count_by_op()


def test_hsdp_reduce_scatters_over_shard_and_all_reduces_over_replicate() -> None:
    blocks = 3  # the root owns no parameter of MLPStack: only the blocks communicate
    for counts in run_distributed(_hsdp_layout_and_collectives, 4):
        # the blocks reshard after forward (not the root), so backward gathers them again
        assert counts == {"all_gather": 2 * blocks, "reduce_scatter": blocks, "all_reduce": blocks}


# -- TP + FSDP -------------------------------------------------------------------------------


def _tp_fsdp_parity(same_dim: bool) -> dict[str, Any]:
    root = _root()
    stats = check_parity(
        lambda: Transformer(ARGS),
        functools.partial(_shard_tp_fsdp, same_dim=same_dim),
        make_batch,
        root["dp"],
        steps=STEPS,
    )
    return dict(stats)


@pytest.mark.parametrize("same_dim", [pytest.param(False, id="free-dim"), SAME_DIM])
def test_tp_fsdp_2x2_parity(same_dim: bool) -> None:
    for stats in run_distributed(_tp_fsdp_parity, 4, same_dim):
        assert_stats_within(stats, 1e-5, grads=False)


def _tp_fsdp_layout(same_dim: bool) -> list[str]:
    root = _root()
    dp_rank, tp_rank = root["dp"].get_local_rank(), root["tp"].get_local_rank()
    torch.manual_seed(0)
    model = Transformer(ARGS)
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    _shard_tp_fsdp(model, root["dp"], same_dim=same_dim)
    seen = []
    for name, p in model.named_parameters():
        want = reference[name]
        assert isinstance(p, DTensor), name
        assert p.device_mesh == root, (name, p.device_mesh)
        torch.testing.assert_close(p.full_tensor(), want, rtol=0, atol=0, msg=name)
        dp_placement, tp_placement = p.placements
        # What TP gave this rank, then our dp chunk of that.
        tp_dims = [tp_placement.dim] if isinstance(tp_placement, Shard) else []
        tp_local = chunk_piece(want, 2, tp_dims[0], tp_rank) if tp_dims else want
        free = [d for d in range(want.dim()) if d not in tp_dims]
        fsdp_dim = 0 if same_dim or not free else free[0]
        expected_local = chunk_piece(tp_local, 2, fsdp_dim, dp_rank)
        torch.testing.assert_close(p.to_local(), expected_local, rtol=0, atol=0, msg=name)
        if fsdp_dim in tp_dims:
            assert type(dp_placement).__name__ == "_StridedShard", (name, p.placements)
        else:
            assert dp_placement == Shard(fsdp_dim), (name, p.placements)
        seen.append(f"{name}: {p.placements}")
    return seen


@pytest.mark.parametrize("same_dim", [pytest.param(False, id="free-dim"), SAME_DIM])
def test_tp_fsdp_placement_and_full_tensor_of_every_parameter(same_dim: bool) -> None:
    seen = run_distributed(_tp_fsdp_layout, 4, same_dim)[0]
    assert len(seen) == len(dict(Transformer(ARGS).named_parameters()))


# -- checkpoints: TP+FSDP at W=4 -> FSDP at W=2 -> unsharded at W=1 -------------------------

# In the suite one step before the save (the checkpoint then holds AdamW's step count and
# both moments) and two after the load: the first shows the loaded parameters and optimizer
# state, the second a step taken from them. FULLY_SHARD_FULL_MATRIX=1: 2 and 3.
SAVE_AFTER, CONTINUE = (2, 3) if FULL_MATRIX else (1, 2)


def _batches() -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [make_batch(4, gen) for _ in range(SAVE_AFTER + CONTINUE)]


def _train(
    model: nn.Module, optim: torch.optim.Optimizer, steps: range, dp_rank: int, dp_size: int
) -> list[float]:
    """Train on the global batches of ``steps``; return the global mean loss of each."""
    batches = _batches()[steps.start : steps.stop]  # steps: a range of step numbers
    group = mesh_group(dp_size) if dp_size > 1 else None  # the dp ranks: TP peers see the same
    return train_on_rank_rows(model, optim, batches, dp_rank, dp_size, ranks=dp_size, group=group)


def mesh_group(dp_size: int) -> dist.ProcessGroup:
    return _root()["dp"].get_group() if dist.get_world_size() == 4 else mesh_1d().get_group()


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _save_tp_fsdp(path: str, same_dim: bool) -> list[float]:
    root = _root()
    torch.manual_seed(0)
    model = Transformer(ARGS)
    _shard_tp_fsdp(model, root["dp"], same_dim=same_dim)
    optim = _optimizer(model)
    dp_rank = root["dp"].get_local_rank()
    _train(model, optim, range(SAVE_AFTER), dp_rank, 2)
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return _train(model, optim, range(SAVE_AFTER, SAVE_AFTER + CONTINUE), dp_rank, 2)


def _load_and_continue(path: str) -> list[float]:
    world = dist.get_world_size()
    torch.manual_seed(123)  # other initial values: a load that does nothing shows
    model = Transformer(ARGS)
    if world > 1:
        wrap_layers_then_root(fully_shard)(model, mesh_1d())
    optim = _optimizer(model)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rank = dist.get_rank()
    return _train(model, optim, range(SAVE_AFTER, SAVE_AFTER + CONTINUE), rank, world)


@pytest.mark.parametrize("same_dim", [pytest.param(False, id="free-dim"), SAME_DIM])
def test_dcp_tp_fsdp_at_4_loads_into_fsdp_at_2_and_unsharded_at_1(
    tmp_path: Path, same_dim: bool
) -> None:
    path = str(tmp_path / "ckpt")
    want = run_distributed(_save_tp_fsdp, 4, path, same_dim)[0]
    for world in (2, 1):
        for got in run_distributed(_load_and_continue, world, path):
            assert got == pytest.approx(want, abs=1e-5, rel=1e-5), (world, got, want)


# -- validation: bad 2-D compositions raise before anything changes -------------------------


class _Pair(nn.Module):
    def __init__(self, hidden: int = 6) -> None:
        super().__init__()
        self.a = nn.Linear(4, hidden, bias=False)
        self.b = nn.Linear(hidden, 4, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))  # type: ignore[no-any-return]


def _tp_pair(mesh_a: DeviceMesh, mesh_b: DeviceMesh, hidden: int = 6) -> _Pair:
    """``a`` column-parallel on ``mesh_a``, ``b`` row-parallel on ``mesh_b``."""
    torch.manual_seed(0)
    pair = _Pair(hidden)
    parallelize_module(pair.a, mesh_a, ColwiseParallel())
    parallelize_module(pair.b, mesh_b, RowwiseParallel())
    return pair


def _bad_2d_case(name: str) -> str:
    root = _root()
    other = device_mesh((2, 2), ("x", "y"))  # a second 2-D mesh over the same ranks
    if name == "tp mesh along the dp dim of another mesh":
        # other["x"] groups the ranks as root["dp"] does: the two meshes share a dim (another
        # mesh's other["y"] groups them as root["tp"] and composes: test_titan_meshes)
        pair, mesh, error = _tp_pair(other["x"], other["x"]), root["dp"], FullyShardValueError
        words: tuple[str, ...] = ("'a.weight'", "does not compose", "different dims")
        if not can_concatenate_meshes():  # torch 2.6 composes named slices of one mesh only
            error, words = FullyShardNotImplementedError, ("'a.weight'", "2.13", "root[")
    elif name == "mesh without the dp dim (unnamed 1-D)":
        pair, mesh, error = _tp_pair(root["tp"], root["tp"]), mesh_1d(), FullyShardValueError
        words = ("'a.weight'", "need mesh_dim_names", "init_device_mesh")
    elif name == "the whole 2-D parent instead of its dp dim":
        # Read as HSDP (replicate=dp, shard=tp): its shard dim is the parameters' TP dim.
        pair, mesh = _tp_pair(root["tp"], root["tp"]), root
        error, words = FullyShardValueError, ("'a.weight'", "same dims", 'root["dp"]')
    elif name == "parameters on different meshes in one group":
        pair, mesh, error = _tp_pair(root["tp"], other["y"]), root["dp"], FullyShardValueError
        words = ("different meshes", "'a.weight'", "'b.weight'", "separate")
    else:
        raise ValueError(name)
    before = snapshot(pair)
    with pytest.raises(error) as info:
        fully_shard(pair, mesh=mesh)
    assert_same(before, snapshot(pair))
    for word in words:
        assert word in str(info.value), (name, word, str(info.value))
    # The same module, with its TP parameters repaired where needed, shards and trains.
    if name in (
        "tp mesh along the dp dim of another mesh",
        "parameters on different meshes in one group",
    ):
        pair = _tp_pair(root["tp"], root["tp"])
    fully_shard(pair, mesh=root["dp"])
    pair(torch.randn(3, 4)).sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in pair.parameters())
    return str(info.value)


@pytest.mark.parametrize(
    "name",
    [
        "tp mesh along the dp dim of another mesh",
        "mesh without the dp dim (unnamed 1-D)",
        "the whole 2-D parent instead of its dp dim",
        "parameters on different meshes in one group",
    ],
)
def test_bad_2d_composition_is_rejected_and_leaves_the_module_unchanged(name: str) -> None:
    run_distributed(_bad_2d_case, 4, name)


def _strided_split_on_a_torch_without_uneven_support() -> str:
    # torch 2.6's _StridedShard asserts an even split; 2.13's does not. The probe is patched to
    # answer "no" so that this torch (2.13 in CI) runs the refusal as 2.6 would.
    root = _root()
    pair = _tp_pair(root["tp"], root["tp"])  # a.weight (6, 4): TP rows 3 + 3, then dp: uneven
    before = snapshot(pair)
    with mock.patch("fully_shard.spmd.strided_shard_handles_uneven", return_value=False):
        with pytest.raises(FullyShardNotImplementedError) as info:
            fully_shard(pair, mesh=root["dp"], shard_placement_fn=_same_dim)
        assert_same(before, snapshot(pair))
        # Shapes that split evenly (8 rows into 2 x 2 pieces) need no uneven support.
        even = _tp_pair(root["tp"], root["tp"], hidden=8)
        fully_shard(even, mesh=root["dp"], shard_placement_fn=_same_dim)
    if strided_shard_handles_uneven():  # this torch: the refused module shards as it is
        fully_shard(pair, mesh=root["dp"], shard_placement_fn=_same_dim)
        pair(torch.randn(3, 4)).sum().backward()
        assert all(isinstance(p.grad, DTensor) for p in pair.parameters())
    return str(info.value)


def test_uneven_strided_split_is_refused_where_torch_cannot_describe_it() -> None:
    message = run_distributed(_strided_split_on_a_torch_without_uneven_support, 4)[0]
    for word in ("'a.weight'", "(6, 4)", "dim 0", "4 uneven pieces", "Shard(d)", "2.13"):
        assert word in message, (word, message)
