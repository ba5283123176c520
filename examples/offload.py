"""CPU offload: sharded parameters, gradients and optimizer state live in host memory.

    torchrun --standalone --nproc-per-node 2 examples/offload.py

On GPUs each all-gather copies the shards to the GPU and the reduced gradients come back; the
optimizer steps on the CPU. On a CPU-only machine (as here) it changes nothing.
"""

from __future__ import annotations

import torch
from toy import ToyLM, batch, log, loss_fn

from fully_shard import CPUOffloadPolicy, fully_shard, init_distributed


def main() -> None:
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    mesh = job.mesh
    torch.manual_seed(0)
    model = ToyLM().to(job.device)  # the shards move to the CPU in fully_shard
    offload = CPUOffloadPolicy(pin_memory=True)  # pinned only when CUDA is present
    for block in model.layers:
        fully_shard(block, mesh=mesh, offload_policy=offload)
    fully_shard(model, mesh=mesh, offload_policy=offload)

    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        tokens, targets = batch(step, device=job.device)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        log(f"step {step}: loss {loss.item():.4f}")
    devices = {p.to_local().device.type for p in model.parameters()}
    states = {s["exp_avg"].device.type for s in optim.state.values()}
    log(f"shards on {devices}, optimizer state on {states}")
    if devices != {"cpu"} or states != {"cpu"}:
        raise RuntimeError(f"offloaded state is not on the CPU: {devices}, {states}")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
