"""A rank that skips a block: with the collective checker on, every rank says so and recovers.

torchrun --standalone --nproc-per-node 2 examples/desync.py

In step 1 the last rank skips ``layers.2``. Without the checker the job would hang (or pair
different collectives of equal size and compute garbage); with it, each rank raises
``FullyShardDesyncError`` at the first collective that differs, before anything is sent, and
names both calls. Here that is in backward: forward prefetching gathers ``layers.2`` on every
rank, but only the others need it again for backward. After ``reset_iter_state()`` step 2
trains normally. Output (rank 0)::

    step 0: loss 4.3408
    step 1: rank 0: collectives diverged on process group ranks [0, 1] at call #21: this rank
    issues #21 all_gather of 'layers.2' (shape [4208], torch.float32); rank 1: #21
    reduce_scatter of 'layers.3' (shape [8416], torch.float32). Nothing was sent. ...
    step 2: loss 4.2315
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from toy import ToyLM, batch, log, loss_fn

from fully_shard import FullyShardDesyncError, debug, fully_shard, init_distributed


def main() -> None:
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    mesh = job.mesh
    torch.manual_seed(0)
    model = ToyLM().to(job.device)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    odd = dist.get_rank() == dist.get_world_size() - 1

    with debug.check_collectives(timeout=10):
        for step in range(3):
            tokens, targets = batch(step, device=job.device)
            try:
                if step == 1 and odd:
                    # Data-dependent control flow that differs on one rank: skip block 2.
                    skipped = model.layers[2]
                    model.layers[2] = torch.nn.Identity()
                    try:
                        loss = loss_fn(model(tokens), targets)
                    finally:
                        model.layers[2] = skipped
                else:
                    loss = loss_fn(model(tokens), targets)
                loss.backward()
            except FullyShardDesyncError as e:
                log(f"step {step}: {e}")
                model.reset_iter_state()  # nothing stays gathered; train on
                optim.zero_grad()
                continue
            optim.step()
            optim.zero_grad()
            log(f"step {step}: loss {loss.item():.4f}")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
