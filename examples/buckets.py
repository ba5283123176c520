"""Fewer collectives: the groups' all-gathers and reduce-scatters merged into buckets.

torchrun --standalone --nproc-per-node 2 examples/buckets.py

The same model twice, one group per block then the root: without buckets every group issues
its own all-gather (twice for the blocks: forward and backward) and its own reduce-scatter;
with ``set_bucket_cap_mb(25)`` (DDP's default) the whole toy model fits one bucket: one
all-gather in forward, one in backward, one reduce-scatter. Both train to the same numbers
(bit for bit on 2 gloo ranks).
"""

from __future__ import annotations

import torch
from toy import ToyLM, batch, log, loss_fn

from fully_shard import CountingComm, fully_shard, init_distributed


def build(mesh: object, device: torch.device, bucket_cap_mb: float | None) -> ToyLM:
    torch.manual_seed(0)
    model = ToyLM().to(device)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # On the root, for its whole tree; None or 0 turns buckets off again.
    model.set_bucket_cap_mb(bucket_cap_mb)  # type: ignore[operator]
    return model


def main() -> None:
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    counts, params = {}, {}
    for cap in (None, 25):
        model = build(job.mesh, job.device, cap)
        comm = CountingComm()  # only to show what is communicated; not needed for training
        model.set_comm(comm)  # type: ignore[operator]
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            # The first step records the order the groups run in, unbucketed; the buckets
            # are runs of consecutive groups in that order.
            comm.reset()
            tokens, targets = batch(step, device=job.device)
            loss_fn(model(tokens), targets).backward()
            optim.step()
            optim.zero_grad()
        counts[cap] = comm.count_by_op()
        params[cap] = [p.full_tensor() for p in model.parameters()]
        log(f"bucket_cap_mb={cap}: {counts[cap]} per step")
    diff = max((a - b).abs().max().item() for a, b in zip(params[None], params[25], strict=True))
    log(f"buckets: {sum(counts[25].values())} collectives per step instead of "
        f"{sum(counts[None].values())}; max |bucketed - unbucketed| = {diff:.1e}")  # fmt: skip
    # gloo on 2 ranks adds the same two numbers either way (bit for bit); NCCL may pick
    # another algorithm for a larger buffer, so allow rounding
    if diff > 1e-5 or sum(counts[25].values()) != 3:
        raise RuntimeError("buckets must change the collectives, not the numbers")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
