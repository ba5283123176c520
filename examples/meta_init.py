"""Meta-device initialisation: build without memory, shard, then allocate only the shards.

torchrun --standalone --nproc-per-node 2 examples/meta_init.py
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from toy import ToyLM, batch, log, loss_fn

from fully_shard import fully_shard, init_distributed


def main() -> None:
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    mesh = job.mesh

    with torch.device("meta"):  # no storage: a model of any size builds instantly
        model = ToyLM()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the shards are meta tensors too, still no storage

    model.to_empty(device=job.device)  # allocate this rank's shards only
    torch.manual_seed(0)
    model.reset_parameters()  # initialise them in place; each rank fills its own rows

    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device.type == job.device.type, name
        assert bool(torch.isfinite(p.to_local()).all()), name  # to_empty() leaves garbage
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    log(f"this rank holds {local} of {total} parameter elements")

    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        tokens, targets = batch(step, device=job.device)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        log(f"step {step}: loss {loss.item():.4f}")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
