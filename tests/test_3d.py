"""HSDP + tensor parallel on a 3-D mesh ``(replicate, shard, tp)``.

``parallelize_module(..., root["tp"])`` first, then ``fully_shard(..., mesh=root["replicate",
"shard"])``, as with torch's fully_shard. At W = 4 every shape with two real dims out of three
runs: (2, 2, 1), (1, 2, 2), (2, 1, 2). Checked against

- an unsharded replica (``check_parity``: loss, every gradient and every parameter over 2
  AdamW steps, a step after a step, 1e-5): (2, 1, 2), where replicate and TP both split, in
  the suite; the shapes with a dim of one rank are test_2d.py's parities on the same model
  with one more dim ((2, 2, 1): its HSDP 2 x 2, (1, 2, 2): its TP + FSDP 2 x 2), so they
  train against the replica only in ``nox -s soak`` (all three shapes, 5 steps); in the suite
  their layouts are checked below and (1, 2, 2) trains on from a checkpoint;
- torch's ``fully_shard`` on the same scenario, here and on the 2-D ``(dp, tp)`` mesh of
  test_2d.py: with ``shard_placement_fn=Shard(0)`` every parameter has torch's placements,
  mesh and local tensor exactly; by default the parameters TP shards on dim 0 are sharded on
  their first free dim instead (documented in docs/recipes/2d-meshes.md), every other one
  matches torch exactly;
- DCP: saved at (2, 1, 2), loaded at (1, 2, 2), into 1-D FSDP at W = 2 and into a plain model
  at W = 1, after which training continues with the losses of the run that saved it (1 step
  before the save and 2 after the load in the suite, 2 and 3 in ``nox -s soak``).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from example_runner import run_example
from fully_shard import fully_shard
from harness import device_mesh, mesh_1d, run_distributed
from matrix import FULL_MATRIX, thinned
from models import ModelArgs, Transformer
from parity import (
    assert_stats_within,
    check_parity,
    make_token_batch,
    needs_torch_fsdp2_on_cpu,
    train_on_rank_rows,
)
from tp_plan import apply_tp, chunk_piece

SHAPES = [(2, 2, 1), (1, 2, 2), (2, 1, 2)]
NAMES = ("replicate", "shard", "tp")

# vocab 34 and ffn_hidden 34: 17 rows per TP rank, split 9 + 8 over two shard ranks (uneven).
ARGS = ModelArgs(vocab_size=34, dim=16, n_layers=2, n_heads=4, ffn_hidden=34, max_seq_len=8)
make_batch = functools.partial(make_token_batch, vocab_size=ARGS.vocab_size, seq_len=6)


def _root(shape: tuple[int, int, int]) -> DeviceMesh:
    return device_mesh(shape, NAMES)


def _shard_dim0(p: nn.Parameter) -> Shard:
    return Shard(0)


def _shard_3d(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    shape: tuple[int, int, int],
    fsdp: Any = fully_shard,
    **options: Any,
) -> None:
    """TP on ``root["tp"]``, then ``fsdp`` (ours or torch's) on each block and the root."""
    assert dp_mesh == _root(shape)["replicate", "shard"]
    _tp_then_fsdp(model, shape, fsdp, **options)


# -- parity against an unsharded replica -----------------------------------------------------


def _parity(shape: tuple[int, int, int]) -> dict[str, Any]:
    dp_mesh = _root(shape)["replicate", "shard"]
    stats = check_parity(
        lambda: Transformer(ARGS),
        functools.partial(_shard_3d, shape=shape),
        make_batch,
        dp_mesh,
        steps=5 if FULL_MATRIX else 2,
    )
    return dict(stats)


# (2, 2, 1) and (1, 2, 2) in nox -s soak only: test_2d.py's HSDP and TP + FSDP parities on a
# 2 x 2 mesh, with a third dim of one rank.
@pytest.mark.parametrize("shape", thinned(SHAPES, [(2, 1, 2)]), ids=lambda s: "x".join(map(str, s)))
def test_hsdp_tp_3d_parity_with_unsharded(shape: tuple[int, int, int]) -> None:
    for stats in run_distributed(_parity, 4, shape, timeout=120):
        assert_stats_within(stats, 1e-5)


# -- placements against torch's fully_shard --------------------------------------------------


LAYOUT_SHAPES = [(2, 2), *SHAPES]  # the 2-D (dp, tp) mesh of test_2d.py, and the 3-D ones


def _meshes(shape: tuple[int, ...]) -> tuple[DeviceMesh, DeviceMesh, tuple[str, ...]]:
    """(root, its data-parallel sub-mesh, its dim names) for a 2-D or a 3-D layout."""
    if len(shape) == 2:
        root = device_mesh(shape, ("dp", "tp"))
        return root, root["dp"], ("dp", "tp")
    root = device_mesh(shape, NAMES)
    return root, root["replicate", "shard"], NAMES


def _tp_then_fsdp(model: nn.Module, shape: tuple[int, ...], fsdp: Any, **options: Any) -> None:
    assert isinstance(model, Transformer)
    root, dp_mesh, _ = _meshes(shape)
    apply_tp(model, root["tp"])
    for block in model.layers:
        fsdp(block, mesh=dp_mesh, **options)
    fsdp(model, mesh=dp_mesh, **options)


def _layouts_vs_torch(shape: tuple[int, ...]) -> dict[bool, list[str]]:
    """Ours with ``shard_placement_fn=Shard(0)`` (key True) and by default (False), each
    against the one torch model (sharded once: both compare with the same layout)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    theirs = Transformer(ARGS)
    want = {n: p.detach().clone() for n, p in theirs.named_parameters()}
    _tp_then_fsdp(theirs, shape, torch_fully_shard)  # torch's default: Shard(0)
    for name, q in theirs.named_parameters():
        assert isinstance(q, DTensor), name
        torch.testing.assert_close(q.full_tensor(), want[name], rtol=0, atol=0, msg=name)
    return {
        same_as_torch: _layout_vs_torch(shape, same_as_torch, theirs, want)
        for same_as_torch in (True, False)
    }


def _layout_vs_torch(
    shape: tuple[int, ...], same_as_torch: bool, theirs: nn.Module, want: dict[str, Tensor]
) -> list[str]:
    root, _, names = _meshes(shape)
    torch.manual_seed(0)
    ours = Transformer(ARGS)  # the values torch's model was built with
    options = {"shard_placement_fn": _shard_dim0} if same_as_torch else {}
    _tp_then_fsdp(ours, shape, fully_shard, **options)
    dp_name = names[-2]
    shard_rank, tp_rank = root[dp_name].get_local_rank(), root["tp"].get_local_rank()
    dp_size, tp_size = shape[-2], shape[-1]
    theirs_params = dict(theirs.named_parameters())
    differing = []
    for name, p in ours.named_parameters():
        q = theirs_params[name]
        assert isinstance(p, DTensor) and isinstance(q, DTensor), name
        assert p.device_mesh.mesh_dim_names == names == q.device_mesh.mesh_dim_names, name
        assert p.device_mesh == q.device_mesh, name
        torch.testing.assert_close(p.full_tensor(), want[name], rtol=0, atol=0, msg=name)
        *rep, dp, tp = p.placements
        assert rep == [Replicate()] * (len(shape) - 2), (name, p.placements)
        assert tp == q.placements[-1], (name, p.placements)
        # TP over one rank splits nothing: then dim 0 is free for us too.
        tp_dim = tp.dim if isinstance(tp, Shard) and tp_size > 1 else None
        if same_as_torch or tp_dim != 0:
            assert p.placements == q.placements, (name, p.placements, q.placements)
            assert torch.equal(p.to_local(), q.to_local()), name
            continue
        # TP shards dim 0: we shard the first dim TP leaves whole, torch strides dim 0.
        differing.append(f"{name}: ours {p.placements}, torch {q.placements}")
        assert p.dim() == 2, (name, p.placements)
        assert dp == Shard(1), (name, p.placements)
        assert type(q.placements[-2]).__name__ == "_StridedShard", (name, q.placements)
        expected = chunk_piece(chunk_piece(want[name], tp_size, 0, tp_rank), dp_size, 1, shard_rank)
        torch.testing.assert_close(p.to_local(), expected, rtol=0, atol=0, msg=name)
        # the same elements, split the other way: torch's rows of TP's rows
        theirs_local = chunk_piece(
            chunk_piece(want[name], tp_size, 0, tp_rank), dp_size, 0, shard_rank
        )
        torch.testing.assert_close(q.to_local(), theirs_local, rtol=0, atol=0, msg=name)
    return differing


# Both placement choices in one job per shape: torch's model is built and sharded once for both.
@needs_torch_fsdp2_on_cpu
@pytest.mark.parametrize("shape", LAYOUT_SHAPES, ids=["x".join(map(str, s)) for s in LAYOUT_SHAPES])
def test_tp_fsdp_placements_and_local_shards_match_torch(shape: tuple[int, ...]) -> None:
    differing = run_distributed(_layouts_vs_torch, 4, shape)[0]
    # shard_placement_fn=Shard(0): every parameter exactly as torch's
    assert differing[True] == []
    # by default, the weights TP shards on dim 0: wq, wk, wv, w1, w3 of each block, the output
    # head (column-parallel) and the embedding (row-parallel over the vocabulary); none when
    # TP runs over one rank
    assert len(differing[False]) == (5 * ARGS.n_layers + 2 if shape[-1] > 1 else 0), differing


# -- checkpoints across layouts --------------------------------------------------------------

# In the suite one step before the save (the checkpoint then holds AdamW's step count and
# both moments) and two after the load: the first shows the loaded parameters and optimizer
# state, the second a step taken from them. FULLY_SHARD_FULL_MATRIX=1: 2 and 3.
SAVE_AFTER, CONTINUE = (2, 3) if FULL_MATRIX else (1, 2)
SAVE_SHAPE, LOAD_SHAPE = (2, 1, 2), (1, 2, 2)


def _batches() -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [make_batch(4, gen) for _ in range(SAVE_AFTER + CONTINUE)]


def _dp_coordinates(shape: tuple[int, int, int] | None) -> tuple[int, int]:
    """(data-parallel ranks, this rank's index among them) for a 3-D layout or a 1-D mesh."""
    if shape is None:
        return dist.get_world_size(), dist.get_rank()
    root = _root(shape)
    shards = shape[1]
    return shape[0] * shards, root["replicate"].get_local_rank() * shards + root[
        "shard"
    ].get_local_rank()


def _train(
    model: nn.Module, optim: torch.optim.Optimizer, steps: range, dp: tuple[int, int]
) -> list[float]:
    """Train on the global batches of ``steps``; return the global mean loss of each."""
    dp_size, dp_rank = dp
    batches = _batches()[steps.start : steps.stop]  # steps: a range of step numbers
    # TP peers hold the same loss: the mean over all ranks is the dp mean
    return train_on_rank_rows(model, optim, batches, dp_rank, dp_size, ranks=dist.get_world_size())


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _save_3d(path: str) -> list[float]:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    _shard_3d(model, _root(SAVE_SHAPE)["replicate", "shard"], shape=SAVE_SHAPE)
    optim = _optimizer(model)
    dp = _dp_coordinates(SAVE_SHAPE)
    _train(model, optim, range(SAVE_AFTER), dp)
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return _train(model, optim, range(SAVE_AFTER, SAVE_AFTER + CONTINUE), dp)


def _load_and_continue(path: str, layout: str) -> list[float]:
    torch.manual_seed(123)  # other initial values: a load that does nothing shows
    model = Transformer(ARGS)
    shape: tuple[int, int, int] | None = None
    if layout == "3-D":
        shape = LOAD_SHAPE
        _shard_3d(model, _root(shape)["replicate", "shard"], shape=shape)
    elif layout == "1-D":
        for block in model.layers:
            fully_shard(block, mesh=mesh_1d())
        fully_shard(model, mesh=mesh_1d())
    optim = _optimizer(model)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _train(model, optim, range(SAVE_AFTER, SAVE_AFTER + CONTINUE), _dp_coordinates(shape))


def test_dcp_3d_loads_into_another_3d_layout_1d_fsdp_and_a_plain_model(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    want = run_distributed(_save_3d, 4, path, timeout=120)[0]
    for layout, world in (("3-D", 4), ("1-D", 2), ("plain", 1)):
        for got in run_distributed(_load_and_continue, world, path, layout, timeout=120):
            assert got == pytest.approx(want, abs=1e-5, rel=1e-5), (layout, got, want)


# -- the example -------------------------------------------------------------------------------


# HSDP x TP in the suite (the 2-D example's tests run FSDP x TP); both in the soak.
@pytest.mark.parametrize(
    "shape", thinned([(2, 1, 2), (1, 2, 2)], [(2, 1, 2)]), ids=lambda s: "x".join(map(str, s))
)
def test_train_llama_3d_example_at_4_ranks(shape: tuple[int, int, int]) -> None:
    """examples/train_llama_3d.py on the warm 4-rank pool (tests/test_docs.py: 2 ranks)."""
    argv = ["--steps", "3" if FULL_MATRIX else "2", "--shape", *map(str, shape)]
    out = run_distributed(run_example, 4, "train_llama_3d.py", argv, timeout=120)[0]
    names = ", ".join(f"{n}={s}" for n, s in zip(NAMES, shape, strict=True))
    mesh_line = next(line for line in out.splitlines() if line.startswith("mesh "))
    if "=" in mesh_line.split("mesh_dim_names")[0]:  # torch 2.13's repr: (name=size, ...)
        assert f"mesh DeviceMesh(({names})" in out, out
    else:  # older releases (2.6) print the rank grid and the names
        grid = ast.literal_eval(mesh_line[mesh_line.index("[") : mesh_line.rindex("]") + 1])
        assert tuple(torch.tensor(grid).shape) == tuple(shape), out
        assert all(f"'{n}'" in mesh_line for n in NAMES), out
    diff = re.search(r"max \|3-D - unsharded\| over all parameters: (\S+)", out)
    assert diff is not None and float(diff.group(1)) <= 1e-5, out
