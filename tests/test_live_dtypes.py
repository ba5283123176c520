"""Live dtypes: ``model.to(dtype)`` after ``fully_shard`` changes what is gathered and computed.

The sharded parameters (and their DTensor metadata), the gathered copies and the all-gather
all follow the new dtype, because the compute dtype is read at each unshard (the policy's
answer for the sharded dtype of now) and the unsharded storage is reallocated when it changes.
An explicit ``MixedPrecisionPolicy`` dtype is an answer that does not depend on the sharded
dtype, so it is kept.

Scenario (W = 2, AdamW): train in fp32, ``.to(torch.float64)``, train more, next to an
unsharded replica doing the same on the global batch. torch 2.13's own ``fully_shard`` fails
there (its all-gather outputs keep the dtype of the first unshard: "Expected out tensor to
have dtype double, but got float"), so it is compared with ours where it runs: ``.to()``
before the first forward.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from fully_shard import CountingComm, MixedPrecisionPolicy, fully_shard
from harness import mesh_1d, run_distributed
from models import MLPStack
from parity import needs_torch_fsdp2_on_cpu, step_beside_reference

WORLD = 2
DIMS = [6, 9, 5, 3]  # 9 rows: uneven over 2 ranks, so padding is gathered too
LOCAL_ROWS = 2


def _shard(model: nn.Module, impl: str, **options: Any) -> None:
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard as shard_fn
    else:
        shard_fn = fully_shard
    for block in model.layers:  # type: ignore[union-attr]
        shard_fn(block, mesh=mesh_1d(), **options)
    shard_fn(model, mesh=mesh_1d(), **options)


def _batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    rows = WORLD * LOCAL_ROWS
    return (
        torch.randn(rows, DIMS[0], generator=gen).to(dtype),
        torch.randn(rows, DIMS[-1], generator=gen).to(dtype),
    )


def _train_across_to(impl: str, to_at: int, steps: int) -> dict[str, Any]:
    """Train ``steps`` AdamW steps; before step ``to_at`` call ``.to(torch.float64)`` on both
    the sharded model and the reference (and rebuild both optimizers for the new dtype)."""
    torch.manual_seed(0)
    model = MLPStack(DIMS, activation="tanh")
    reference = copy.deepcopy(model)
    _shard(model, impl)
    seen: list[torch.dtype] = []
    model.layers[0].linear.register_forward_pre_hook(  # type: ignore[union-attr, index]
        lambda m, args: seen.append(m.weight.dtype)
    )
    dtype = torch.float32
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for step in range(steps):
        if step == to_at:
            dtype = torch.float64
            model.to(dtype)
            reference.to(dtype)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        loss, ref_loss = step_beside_reference(
            model, opt, reference, ref_opt, _batch(step, dtype), LOCAL_ROWS
        )
        losses.append(loss)
        ref_losses.append(ref_loss)
    params = dict(model.named_parameters())
    return {
        "losses": torch.stack(losses),
        "ref_losses": torch.stack(ref_losses),
        "params": {n: p.full_tensor() for n, p in params.items()},  # type: ignore[attr-defined]
        "ref_params": {n: p.detach() for n, p in reference.named_parameters()},
        "sharded_dtypes": {str(p.dtype) for p in params.values()},
        "local_dtypes": {str(p.to_local().dtype) for p in params.values()},  # type: ignore[attr-defined]
        "gathered_dtypes": [str(d) for d in seen],
    }


def _assert_matches_reference(got: dict[str, Any], atol: float) -> None:
    torch.testing.assert_close(got["losses"], got["ref_losses"], atol=atol, rtol=1e-5)
    for name, ref in got["ref_params"].items():
        torch.testing.assert_close(got["params"][name], ref, atol=atol, rtol=1e-5, msg=name)


def test_to_float64_after_training_follows_everywhere_and_trains_like_the_reference() -> None:
    got = run_distributed(_train_across_to, WORLD, "ours", 1, 4)[0]
    assert got["losses"].dtype == torch.float64
    assert got["sharded_dtypes"] == {"torch.float64"}  # the DTensor metadata
    assert got["local_dtypes"] == {"torch.float64"}  # the local shards
    # what the first block computed with in each step's forward: fp32, then fp64
    assert got["gathered_dtypes"] == ["torch.float32"] + ["torch.float64"] * 3
    _assert_matches_reference(got, atol=1e-6)


@needs_torch_fsdp2_on_cpu
def test_to_float64_before_the_first_forward_matches_torch_fully_shard() -> None:
    ours = run_distributed(_train_across_to, WORLD, "ours", 0, 3)[0]
    ref = run_distributed(_train_across_to, WORLD, "torch", 0, 3)[0]
    assert ours["gathered_dtypes"] == ref["gathered_dtypes"] == ["torch.float64"] * 3
    torch.testing.assert_close(ours["losses"], ref["losses"], atol=1e-12, rtol=1e-12)
    for name, p in ref["params"].items():
        torch.testing.assert_close(ours["params"][name], p, atol=1e-12, rtol=1e-12, msg=name)
    _assert_matches_reference(ours, atol=1e-9)


def _collective_dtypes_across_to(policy: MixedPrecisionPolicy) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MLPStack(DIMS, activation="tanh")
    _shard(model, "ours", mp_policy=policy)
    comm = CountingComm()
    model.set_comm(comm)  # type: ignore[operator]
    out = {}
    for label in ("before", "after"):
        if label == "after":
            model.to(torch.float64)
        comm.reset()
        x, _ = _batch(0, torch.float64 if label == "after" else torch.float32)
        model(x).sum().backward()
        out[label] = {(r.op, str(r.dtype)) for r in comm.records}
        out[label + "_grad"] = {str(p.grad.dtype) for p in model.parameters()}  # type: ignore[union-attr]
    return out


@pytest.mark.parametrize(
    ("policy", "before", "after"),
    [
        # nothing set: everything follows the sharded dtype
        (MixedPrecisionPolicy(), "float32/float32", "float64/float64"),
        # an explicit reduce dtype is kept; the all-gather follows
        (MixedPrecisionPolicy(reduce_dtype=torch.float32), "float32/float32", "float64/float32"),
        # an explicit param dtype is kept (it is also what the reduction defaults to)
        (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16),
            "bfloat16/bfloat16",
            "bfloat16/bfloat16",
        ),
    ],
)
def test_explicit_policy_dtypes_are_kept_across_to(
    policy: MixedPrecisionPolicy, before: str, after: str
) -> None:
    got = run_distributed(_collective_dtypes_across_to, WORLD, policy)[0]
    for label, expected in (("before", before), ("after", after)):
        gather, reduce = (f"torch.{d}" for d in expected.split("/"))
        assert got[label] == {("all_gather", gather), ("reduce_scatter", reduce)}, label
    # the sharded gradients are in the sharded dtype whatever the reduction ran in
    assert got["before_grad"] == {"torch.float32"}
    assert got["after_grad"] == {"torch.float64"}
