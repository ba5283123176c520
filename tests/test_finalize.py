"""torch 2.15's step control: manual backward finalization, ``reduce_dtype`` gradients kept
without sync, and unsharded storage kept across reshards.

Each case trains a small model (two blocks sharded, then the root, whose float inputs need no
gradient, so its backward never ends inside a backward call) on W = 2 gloo ranks beside an
unsharded replica that runs the same rows on every rank; the replica's gradients, averaged
over the ranks with an all-reduce, are what the reduce-scatter must give. Every step compares
every parameter's gradient (``full_tensor()``), then both take the same SGD step.

- manual finalization: two microbatches per step, the second backpropagated in two backward
  calls (``retain_graph``), then ``finalize_backward(async_op=True)`` and its handle's
  ``wait()``; once with gradient sync on (the blocks reduce in every backward, the root once
  at finalize) and once driven as torch 2.15's ``PipelineStage`` drives a sharded stage:
  ``set_manual_backward_finalization(True)`` before each forward, sync off and no reshard
  after backward for the microbatches, then sync on, ``finalize_backward(async_op=True)``,
  ``wait()`` and manual finalization off (one reduce-scatter per group per step). torch 2.15's
  ``stage.py`` itself is not installed here: the sequence is the one its source is described
  to make (torchtitan's review of its #5025), not a run of it.
- ``reduce_dtype`` without sync: bf16 compute, fp32 ``reduce_dtype``, three microbatches of
  which the first two keep their gradients: the kept sum is fp32, as the unsharded
  parameter's ``grad_dtype``; the replica (bf16 with ``grad_dtype`` fp32) accumulates alike.
- ``set_keep_unsharded_storage(True)``: the unsharded parameters' data pointers are the same
  in every forward, and the storage stays allocated while the sharded DTensors are shown.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fully_shard import CountingComm, FullyShardStateError, MixedPrecisionPolicy, fully_shard
from harness import mesh_1d, run_distributed

DIM, ROWS, LR = 6, 4, 0.1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # type: ignore[no-any-return]


def _build(**options: Any) -> tuple[Net, Net, CountingComm]:
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh_1d(), **options)
    fully_shard(model, mesh=mesh_1d(), **options)
    comm = CountingComm()
    model.set_comm(comm)  # type: ignore[operator]
    return model, reference, comm


def _microbatches(step: int, n: int) -> list[torch.Tensor]:
    """This rank's ``n`` microbatches of step ``step`` (the replica runs the same rows)."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(dist.get_world_size(), n, ROWS, DIM, generator=gen)
    return list(x[dist.get_rank()])


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _compare_and_step(model: nn.Module, reference: nn.Module) -> float:
    """Max |grad - replica's rank-averaged grad| over every parameter; then SGD on both."""
    worst = 0.0
    for name, p in model.named_parameters():
        ref = reference.get_parameter(name)
        assert p.grad is not None and ref.grad is not None, name
        avg = ref.grad.float()
        dist.all_reduce(avg)
        avg /= dist.get_world_size()
        worst = max(worst, (p.grad.full_tensor() - avg).abs().max().item())  # type: ignore[attr-defined]
        with torch.no_grad():
            p.add_(p.grad, alpha=-LR)
            ref.copy_(p.full_tensor().to(ref.dtype))  # type: ignore[attr-defined]
        p.grad, ref.grad = None, None
    return worst


def _reduce_scatters(comm: CountingComm) -> int:
    n = sum(r.op == "reduce_scatter" for r in comm.records)
    comm.records.clear()
    return n


def _manual(pattern: str) -> dict[str, Any]:
    model, reference, comm = _build()
    out: dict[str, Any] = {"diffs": [], "reduce_scatters": []}
    try:
        model.finalize_backward()  # type: ignore[operator]
    except FullyShardStateError as e:
        out["refused"] = str(e)
    model.set_manual_backward_finalization(True)  # type: ignore[operator]
    for step in range(2):
        first, second = _microbatches(step, 2)
        if pattern == "pipeline":  # what torch 2.15's stage does around each microbatch
            model.set_requires_gradient_sync(False)  # type: ignore[operator]
            model.set_reshard_after_backward(False)  # type: ignore[operator]
        model.set_manual_backward_finalization(True)  # type: ignore[operator]
        _loss(model(first)).backward()
        _loss(reference(first)).backward()
        model.set_manual_backward_finalization(True)  # type: ignore[operator]
        y, ref_y = model(second), reference(second)
        # several backward calls through one forward of every layer
        _loss(y[:1]).backward(retain_graph=True)
        _loss(y[1:]).backward()
        _loss(ref_y[:1]).backward(retain_graph=True)
        _loss(ref_y[1:]).backward()
        if pattern == "pipeline":  # the stage's gradient reduction
            model.set_requires_gradient_sync(True)  # type: ignore[operator]
            model.set_reshard_after_backward(True)  # type: ignore[operator]
        handle = model.finalize_backward(async_op=True)  # type: ignore[operator]
        handle.wait()
        if pattern == "pipeline":
            model.set_manual_backward_finalization(False)  # type: ignore[operator]
        out["reduce_scatters"].append(_reduce_scatters(comm))
        out["diffs"].append(_compare_and_step(model, reference))
    out["sharded_after"] = all(
        g.state.name == "SHARDED" for m in (model, *model.layers) for g in m._fsdp_state.groups
    )
    return out


