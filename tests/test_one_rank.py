"""One shard rank: no collective, no copy, the shard's storage used directly where safe.

A group whose shard dim has one rank (W = 1, or HSDP with shard size 1) gathers nothing: a
plain parameter in its own dtype on the compute device computes on its shard's storage
(``storage.WholeShard``), one that needs a cast (bf16 compute) is copied locally, and the
reduce-scatter of one rank is its input. Checked against an unsharded model (every step's
loss and gradients, the final parameters), against torch's ``fully_shard`` at W = 1, and by
counting what the engine issues.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from fully_shard import CountingComm, MixedPrecisionPolicy, fully_shard
from harness import mesh_1d, run_distributed
from models import ModelArgs, Transformer
from parity import check_parity, make_token_batch, wrap_layers_then_root

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _shard_and_count(model: torch.nn.Module, mesh: Any, counter: CountingComm, **opts: Any) -> None:
    wrap_layers_then_root(fully_shard, **opts)(model, mesh)
    model.set_comm(counter)  # type: ignore[operator]


def _one_rank(mixed: bool, hsdp: bool) -> dict[str, Any]:
    import torch.distributed as dist

    counter = CountingComm()
    opts = {"mp_policy": BF16} if mixed else {}
    mesh = (
        init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
        if hsdp
        else mesh_1d()
    )
    stats = None
    if not mixed:  # bf16 compute is compared with torch's below, not with fp32
        stats = check_parity(
            functools.partial(Transformer, ModelArgs()),
            functools.partial(_shard_and_count, counter=counter),
            make_token_batch,
            mesh,
            steps=3,
        )
    else:  # two steps of bf16 training, to count what they issue
        model = Transformer(ModelArgs())
        _shard_and_count(model, mesh, counter, **opts)
        for step in range(2):
            tokens, _ = make_token_batch(2, torch.Generator().manual_seed(step))
            model(tokens).float().sum().backward()
        assert counter.records == [] or hsdp
    # What forward computes with: the shard's own bytes, or a copy.
    torch.manual_seed(0)
    probe = Transformer(ModelArgs())
    wrap_layers_then_root(fully_shard, **opts)(probe, mesh)
    block = probe.layers[0]
    block.unshard()  # type: ignore[operator]
    shared = []
    for p in block._fsdp_state.params:  # type: ignore[union-attr]
        assert p.unsharded_param is not None
        shared.append(
            p.unsharded_param.untyped_storage().data_ptr()
            == p.local_shard.untyped_storage().data_ptr()
        )
    return {"ops": sorted({r.op for r in counter.records}), "shared": shared, "stats": stats}


@pytest.mark.parametrize(
    ("world", "hsdp", "mixed"), [(1, False, False), (1, False, True), (2, True, False)]
)
def test_one_shard_rank_issues_no_gather_and_trains_like_unsharded(
    world: int, hsdp: bool, mixed: bool
) -> None:
    for got in run_distributed(functools.partial(_one_rank, mixed, hsdp), world):
        # HSDP (2, 1): only the replicas' all-reduce; W = 1: nothing at all.
        assert got["ops"] == (["all_reduce"] if hsdp else [])
        assert got["shared"] and all(s == (not mixed) for s in got["shared"])
        assert got["stats"] is None or got["stats"]["zero_grad_params"] == []


def _train(impl: str, mixed: bool) -> list[float]:
    if impl == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
        from torch.distributed.fsdp import fully_shard as shard

        opts: dict[str, Any] = {"mp_policy": TorchMP(torch.bfloat16, torch.float32)}
    else:
        shard, opts = fully_shard, {"mp_policy": BF16}
    torch.manual_seed(0)
    model = Transformer(ModelArgs())
    wrap_layers_then_root(shard, **(opts if mixed else {}))(model, mesh_1d())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(3):
        tokens, targets = make_token_batch(2, torch.Generator().manual_seed(step))
        loss = torch.nn.functional.cross_entropy(
            model(tokens).float().flatten(0, 1), targets.flatten()
        )
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mixed", [False, True])
def test_one_rank_matches_torch(mixed: bool) -> None:
    got = run_distributed(functools.partial(_both, mixed), 1)
    assert got[0]["ours"] == pytest.approx(got[0]["torch"], abs=1e-6)


def _both(mixed: bool) -> dict[str, list[float]]:
    return {impl: _train(impl, mixed) for impl in ("ours", "torch")}
