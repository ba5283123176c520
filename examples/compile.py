"""``torch.compile`` with a sharded model, in the order trainers use (``--order``).

    torchrun --standalone --nproc-per-node 2 examples/compile.py                   # inductor
    torchrun --standalone --nproc-per-node 2 examples/compile.py --backend aot_eager
    torchrun --standalone --nproc-per-node 2 examples/compile.py --order titan

``tune`` (default): ``fully_shard(block)`` then ``block.compile()`` in place; ``titan``:
``torch.compile(block, fullgraph=True)`` put back into the model, then ``fully_shard`` on it;
``forward``: ``block.forward = torch.compile(block.forward)``; ``whole``: ``torch.compile`` of
the whole sharded model. In every order ``fully_shard``'s hooks run outside the compiled
graphs, which see the gathered, plain parameters; the script ends by printing how many
frames dynamo compiled (the same after the first step: no recompilation).
"""

from __future__ import annotations

import argparse
import time

import torch
from toy import ToyLM, batch, log, loss_fn

from fully_shard import fully_shard, init_distributed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--order", choices=["tune", "titan", "forward", "whole"], default="tune")
    args = parser.parse_args()
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend(args.backend)  # counts the frames dynamo compiles
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    mesh = job.mesh
    torch.manual_seed(0)
    model = ToyLM(n_layers=2).to(job.device)
    for i, block in enumerate(list(model.layers)):
        if args.order == "titan":
            block = torch.compile(block, backend=counter, fullgraph=True)
            model.layers[i] = block
        fully_shard(block, mesh=mesh)
        if args.order == "tune":
            block.compile(backend=counter)
        elif args.order == "forward":
            block.forward = torch.compile(block.forward, backend=counter)
    fully_shard(model, mesh=mesh)
    run = torch.compile(model, backend=counter) if args.order == "whole" else model

    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    frames: list[int] = []
    for step in range(args.steps):
        start = time.perf_counter()
        tokens, targets = batch(step, device=job.device)
        loss = loss_fn(run(tokens), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        log(f"step {step}: loss {loss.item():.4f} ({time.perf_counter() - start:.2f} s)")
        frames.append(counter.frame_count)
    log(f"frames compiled after each step: {frames} ({args.order} order)")
    if frames != [frames[0]] * len(frames):
        raise SystemExit(f"recompiled after the first step: {frames}")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
