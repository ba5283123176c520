"""``torch.compile`` on the blocks of a sharded model, ``fully_shard``'s hooks left eager.

    torchrun --standalone --nproc-per-node 2 examples/compile.py                   # inductor
    torchrun --standalone --nproc-per-node 2 examples/compile.py --backend aot_eager

Compile each block's ``forward`` (not the module, whose ``__call__`` runs the hooks): the
compiled graph sees the gathered, plain parameters; all-gathers and reduce-scatters stay in
eager Python around it.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from toy import ToyLM, batch, log, loss_fn

from fully_shard import fully_shard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = ToyLM(n_layers=2)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
        block.forward = torch.compile(block.forward, backend=args.backend)
    fully_shard(model, mesh=mesh)

    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(args.steps):
        start = time.perf_counter()
        tokens, targets = batch(step)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        log(f"step {step}: loss {loss.item():.4f} ({time.perf_counter() - start:.2f} s)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
