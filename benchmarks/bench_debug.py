"""What the collective checker (``fully_shard.debug.check_collectives``) costs per collective.

Trains a small model on W local ranks (gloo on CPU, NCCL on GPUs), alternating steps with the
checker off and on (so load on the machine falls on both), and prints the median step time of
each, the collectives per step, and the median extra time per checked collective. Asserts
nothing about timings.

Run it under torchrun (a free local port is chosen by ``--standalone``)::

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_debug.py --steps 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from fully_shard import CountingComm, debug, fully_shard, init_distributed
from fully_shard.demo import leave_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps of each kind")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    torch.set_num_threads(1)
    mesh = job.mesh
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.dim, args.dim) for _ in range(args.layers)))
    model.to(job.device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comm = CountingComm()
    model.set_comm(comm)
    x = torch.randn(8, args.dim, device=job.device)

    def step() -> float:
        start = time.perf_counter()
        model(x).sum().backward()
        model.zero_grad()
        if job.device.type != "cpu":  # a GPU step has ended when its kernels have
            torch.get_device_module(job.device.type).synchronize()
        return time.perf_counter() - start

    step()  # lazy init, prefetch order
    comm.reset()
    step()
    per_step = len(comm.records)
    times: dict[str, list[float]] = {"off": [], "on": []}
    with debug.check_collectives(timeout=60):
        checker = debug.JOB_WIDE.observers[-1]
        debug.JOB_WIDE.observers = ()
        for _ in range(args.steps):
            times["off"].append(step())
            debug.JOB_WIDE.observers = (checker,)
            times["on"].append(step())
            debug.JOB_WIDE.observers = ()
        debug.JOB_WIDE.observers = (checker,)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    result = {
        "world": dist.get_world_size(),
        "collectives_per_step": per_step,
        "step_ms_off": round(off * 1e3, 3),
        "step_ms_on": round(on * 1e3, 3),
        "extra_ms_per_collective": round((on - off) * 1e3 / per_step, 3),
    }
    if dist.get_rank() == 0:
        print(json.dumps(result))
    job.shutdown()  # leave together: no rank tears down its connections while one still runs
    leave_rank()  # no interpreter finalization: see its docstring


if __name__ == "__main__":
    main()
