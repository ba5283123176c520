"""Small parameters kept whole: ``fully_shard(..., param_persistence_threshold=n)``.

torchrun --standalone --nproc-per-node 2 examples/persistent_params.py [--threshold 1024]

The toy model sharded twice, one group per block, the embedding and the head, then the root
(which is left with the final LayerNorm only). With a threshold of 1024 elements every norm
weight and bias (32 or 128 elements) stays whole on every rank as a ``Replicate`` DTensor:
never gathered, its gradient summed with all the others in one all-reduce per step. The
root group then holds nothing to shard and issues no collective of its own; the blocks
gather and reduce-scatter only their weight matrices. Both models train to the same numbers.
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed.tensor import Replicate
from toy import ToyLM, batch, log, loss_fn

from fully_shard import CountingComm, fully_shard, init_distributed


def build(mesh: object, device: torch.device, threshold: int | None) -> ToyLM:
    torch.manual_seed(0)
    model = ToyLM().to(device)
    for module in (*model.layers, model.embed, model.head, model):
        fully_shard(module, mesh=mesh, param_persistence_threshold=threshold)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threshold", type=int, default=1024, help="elements; below: whole")
    args = parser.parse_args()
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    counts, params = {}, {}
    for threshold in (None, args.threshold):
        model = build(job.mesh, job.device, threshold)
        comm = CountingComm()  # only to show what is communicated; not needed for training
        model.set_comm(comm)  # type: ignore[operator]
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            comm.reset()
            tokens, targets = batch(step, device=job.device)
            loss_fn(model(tokens), targets).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # Replicate counted once
            optim.step()
            optim.zero_grad()
        counts[threshold] = comm.count_by_op()
        params[threshold] = [p.full_tensor() for p in model.parameters()]
        log(f"param_persistence_threshold={threshold}: {counts[threshold]} per step")
    whole = [n for n, p in model.named_parameters() if p.placements == (Replicate(),)]
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(params[None], params[args.threshold], strict=True)
    )
    log(f"kept whole: {len(whole)} parameters (e.g. {whole[0]}), "
        f"{counts[args.threshold].get('all_reduce', 0)} all-reduce per step for their "
        f"gradients; max |kept - sharded| = {diff:.1e}")  # fmt: skip
    # The same sums in another order (an all-reduce instead of a reduce-scatter): rounding.
    if diff > 1e-5 or counts[args.threshold].get("all_reduce") != 1:
        raise RuntimeError("keeping parameters whole must change the collectives, not the numbers")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
