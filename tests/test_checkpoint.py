"""state_dict and torch.distributed.checkpoint: DTensor state that reshards across world sizes.

Save a sharded, trained model (and its AdamW state) with ``dcp.save`` at W = 2, load it at
W = 1 and W = 3 with a different sharding, and get identical full parameters and optimizer
state back. ``model.state_dict()`` round trips in place, and the full state dict of
``get_model_state_dict`` equals the unsharded tensors.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference, in tests only
from torch.distributed.tensor import DTensor

from fully_shard import fully_shard
from harness import mesh_1d, run_distributed
from parity import needs_torch_fsdp2_on_cpu

DIMS = [7, 13, 1, 5, 3]


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in itertools.pairwise(DIMS)]
    )


def _shard(model: nn.Module, impl: str = "ours") -> nn.Module:
    """Every block, then the root, with ours or (``impl="torch"``) torch's FSDP2."""
    shard = fully_shard if impl == "ours" else torch_fully_shard
    mesh = mesh_1d()
    for block in model:
        shard(block, mesh=mesh)
    return shard(model, mesh=mesh)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _optim_full(optim: torch.optim.Optimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        for key, value in optim.state[p].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out[f"{name}.{key}"] = _full(value)
    return out


def _train_and_save(
    path: str, impl: str = "ours"
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = _shard(_build(), impl)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(4, DIMS[0], generator=gen)).square().mean().backward()
        optim.step()
        optim.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return (
        {n: _full(p) for n, p in model.named_parameters()},
        _optim_full(optim, model),
    )


def _load(
    path: str, sharded: bool, impl: str = "ours"
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = _build()
    # Different values than the checkpoint, so a load that does nothing fails the comparison.
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-1.0)
    if sharded:
        _shard(model, impl)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # One step so the optimizer has state tensors for DCP to load into.
    model(torch.randn(2, DIMS[0])).sum().backward()
    optim.step()
    optim.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {n: _full(p) for n, p in model.named_parameters()}, _optim_full(optim, model)


def _assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("load_world", "sharded"), [(1, False), (1, True), (3, True)])
def test_dcp_save_at_2_load_elsewhere(tmp_path: Path, load_world: int, sharded: bool) -> None:
    path = str(tmp_path / "ckpt")
    saved_params, saved_optim = run_distributed(_train_and_save, 2, path)[0]
    for params, optim_state in run_distributed(_load, load_world, path, sharded):
        _assert_identical(params, saved_params)
        _assert_identical(optim_state, saved_optim)


@needs_torch_fsdp2_on_cpu
@pytest.mark.parametrize(
    ("saver", "loader", "load_world"),
    [("torch", "ours", 2), ("torch", "ours", 3), ("ours", "torch", 2)],
)
def test_dcp_between_torch_fsdp2_and_ours(
    tmp_path: Path, saver: str, loader: str, load_world: int
) -> None:
    """A checkpoint of torch's FSDP2 loads into ours, and ours into FSDP2: same keys, same
    Shard(0) DTensors, so the full parameters and AdamW moments come back bit for bit."""
    path = str(tmp_path / "ckpt")
    saved_params, saved_optim = run_distributed(_train_and_save, 2, path, saver)[0]
    for params, optim_state in run_distributed(_load, load_world, path, True, loader):
        _assert_identical(params, saved_params)
        _assert_identical(optim_state, saved_optim)


def _state_dict_round_trip() -> None:
    model = _shard(_build())
    reference = _build()
    sd = model.state_dict()
    assert sd.keys() == reference.state_dict().keys()
    assert all(isinstance(v, DTensor) for v in sd.values())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=0)
    # load_state_dict with DTensor values copies into the shards in place
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(_shard(_build()).state_dict())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), reference.get_parameter(name))
    # a full (plain tensor) state dict loads through set_model_state_dict
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    set_model_state_dict(
        model, reference.state_dict(), options=StateDictOptions(full_state_dict=True)
    )
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), reference.get_parameter(name))


@pytest.mark.parametrize("world", [2, 3])
def test_state_dict_round_trip(world: int) -> None:
    run_distributed(_state_dict_round_trip, world)


def _pretrained_from_rank0() -> dict[str, float]:
    # The checkpoint, "loaded normally" into the unsharded reference on every rank; only rank 0
    # passes it on. The sharded model is built on meta and never holds the full tensors.
    reference = _build()
    full = reference.state_dict() if torch.distributed.get_rank() == 0 else {}
    with torch.device("meta"):
        model = _shard(_build())
    model.to_empty(device="cpu")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    gen = torch.Generator().manual_seed(1)  # the same batch on every rank
    x, y = torch.randn(4, DIMS[0], generator=gen), torch.randn(4, DIMS[-1], generator=gen)
    diffs = {"output": (model(x) - reference(x)).abs().max().item()}
    for m in (model, reference):  # one AdamW step on the same batch
        optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
        nn.functional.mse_loss(m(x), y).backward()
        optim.step()
    diffs["params"] = max(
        (_full(p) - reference.get_parameter(name)).abs().max().item()
        for name, p in model.named_parameters()
    )
    return diffs


def test_pretrained_weights_broadcast_from_rank0_into_a_meta_built_model() -> None:
    """docs/recipes/hugging-face.md's loading path on uneven shards (13 rows over 2 ranks)."""
    for diffs in run_distributed(_pretrained_from_rank0, 2):
        assert diffs["output"] <= 1e-6 and diffs["params"] <= 1e-6, diffs
