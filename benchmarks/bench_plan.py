"""The planner against measurement: predicted vs measured peak, and the step time it buys.

    python benchmarks/bench_plan.py --size small --nproc 2

For a bench model (``bench_train.py``'s sizes) and three budgets (unconstrained, halfway,
the feasible minimum), one run on ``--nproc`` gloo ranks prints, per configuration: the
planned peak per rank, the peak MemTracker measures for one training step on each rank (the
worst rank), and the step time relative to the default configuration (every block and the
root, ``reshard_after_forward=True``), with two hand configurations beside it (every block
kept gathered; every block checkpointed). Ratios, not lone times: the machine is shared.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_train import SIZES, Llama, _free_port, init_rank, make_batches
from torch import Tensor, nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.multiprocessing.spawn import spawn

from fully_shard import PlanInfeasibleError, fully_shard, plan
from fully_shard.demo import leave_rank
from fully_shard.plan import CheckpointedBlock


class _Tracker(MemTracker):
    """MemTracker without per-parameter gradient hooks (they refuse frozen parameters)."""

    def _track_module_params_and_buffers(
        self, module: nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        return super()._track_module_params_and_buffers(module, install_grad_hooks=False)


def _loss(out: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), targets.flatten())


def _by_hand(model: nn.Module, mesh: Any, keep: bool, ckpt: bool) -> nn.Module:
    layers = model.get_submodule("layers")
    for i, block in enumerate(list(layers.children())):
        if ckpt:
            block = CheckpointedBlock(block)
            layers[i] = block  # type: ignore[index]
        fully_shard(block, mesh=mesh, reshard_after_forward=not keep)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


def _run(model: nn.Module, batches: list[Tensor], steps: int) -> tuple[int, float]:
    """(measured peak of a step after the first, seconds per step)."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = _Tracker()
    tracker.track_external(model)

    def step(inputs: Tensor, targets: Tensor) -> None:
        loss = _loss(model(inputs), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()

    # MemTracker charges a step the whole storage of every tensor it first sees as an op's
    # output or a module's input: a slice of the global batch taken under it would count the
    # global batch, once per step still held in `batches` (the planner counts this step's
    # inputs only). So the tracked steps slice outside and copy each step's rows inside.
    pairs = [(tokens[:, :-1], tokens[:, 1:]) for tokens in batches[:2]]
    with tracker:
        for inputs, targets in pairs:
            step(inputs.clone(memory_format=torch.contiguous_format), targets.clone())
            tracker.reset_mod_stats()
    peak = max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        tokens = batches[i % len(batches)]
        step(tokens[:, :-1], tokens[:, 1:])
    dist.barrier()
    return peak, (time.perf_counter() - start) / steps


def _rank_main(rank: int, world: int, size: str, steps: int, port: int) -> None:
    # The planner's numbers are CPU bytes (tracemalloc, the CPU allocator): CPU ranks, gloo.
    mesh = init_rank(rank, world, "cpu", "gloo", port, timedelta(seconds=300)).mesh
    cfg = SIZES[size]
    batches = [b[rank * cfg.batch : (rank + 1) * cfg.batch] for b in make_batches(cfg, world, 4, 0)]
    torch.manual_seed(0)

    def fresh() -> nn.Module:
        torch.manual_seed(0)
        return Llama(cfg)

    tokens = batches[0]
    # The planner counts the targets its loss closes over as held through the step, as the
    # tracked steps hold theirs (a contiguous copy, so that flattening them copies nothing).
    targets = tokens[:, 1:].contiguous()
    common: dict[str, Any] = {
        "example_inputs": (tokens[:, :-1],),
        "mesh": mesh,
        "loss_fn": lambda out: _loss(out, targets),
    }
    roomy = plan(fresh(), budget="1TiB", **common)
    try:
        plan(fresh(), budget=1, **common)
    except PlanInfeasibleError as e:
        low = e.minimum_bytes
    rows: list[tuple[str, int | None, int, float]] = []
    peak, t_default = _run(_by_hand(fresh(), mesh, False, False), batches, steps)
    default = plan(fresh(), budget="1TiB", allow=(), **common)
    rows.append(("default (reshard True)", default.peak_bytes, peak, 1.0))
    for name, keep, ckpt in (
        ("hand: all kept", True, False),
        ("hand: all checkpointed", False, True),
    ):
        peak, t = _run(_by_hand(fresh(), mesh, keep, ckpt), batches, steps)
        rows.append((name, None, peak, t / t_default))
    for name, budget in (
        ("plan: unconstrained", roomy.peak_bytes),
        ("plan: halfway", (low + roomy.peak_bytes) // 2),
        ("plan: minimum", low),
    ):
        p = plan(fresh(), budget=budget, **common)
        peak, t = _run(p.apply(fresh(), mesh), batches, steps)
        rows.append((name, p.peak_bytes, peak, t / t_default))
    worst = [torch.tensor([r[2]]) for r in rows]
    for w in worst:
        dist.all_reduce(w, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(
            f"size {size}, {world} ranks, {steps} timed steps; peaks in bytes per rank (worst rank)"
        )
        print(
            f"{'configuration':<26} {'predicted':>12} {'measured':>12} {'pred/meas':>10} "
            f"{'time/default':>13}"
        )
        for (name, pred, _, ratio), w in zip(rows, worst, strict=True):
            m = int(w.item())
            pr = "-" if pred is None else f"{pred:,}"
            q = "-" if pred is None else f"{pred / m:.3f}"
            print(f"{name:<26} {pr:>12} {m:>12,} {q:>10} {ratio:>13.2f}")
    dist.barrier()  # leave together: no rank tears down its connections while one still runs
    dist.destroy_process_group()
    leave_rank()  # no interpreter finalization: see its docstring


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    a = parser.parse_args(argv)
    spawn(_rank_main, args=(a.nproc, a.size, a.steps, _free_port()), nprocs=a.nproc)  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
