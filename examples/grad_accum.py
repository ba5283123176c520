"""Gradient accumulation: no gradient communication until the last micro-batch.

torchrun --standalone --nproc-per-node 2 examples/grad_accum.py
"""

from __future__ import annotations

import torch
from toy import ToyLM, batch, log, loss_fn

from fully_shard import CountingComm, fully_shard, init_distributed

MICRO_BATCHES = 4


def main() -> None:
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    mesh = job.mesh
    torch.manual_seed(0)
    model = ToyLM().to(job.device)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comm = CountingComm()  # only to show what is communicated; not needed for training
    model.set_comm(comm)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    for step in range(2):
        for micro in range(MICRO_BATCHES):
            last = micro == MICRO_BATCHES - 1
            # Off: keep the full-size gradients locally and add them up (memory: one unsharded
            # gradient per parameter). On: reduce-scatter the sum once, in this backward.
            model.set_requires_gradient_sync(last)
            comm.reset()
            tokens, targets = batch(step * MICRO_BATCHES + micro, device=job.device)
            loss = loss_fn(model(tokens), targets) / MICRO_BATCHES
            loss.backward()
            reduced = comm.count_by_op().get("reduce_scatter", 0)
            log(f"step {step} micro-batch {micro}: {reduced} reduce-scatters")
            if last != (reduced > 0):
                raise RuntimeError(f"micro-batch {micro}: expected reduction only on the last")
        optim.step()
        optim.zero_grad()
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
