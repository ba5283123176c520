"""``state_dict()`` of a sharded model, side by side with torch's ``fully_shard``.

The same Transformer (untied and tied embeddings) is sharded by torch's ``fully_shard`` and
by ours (every block, then the root) on W gloo ranks. Then:

- the state dict keys are the same, and equal the unsharded model's (tied weights under both
  names); every value is a DTensor with torch's placements, local shape and full tensor;
- ``load_state_dict(sd, strict=True)`` of ours into torch's sharded model, and of torch's into
  a fresh one of ours, gives back the same full values; after a forward that keeps the
  root's parameters gathered (and after ``unshard()``) ``state_dict()`` still holds the
  sharded DTensors, as torch's does (both reshard first), and training goes on; both report
  the same missing and unexpected keys for the same partial state dict (``strict=False``)
  and both raise for it with ``strict=True``;
- the full (unsharded) state dict of ``get_model_state_dict(..., full_state_dict=True)`` is
  the same for both and equals the unsharded model's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference, tests only
from torch.distributed.tensor import DTensor

from fully_shard import fully_shard
from harness import mesh_1d, run_distributed
from models import ModelArgs, Transformer
from parity import needs_torch_fsdp2_on_cpu

pytestmark = needs_torch_fsdp2_on_cpu


def _build(tied: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Transformer(ModelArgs(tie_embeddings=tied))


def _shard(model: nn.Module, shard: Callable[..., Any]) -> nn.Module:
    for block in model.get_submodule("layers").children():
        shard(block, mesh=mesh_1d())
    shard(model, mesh=mesh_1d())
    return model


def _full_values(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in sd.items()
    }


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: {sorted(got.keys() ^ want.keys())}"
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=f"{what}: {k}")


def _side_by_side(tied: bool) -> None:
    reference = _build(tied)
    ours = _shard(_build(tied), fully_shard)
    theirs = _shard(_build(tied), torch_fully_shard)
    sd_ours, sd_theirs = ours.state_dict(), theirs.state_dict()
    assert list(sd_ours.keys()) == list(sd_theirs.keys()) == list(reference.state_dict().keys())
    for key, value in sd_ours.items():
        other = sd_theirs[key]
        assert isinstance(value, DTensor) == isinstance(other, DTensor), key
        if isinstance(other, DTensor):
            assert isinstance(value, DTensor)
            assert value.placements == other.placements, key
            assert value.to_local().shape == other.to_local().shape, key
            assert value.shape == other.shape and value.dtype == other.dtype, key
    _same(_full_values(sd_ours), _full_values(reference.state_dict()), "ours vs unsharded")
    _same(_full_values(sd_theirs), _full_values(reference.state_dict()), "torch vs unsharded")

    # Ours -> torch's sharded model (other initial values) -> a fresh one of ours.
    trained = _build(tied, seed=1)  # different values than the models above
    source = _shard(copy.deepcopy(trained), fully_shard)
    theirs.load_state_dict(source.state_dict(), strict=True)
    _same(_full_values(theirs.state_dict()), _full_values(trained.state_dict()), "ours -> torch")
    fresh = _shard(_build(tied), fully_shard)
    fresh.load_state_dict(theirs.state_dict(), strict=True)
    _same(_full_values(fresh.state_dict()), _full_values(trained.state_dict()), "torch -> ours")
    x = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(fresh(x), trained(x), rtol=1e-5, atol=1e-6)
    # The root keeps its parameters gathered after that forward (and after unshard()), yet
    # state_dict() shows the sharded DTensors, as torch's does; training goes on after it.
    for model in (fresh, theirs):
        model(x)
        assert all(isinstance(v, DTensor) for v in model.state_dict().values())
        model.unshard()
        assert all(isinstance(v, DTensor) for v in model.state_dict().values())
    fresh(x).sum().backward()
    trained(x).sum().backward()
    for (name, p), ref in zip(fresh.named_parameters(), trained.parameters(), strict=True):
        assert isinstance(p.grad, DTensor), name
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad, rtol=1e-5, atol=1e-6)
    trained.zero_grad(set_to_none=True)
    fresh.zero_grad(set_to_none=True)

    # A partial state dict: same missing / unexpected keys, both strict loads raise.
    partial = {k: v for k, v in fresh.state_dict().items() if not k.startswith("norm.")}
    partial["extra.weight"] = torch.zeros(1)
    for model in (ours, theirs):
        with pytest.raises(RuntimeError, match="Missing key"):
            model.load_state_dict(dict(partial), strict=True)
    got = fresh.load_state_dict(
        {k: v for k, v in partial.items() if k != "extra.weight"}, strict=False
    )
    want = theirs.load_state_dict(
        {k: v for k, v in partial.items() if k != "extra.weight"}, strict=False
    )
    assert sorted(got.missing_keys) == sorted(want.missing_keys) == ["norm.weight"]
    assert got.unexpected_keys == want.unexpected_keys == []

    # Full state dicts through torch.distributed.checkpoint.
    options = StateDictOptions(full_state_dict=True)
    full_ours = get_model_state_dict(fresh, options=options)
    full_theirs = get_model_state_dict(theirs, options=options)
    assert all(not isinstance(v, DTensor) for v in full_ours.values())
    _same(_full_values(full_ours), _full_values(full_theirs), "full: ours vs torch")
    _same(_full_values(full_ours), _full_values(trained.state_dict()), "full: ours vs unsharded")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_state_dict_matches_torchs(world: int, tied: bool) -> None:
    run_distributed(_side_by_side, world, tied, timeout=120)
