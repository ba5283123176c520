"""Activation checkpointing inside sharded blocks (non-reentrant ``torch.utils.checkpoint``).

    torchrun --standalone --nproc-per-node 2 examples/activation_checkpointing.py

Each block's forward runs under ``checkpoint``, *inside* the block's ``fully_shard`` hooks:
forward keeps only the block's input; backward gathers the block's parameters again (as it
does anyway) and recomputes the block on them before computing its gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from toy import ToyLM, batch, log, loss_fn

from fully_shard import CountingComm, fully_shard, init_distributed


class Checkpointed(nn.Module):
    """Runs ``block`` under non-reentrant activation checkpointing."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.block, *args, use_reentrant=False)


def main() -> None:
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    mesh = job.mesh
    torch.manual_seed(0)
    model = ToyLM().to(job.device)
    for i, block in enumerate(model.layers):
        model.layers[i] = Checkpointed(block)  # checkpoint first ...
    for block in model.layers:
        fully_shard(block, mesh=mesh)  # ... then shard the wrapper: AC sits inside the hooks
    fully_shard(model, mesh=mesh)
    comm = CountingComm()
    model.set_comm(comm)

    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        tokens, targets = batch(step, device=job.device)
        loss = loss_fn(model(tokens), targets)
        comm.reset()
        loss.backward()
        gathers = comm.count_by_op()["all_gather"]
        optim.step()
        optim.zero_grad()
        log(f"step {step}: loss {loss.item():.4f}, {gathers} all-gathers in backward")
        if gathers != len(model.layers):  # each block once, for recompute and gradients
            raise RuntimeError(f"expected {len(model.layers)} all-gathers, got {gathers}")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
