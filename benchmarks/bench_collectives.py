"""One collective at a time: torch's gloo collectives against the ones ``TorchComm`` issues.

``TorchComm`` rebuilds both ZeRO-3 collectives on gloo (see its docstring): an all-gather as W
broadcasts straight into the output, a reduce-scatter as an in-place all-reduce of the packed
buffer. This script measures each pair on the same buffers, alternating them call by call so
that load on the machine falls on both, and prints the median milliseconds per call (the
slowest rank's) and the ratio ``TorchComm / torch``. Each call gets a fresh output buffer and,
for the reduce-scatter, a fresh copy of the input, as in a training step (the engine packs a new
gradient buffer every time; gloo's own reduce-scatter clones it on top of that).

It also checks, on every size, that both give the same bits; a mismatch is an error.

Example:
    $ python benchmarks/bench_collectives.py --nproc 2
    $ python benchmarks/bench_collectives.py --nproc 4 --mib 0.5,4 --calls 40
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from bench_train import init_rank
from torch.multiprocessing.spawn import spawn

from fully_shard import TorchComm
from fully_shard.collectives import SUM

PAIRS = ("all_gather", "reduce_scatter")


def _one_size(mib: float, calls: int) -> dict[str, list[float]]:
    """Per-call times (s) of torch's and our version of each collective for a ``mib`` shard."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = max(1, int(mib * 2**20) // 4)  # fp32 elements in this rank's shard
    group = dist.group.WORLD
    assert group is not None
    comm = TorchComm()
    g = torch.Generator().manual_seed(rank)
    shard = torch.randn(n, generator=g)
    grads = torch.randn(world * n, generator=g)  # (W * n,) the packed reduce-scatter input

    def torch_all_gather() -> torch.Tensor:
        out = torch.empty(world * n)
        dist.all_gather_into_tensor(out, shard)
        return out

    def ours_all_gather() -> torch.Tensor:
        out = torch.empty(world * n)
        comm.all_gather(out, out.narrow(0, rank * n, n).copy_(shard), group, async_op=False)
        return out

    def torch_reduce_scatter() -> torch.Tensor:
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, grads.clone())
        return out

    def ours_reduce_scatter() -> torch.Tensor:
        out = torch.empty(n)
        comm.reduce_scatter(out, grads.clone(), group, SUM, async_op=False)
        return out

    fns: dict[str, Callable[[], torch.Tensor]] = {
        "torch all_gather": torch_all_gather,
        "ours all_gather": ours_all_gather,
        "torch reduce_scatter": torch_reduce_scatter,
        "ours reduce_scatter": ours_reduce_scatter,
    }
    for op in PAIRS:
        if not torch.equal(fns[f"torch {op}"](), fns[f"ours {op}"]()):
            raise RuntimeError(f"rank {rank}: {op} of {mib} MiB differs from torch's")
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(calls):
        for name, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _rank_main(rank: int, world: int, port: int, sizes: list[float], calls: int, out: str) -> None:
    warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 deprecates the *_tensor names
    init_rank(rank, world, "cpu", "gloo", port, timedelta(minutes=5))  # gloo's, by design
    try:
        results = {str(mib): _one_size(mib, calls) for mib in sizes}
        gathered: list[dict[str, dict[str, list[float]]] | None] = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Done, and the results are on disk. Leave without tearing gloo down: on torch 2.6
    # destroy_process_group() hung here after the larger sizes (not on 2.13), and the
    # training benchmark leaves the same way (see bench_train.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def summarize(ranks: list[dict[str, dict[str, list[float]]]]) -> list[dict[str, float]]:
    """Median over calls of the slowest rank's time, per size and collective, in ms."""
    rows = []
    for size in ranks[0]:
        row: dict[str, float] = {"shard_mib": float(size)}
        for name in ranks[0][size]:
            per_call = zip(*(r[size][name] for r in ranks), strict=True)
            row[name] = 1e3 * statistics.median(max(c) for c in per_call)
        for op in PAIRS:
            row[f"{op} ours/torch"] = row[f"ours {op}"] / row[f"torch {op}"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="world size: local ranks to spawn")
    parser.add_argument("--mib", default="0.5,1.5,4,16", help="shard sizes in MiB, comma-separated")
    parser.add_argument("--calls", type=int, default=25, help="timed calls of each, per size")
    args = parser.parse_args(argv)
    sizes = [float(x) for x in args.mib.split(",") if x.strip()]
    if args.nproc < 1 or args.calls < 1 or not sizes or min(sizes) <= 0:
        parser.error("--nproc and --calls must be >= 1, --mib positive sizes")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        args_ = (args.nproc, port, sizes, args.calls, out)
        spawn(_rank_main, args=args_, nprocs=args.nproc)  # type: ignore[no-untyped-call]
        rows = summarize(json.loads(Path(out).read_text()))
    print(f"gloo, W={args.nproc}, fp32, median ms per call (slowest rank), {args.calls} calls each")
    print(f"{'shard MiB':>9}  {'all-gather torch':>16} {'ours':>7} {'ratio':>6}  "
          f"{'reduce-scatter torch':>20} {'ours':>7} {'ratio':>6}")  # fmt: skip
    for r in rows:
        print(
            f"{r['shard_mib']:>9g}  {r['torch all_gather']:>16.2f} {r['ours all_gather']:>7.2f} "
            f"{r['all_gather ours/torch']:>6.2f}  {r['torch reduce_scatter']:>20.2f} "
            f"{r['ours reduce_scatter']:>7.2f} {r['reduce_scatter ours/torch']:>6.2f}"
        )
    print(json.dumps({"world": args.nproc, "calls": args.calls, "rows": rows}))
    sys.stdout.flush()
    return rows


if __name__ == "__main__":
    main()
