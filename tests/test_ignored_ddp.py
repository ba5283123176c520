"""``ignored_params`` handed to another wrapper: the head under DDP, the rest fully sharded.

The model's ``head`` is wrapped in ``DistributedDataParallel`` (gloo) and its parameters are
passed to every ``fully_shard`` call as ``ignored_params`` (one set for the whole wrap, as
torch allows: the blocks' calls skip the parameters they do not hold); the blocks and the
root are sharded. Each step
is compared with an unsharded replica trained on the whole global batch: the loss (mean over
ranks), every gradient (``full_tensor()`` of the sharded ones; DDP has already averaged the
head's) and every parameter, 1e-5. The same scenario runs under torch's ``fully_shard`` and
both implementations' losses and parameters are compared with each other.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference, in tests only
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from fully_shard import fully_shard
from harness import mesh_1d, run_distributed
from parity import ShardFn, needs_torch_fsdp2_on_cpu

IMPLS: dict[str, ShardFn] = {"ours": fully_shard, "torch": torch_fully_shard}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # type: ignore[no-any-return]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _train(impl: str, steps: int) -> list[torch.Tensor]:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    model.head = DistributedDataParallel(model.head)  # type: ignore[assignment]
    mesh = mesh_1d()
    # One set for every call of the bottom-up wrap (torch's test_ddp_A_fsdp_B_ddp_C does the
    # same): the blocks hold none of its parameters, which each call skips.
    ignored = set(model.head.parameters())
    for block in model.layers:
        IMPLS[impl](block, mesh=mesh, ignored_params=ignored)
    IMPLS[impl](model, mesh=mesh, ignored_params=ignored)
    assert all(not isinstance(p, DTensor) for p in model.head.parameters())

    # DDP adds a ".module" level to the head's names; strip it to pair with the reference.
    params = {n.replace("head.module.", "head."): p for n, p in model.named_parameters()}
    ref_params = dict(reference.named_parameters())
    assert params.keys() == ref_params.keys()
    opt = torch.optim.AdamW(params.values(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_params.values(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x, y = torch.randn(world * 2, 6, generator=gen), torch.randn(world * 2, 3, generator=gen)
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        mine = slice(rank * 2, rank * 2 + 2)
        loss = F.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for name, p in params.items():
            assert p.grad is not None, f"step {step}: {name} got no gradient"
            torch.testing.assert_close(
                _full(p.grad), ref_params[name].grad, rtol=1e-5, atol=1e-6, msg=f"{step} {name}"
            )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        losses.append(ref_loss.detach())
    for name, p in params.items():
        torch.testing.assert_close(_full(p), ref_params[name], rtol=1e-5, atol=1e-6, msg=name)
    return [torch.stack(losses)] + [_full(p).clone() for p in params.values()]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_head_beside_fully_shard_at_parity(world_size: int) -> None:
    run_distributed(_train, world_size, "ours", 4)


@needs_torch_fsdp2_on_cpu
def test_ddp_head_side_by_side_with_torch() -> None:
    ours = run_distributed(_train, 2, "ours", 3)
    theirs = run_distributed(_train, 2, "torch", 3)
    for a, b in zip(ours[0], theirs[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
