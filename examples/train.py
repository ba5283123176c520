"""Per-block wrapping: ``fully_shard`` each block, then the root; train with AdamW.

The quickstart script, and the one the multi-node recipe launches::

    torchrun --standalone --nproc-per-node 2 examples/train.py
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 --rdzv-id job1 examples/train.py    # on each of 2 nodes

Unchanged on GPUs: ``init_distributed()`` gives each process GPU ``LOCAL_RANK`` and NCCL when
the node has a GPU per process (``--nproc-per-node 8`` on 8 GPUs), gloo on the CPU otherwise;
each rank's first line says which.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.distributed.tensor import DTensor
from toy import ToyLM, batch, log, loss_fn

from fully_shard import fully_shard, init_distributed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, ...: on a GPU node each rank takes GPU
    # LOCAL_RANK and NCCL, elsewhere gloo on the CPU; mesh: 1-D over every rank
    job = init_distributed()
    world, mesh = job.world_size, job.mesh
    print(
        f"rank {job.rank}/{world} on node {os.environ.get('GROUP_RANK', '0')} "
        f"(local rank {job.local_rank}): {job.backend} on {job.device}",
        flush=True,
    )

    torch.manual_seed(0)  # the same initial weights on every rank
    model = ToyLM().to(job.device)
    for block in model.layers:
        fully_shard(block, mesh=mesh)  # one all-gather / reduce-scatter group per block
    fully_shard(model, mesh=mesh)  # the root group: embed, norm, head

    w = model.layers[0].up.weight
    assert isinstance(w, DTensor)
    log(f"layers.0.up.weight: global {tuple(w.shape)}, local {tuple(w.to_local().shape)}")

    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(args.steps):
        tokens, targets = batch(step, device=job.device)
        loss = loss_fn(model(tokens), targets)
        loss.backward()  # gradients are reduce-scattered into the sharded .grad
        optim.step()  # AdamW steps on the local shards
        optim.zero_grad()
        log(f"step {step}: loss {loss.item():.4f}")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