@pytest.mark.parametrize("pattern", ["sync_on", "pipeline"])
def test_manual_finalization_with_several_backwards_and_an_async_handle(pattern: str) -> None:
    for got in run_distributed(_manual, 2, pattern):
        assert "set_manual_backward_finalization(True)" in got["refused"]
        assert max(got["diffs"]) < 1e-6, got["diffs"]
        assert got["sharded_after"]
        # sync on: layers.1 reduces in each of the 3 backward calls; layers.0 and the root,
        # whose inputs need no gradient (their backward never ends inside a call), keep
        # accumulating on the unsharded parameters and reduce once, at finalize. The
        # pipeline's way: one reduce-scatter per group per step.
        assert got["reduce_scatters"] == ([5, 5] if pattern == "sync_on" else [3, 3])


def _reduce_dtype_without_sync() -> dict[str, Any]:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, reference, comm = _build(mp_policy=mp)
    reference.to(torch.bfloat16)
    for p in reference.parameters():
        p.grad_dtype = torch.float32  # the replica accumulates as torch 2.15's FSDP does
    kept: list[str] = []
    diffs = []
    for step in range(2):
        for i, x in enumerate(_microbatches(step, 3)):
            model.set_requires_gradient_sync(i == 2)  # type: ignore[operator]
            _loss(model(x)).backward()
            _loss(reference(x.to(torch.bfloat16))).backward()
            if i == 1:
                for p in model.layers[0]._fsdp_state.params:
                    grad = p.unsharded_accumulated_grad
                    kept.append(f"{grad.dtype}/{p.unsharded_param.grad_dtype}")
        diffs.append(_compare_and_step(model, reference))
    return {"kept": kept, "diffs": diffs, "reduce_scatters": _reduce_scatters(comm)}


def test_gradients_accumulate_in_reduce_dtype_without_sync() -> None:
    for got in run_distributed(_reduce_dtype_without_sync, 2):
        assert set(got["kept"]) == {"torch.float32/torch.float32"}, got["kept"]
        assert max(got["diffs"]) < 1e-6, got["diffs"]
        assert got["reduce_scatters"] == 2 * 3  # once per group per step


def _keep_storage() -> dict[str, Any]:
    model, reference, _ = _build()
    model.set_keep_unsharded_storage(True)  # type: ignore[operator]
    seen: list[tuple[int, ...]] = []
    block = model.layers[0]
    block.register_forward_hook(
        lambda m, args, out: seen.append(tuple(p.data_ptr() for p in m.parameters()))
    )
    diffs = []
    for step in range(3):
        (x,) = _microbatches(step, 1)
        _loss(model(x)).backward()
        _loss(reference(x)).backward()
        diffs.append(_compare_and_step(model, reference))
    params = block._fsdp_state.params
    kept = all(p.storage_allocated() for p in params)
    shows_shards = all(isinstance(p, torch.distributed.tensor.DTensor) for p in block.parameters())
    block.set_keep_unsharded_storage(False)  # type: ignore[operator]
    block.reshard()  # type: ignore[operator]
    model(x)  # gathered and resharded once more: now freed
    freed = not any(p.storage_allocated() for p in params)
    return {"seen": seen, "diffs": diffs, "kept": kept, "shards": shows_shards, "freed": freed}


def test_keep_unsharded_storage_keeps_addresses_across_reshards() -> None:
    for got in run_distributed(_keep_storage, 2):
        assert len(set(got["seen"])) == 1, got["seen"]  # same addresses in every forward
        assert max(got["diffs"]) < 1e-6, got["diffs"]
        assert got["kept"] and got["shards"] and got["freed"]
