"""The fixed cost per group: many tiny blocks, where the hooks' Python is all there is to time.

One command spawns ``--nproc`` local ranks (gloo on CPU; a comma list runs each world size in
turn) and builds one model per implementation from the same seed: ``--blocks`` blocks of
``nn.Sequential(nn.Linear(16, 16), nn.ReLU())`` in an ``nn.Sequential``, a batch of 4 rows per
rank, ``torch.optim.SGD(foreach=True)``. One step is forward, an MSE loss, backward,
``optimizer.step()`` and ``zero_grad()``.

* ``ours`` -- :func:`fully_shard.fully_shard` on every block, then on the root: blocks + 1
  groups (the root's owns no parameter here);
* ``ours-buckets`` (with ``--bucket-cap-mb``) -- the same, with ``set_bucket_cap_mb``: the
  groups' collectives merged into buckets (:mod:`fully_shard.bucket`);
* ``ours-zero2`` (with ``--bucket-cap-mb`` and ``--zero2``) -- ``ours-buckets`` with
  ``reshard_after_forward=False`` on every block: the parameters stay gathered from forward to
  backward, one all-gather and one reduce-scatter per bucket (ZeRO-2's traffic);
* ``fsdp2`` -- ``torch.distributed.fsdp.fully_shard``, wrapped the same way;
* with ``--compile [BACKEND]`` (``inductor`` if no backend is named), ``ours`` and
  ``ours-buckets`` run ``torch.compile(model, fullgraph=True)`` of the sharded model: the
  graph path (:mod:`fully_shard.graph`), every collective in the one graph, one all-gather and
  one reduce-scatter per bucket with the cap. The warm-up steps compile (untimed); the others
  stay eager;
* ``plain`` (W = 1) -- the model itself, no wrapper: the floor;
* ``ddp`` (W >= 2) -- ``DistributedDataParallel``: the floor with gradient synchronisation;
* ``hooks`` (``--impls ...,hooks``) -- the floor (plain or DDP) with, around every block's
  forward, the autograd work any per-module-hook design adds and nothing else: the input
  through an identity ``autograd.Function`` (whose backward is where a post-backward runs) and
  an empty tensor hook on the output (a pre-backward), called from the block's ``forward``
  (an instance attribute) as ``FSDPModule.__call__`` calls ours, with no ``nn.Module`` hook.
  What a step of ``ours`` costs over it is our work; what it costs over the floor, no hook
  design avoids.

The compute is a few microseconds per block, so what a step costs over the floor is the
wrapper's fixed cost per group: hooks, state checks, buffers, DTensor dispatch in the optimizer.

After ``--warmup`` untimed steps each, the implementations run interleaved: rounds of
``--round-steps`` steps each, in rotating order (ABC, BCA, CAB, ...), so that load on the machine
falls on all of them alike. A barrier lines the ranks up before each step; a step's time is the
slowest rank's. Reported: median and quartiles of the step time, the ratios of the medians.

Python calls are counted over one more step of each implementation (after the timed ones, so
that counting does not slow what is timed) with ``sys.setprofile``: every ``call`` event (a
Python function or generator entered) and every ``c_call`` event (a builtin or C function
called from Python) on the training thread, which on CPU also runs the autograd engine and so
every backward hook. "Python calls" are the ``call`` events (what issue 48 counted; cProfile
counts both kinds), reported beside the ``c_call`` events. ``optimizer.step()`` and
``zero_grad()`` are counted apart within the same step. "per group" divides a step's Python
calls by the number of groups (blocks + 1); "over floor per group" first subtracts the floor's
(plain or DDP). Each implementation builds its model on a mesh of its own name
(``bench_train.own_mesh``): DTensor's sharding-propagation cache would otherwise find a later
model's parameter specs equal to an earlier one's and compare them in Python at every hit,
which cost the second model built (whichever it was) ~290 more Python calls per ``step()``.

``--profile N`` also prints, for rank 0, the ``N`` functions with the most own time in one step
of ``ours`` (cProfile), the list a cut of the fixed cost starts from.

The last line printed is one JSON object with every number.

Example:
    $ python benchmarks/bench_overhead.py --nproc 1,2
    $ python benchmarks/bench_overhead.py --nproc 1 --blocks 48 --steps 100 --profile 25
    $ python benchmarks/bench_overhead.py --nproc 2 --impls ours,floor --bucket-cap-mb 25 --compile
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import itertools
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_train import _free_port, _percentile, init_rank, own_mesh
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.multiprocessing.spawn import spawn
from torch.nn.parallel import DistributedDataParallel

import fully_shard as fs
from fully_shard.demo import leave_rank

IMPLS = ("ours", "ours-buckets", "ours-zero2", "fsdp2", "plain", "ddp", "hooks")
LABELS = {
    "ours": "fully_shard (ours)",
    "ours-buckets": "ours, buckets",
    "ours-zero2": "ours, buckets, kept",
    "fsdp2": "torch fully_shard",
    "plain": "plain model",
    "ddp": "torch DDP",
    "hooks": "floor + empty hooks",
}
WIDTH = 16  # nn.Linear(16, 16): the block
PHASES = ("forward", "backward", "step", "zero_grad")


@dataclass(frozen=True)
class RunOptions:
    """Everything a rank needs to know (picklable, sent to every spawned rank)."""

    blocks: int
    world: int
    batch: int
    steps: int
    warmup: int
    round_steps: int
    impls: tuple[str, ...]
    seed: int
    lr: float
    profile: int
    bucket_cap_mb: float | None = None  # ours-buckets
    compile: str | None = None  # torch.compile's backend for ours and ours-buckets, or None


def floor_of(world: int) -> str:
    """The implementation the others are measured against: the plain model on one rank."""
    return "plain" if world == 1 else "ddp"


def make_model(blocks: int, seed: int) -> nn.Sequential:
    """``blocks`` x ``[Linear(16, 16), ReLU]``: ``(B, 16) -> (B, 16)``."""
    torch.manual_seed(seed)
    blocks_ = (nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(blocks))
    return nn.Sequential(*blocks_)


def build(impl: str, opts: RunOptions, mesh: DeviceMesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model from the run's seed, wrapped by ``impl``, and its SGD."""
    model: nn.Module = make_model(opts.blocks, opts.seed)
    if impl in ("ours", "ours-buckets", "ours-zero2", "fsdp2"):
        shard: Callable[..., Any] = torch_fully_shard if impl == "fsdp2" else fs.fully_shard
        for block in model:
            if impl == "ours-zero2":
                shard(block, mesh=mesh, reshard_after_forward=False)
            else:
                shard(block, mesh=mesh)
        shard(model, mesh=mesh)
        if impl in ("ours-buckets", "ours-zero2"):
            model.set_bucket_cap_mb(opts.bucket_cap_mb)  # type: ignore[operator]
        if opts.compile is not None and impl != "fsdp2":
            # The compiled module shares the sharded one's parameters (the optimizer's).
            compiled = torch.compile(model, backend=opts.compile, fullgraph=True)
            return compiled, torch.optim.SGD(model.parameters(), lr=opts.lr, foreach=True)  # type: ignore[return-value]
    elif impl == "ddp":
        model = DistributedDataParallel(model)
    elif impl == "hooks":
        for block in model:
            block.forward = functools.partial(_skeleton_forward, block.forward)  # type: ignore[method-assign]
        if opts.world > 1:
            model = DistributedDataParallel(model)
    elif impl != "plain":
        raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")
    return model, torch.optim.SGD(model.parameters(), lr=opts.lr, foreach=True)


class _Identity(torch.autograd.Function):
    """The node a post-backward hook runs from (its backward), doing nothing else."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def _skeleton_forward(forward: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        x = _Identity.apply(x)
    output = forward(x)
    if output.requires_grad:
        output.register_hook(functools.partial(_skeleton_pre_backward, forward))
    return output


def _skeleton_pre_backward(forward: Callable[[Tensor], Tensor], grad: Tensor) -> None:
    return None


def train_step(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    batch: tuple[Tensor, Tensor],
    mark: Callable[[], None] | None = None,
) -> float:
    """Forward, MSE loss, backward, ``step()``, ``zero_grad()``; the local loss.

    ``mark`` (if given) is called at the three boundaries between the four phases.
    """
    x, y = batch
    loss = F.mse_loss(model(x), y)
    if mark is not None:
        mark()
    loss.backward()  # type: ignore[no-untyped-call]
    if mark is not None:
        mark()
    optim.step()
    if mark is not None:
        mark()
    optim.zero_grad(set_to_none=True)
    return loss.item()


# The library's own source files: the journey of a step is the part of its calls made there.
_PACKAGE_DIR = os.path.dirname(fs.__file__) + os.sep


class CallCounter:
    """Counts ``call`` and ``c_call`` events of ``sys.setprofile`` on this thread, and keeps
    the library's functions the ``call`` events entered (the step's journey through it)."""

    def __init__(self) -> None:
        self.py = 0
        self.c = 0
        self.ours: set[CodeType] = set()

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            self.py += 1
            if frame.f_code.co_filename.startswith(_PACKAGE_DIR):
                self.ours.add(frame.f_code)
        elif event == "c_call":
            self.c += 1

    def journey(self) -> dict[str, list[str]]:
        """The library's functions entered, by file (relative to the package)."""
        by_file: dict[str, set[str]] = {}
        for code in self.ours:
            name = os.path.relpath(code.co_filename, _PACKAGE_DIR)
            by_file.setdefault(name, set()).add(code.co_name)
        return {f: sorted(names) for f, names in sorted(by_file.items())}

    @property
    def total(self) -> int:
        return self.py + self.c


def count_calls(
    model: nn.Module, optim: torch.optim.Optimizer, batch: tuple[Tensor, Tensor]
) -> dict[str, Any]:
    """Python calls of one step, in all and per phase (see the module docstring)."""
    counter = CallCounter()
    marks: list[tuple[int, int]] = []

    def mark() -> None:
        marks.append((counter.py, counter.c))

    sys.setprofile(counter)
    try:
        train_step(model, optim, batch, mark)
        mark()  # zero_grad's end; loss.item() after it is not counted apart
    finally:
        sys.setprofile(None)
    bounds = [(0, 0), *marks]
    phases = {
        name: {"py": b[0] - a[0], "c": b[1] - a[1], "total": sum(b) - sum(a)}
        for name, a, b in zip(PHASES, bounds[:-1], bounds[1:], strict=True)
    }
    return {
        "py": counter.py,
        "c": counter.c,
        "total": counter.total,
        "phases": phases,
        "journey": counter.journey(),
    }


def profile_step(
    model: nn.Module, optim: torch.optim.Optimizer, batch: tuple[Tensor, Tensor], top: int
) -> str:
    """cProfile's table of one step: the ``top`` functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    train_step(model, optim, batch)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def _batches(opts: RunOptions, rank: int, n: int) -> list[tuple[Tensor, Tensor]]:
    """This rank's rows of ``n`` global batches ``(W * batch, 16)``, inputs and targets."""
    g = torch.Generator().manual_seed(opts.seed + 1)
    rows = opts.world * opts.batch
    out = []
    for _ in range(n):
        x, y = torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)
        mine = slice(rank * opts.batch, (rank + 1) * opts.batch)
        out.append((x[mine], y[mine]))
    return out


def _time_interleaved(
    opts: RunOptions, runs: dict[str, tuple[nn.Module, torch.optim.Optimizer]], data: list[Any]
) -> tuple[dict[str, list[list[float]]], dict[str, list[float]]]:
    """Warm-up, then rotating rounds; per impl the ``[total, *PHASES]`` seconds of each timed
    step, its main thread's CPU seconds, and the loss of every step (batch k at every impl's
    k-th step)."""
    times: dict[str, list[list[float]]] = {impl: [] for impl in opts.impls}
    cpu: dict[str, list[float]] = {impl: [] for impl in opts.impls}
    losses: dict[str, list[float]] = {impl: [] for impl in opts.impls}

    def one_step(impl: str, timed: bool) -> None:
        model, optim = runs[impl]
        marks: list[float] = []
        dist.barrier()
        c0, t0 = time.thread_time(), time.perf_counter()
        batch = data[len(losses[impl])]
        loss = train_step(model, optim, batch, lambda: marks.append(time.perf_counter()))
        t4, c4 = time.perf_counter(), time.thread_time()
        losses[impl].append(loss)
        if timed:
            edges = [t0, *marks, t4]
            times[impl].append([t4 - t0, *(b - a for a, b in itertools.pairwise(edges))])
            cpu[impl].append(c4 - c0)

    for _ in range(opts.warmup):
        for impl in opts.impls:
            one_step(impl, timed=False)
    r = 0
    while any(len(times[impl]) < opts.steps for impl in opts.impls):
        order = opts.impls[r % len(opts.impls) :] + opts.impls[: r % len(opts.impls)]
        for impl in order:
            for _ in range(min(opts.round_steps, opts.steps - len(times[impl]))):
                one_step(impl, timed=True)
        r += 1
    return times, cpu, losses


def _rank_main(rank: int, opts: RunOptions, port: int, out_path: str) -> None:
    # The host's Python per group is what is measured: CPU tensors and gloo, by design.
    job = init_rank(rank, opts.world, "cpu", "gloo", port, timedelta(minutes=10))  # host
    try:
        data = _batches(opts, rank, opts.warmup + opts.steps + 2)
        runs = {impl: build(impl, opts, own_mesh(job.mesh, impl)) for impl in opts.impls}
        times, cpu, losses = _time_interleaved(opts, runs, data)
        calls = {}
        for impl in opts.impls:  # the step after the timed ones, on every rank alike
            model, optim = runs[impl]
            dist.barrier()
            calls[impl] = count_calls(model, optim, data[len(losses[impl])])
        profile = ""
        for impl in ("ours", "ours-buckets") if opts.profile else ():
            if impl in runs:
                profile += f"{impl}:\n" + profile_step(*runs[impl], data[-1], opts.profile)
        result = {"rank": rank, "times": times, "cpu": cpu, "losses": losses, "calls": calls}
        result["profile"] = profile
        gathered: list[Any] = [None] * opts.world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            Path(out_path).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()
    leave_rank()  # see bench_train._rank_main


def summarize(opts: RunOptions, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold the ranks' raw numbers into one record per implementation, and the ratios."""
    groups = opts.blocks + 1
    floor = floor_of(opts.world)
    impls: dict[str, Any] = {}
    for impl in opts.impls:
        per_step = [
            max((r["times"][impl][i] for r in ranks), key=lambda t: t[0]) for i in range(opts.steps)
        ]
        ms = [t[0] * 1e3 for t in per_step]
        calls = ranks[0]["calls"][impl]
        diffs = [
            abs(a - b)
            for r in ranks
            if floor in r["losses"]
            for a, b in zip(r["losses"][impl], r["losses"][floor], strict=True)
        ]
        impls[impl] = {
            "step_ms": {
                "median": statistics.median(ms),
                "p25": _percentile(ms, 0.25),
                "p75": _percentile(ms, 0.75),
                "all": ms,
            },
            # The main thread's CPU time (time.thread_time): the host work of a step, what
            # another process's load moves least; gloo's own threads are not in it.
            "cpu_ms_median": statistics.median(
                statistics.fmean(r["cpu"][impl][i] for r in ranks) * 1e3 for i in range(opts.steps)
            ),
            "phase_ms_median": {
                name: statistics.median(t[k] * 1e3 for t in per_step)
                for k, name in enumerate(PHASES, start=1)
            },
            "calls_per_step": calls,
            "calls_per_step_per_rank": [r["calls"][impl]["py"] for r in ranks],
            "calls_per_group": calls["py"] / groups,
            "max_abs_loss_diff_vs_floor": max(diffs) if diffs else None,
        }
    base = impls.get(floor)
    for rec in impls.values():
        if base is not None:
            rec["calls_over_floor_per_group"] = (
                rec["calls_per_step"]["py"] - base["calls_per_step"]["py"]
            ) / groups
            rec["us_over_floor_per_group"] = (
                1e3 * (rec["step_ms"]["median"] - base["step_ms"]["median"]) / groups
            )
    ratios = {}
    pairs = [("ours", floor), ("fsdp2", floor), ("ours", "fsdp2")]
    pairs += [("ours-buckets", floor), ("ours-buckets", "ours"), ("ours-zero2", floor)]
    pairs += [("hooks", floor)]
    for mine, other in pairs:
        if mine in impls and other in impls:
            ratios[f"{mine}/{other}"] = {
                "step_time_median": impls[mine]["step_ms"]["median"]
                / impls[other]["step_ms"]["median"],
                "calls_per_step": impls[mine]["calls_per_step"]["py"]
                / impls[other]["calls_per_step"]["py"],
                "step_calls": impls[mine]["calls_per_step"]["phases"]["step"]["py"]
                / impls[other]["calls_per_step"]["phases"]["step"]["py"],
                "cpu_median": impls[mine]["cpu_ms_median"] / impls[other]["cpu_ms_median"],
            }
    return {
        "config": {**asdict(opts), "impls": list(opts.impls), "groups": groups},
        "machine": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "threads_per_rank": 1,
        },
        "impls": impls,
        "ratios": ratios,
        "profile_rank0": ranks[0]["profile"],
    }


def print_report(s: dict[str, Any], load: tuple[float, float]) -> None:
    cfg = s["config"]
    compiled = "" if cfg["compile"] is None else f", ours compiled whole ({cfg['compile']})"
    print(
        f"\n== bench_overhead: {cfg['blocks']} blocks of [Linear(16, 16), ReLU], "
        f"{cfg['groups']} groups, W={cfg['world']} (gloo, 1 thread/rank, "
        f"{s['machine']['cpus']} CPUs seen), batch {cfg['batch']}/rank, SGD foreach; "
        f"{cfg['warmup']} warm-up + {cfg['steps']} timed steps (rounds of {cfg['round_steps']}); "
        f"torch {s['machine']['torch']}; load average {load[0]:.2f} before, {load[1]:.2f} after"
        f"{compiled}"
    )
    header = (
        f"{'implementation':<20}{'step ms: median [p25-p75]':>28}{'py calls':>10}"
        f"{'per group':>11}{'over floor/gr':>15}{'C calls':>9}{'step(): py / C':>16}"
        f"{'max|dloss|':>12}"
    )
    print(header)
    print("-" * len(header))
    for impl, r in s["impls"].items():
        t, c = r["step_ms"], r["calls_per_step"]
        over = r.get("calls_over_floor_per_group")
        diff = r["max_abs_loss_diff_vs_floor"]
        step = f"{t['median']:.2f} [{t['p25']:.2f}-{t['p75']:.2f}]"
        opt = c["phases"]["step"]
        opt_s = f"{opt['py']} / {opt['c']}"
        over_s = "" if over is None else f"{over:.0f}"
        diff_s = "" if diff is None else f"{diff:.1e}"
        print(
            f"{LABELS[impl]:<20}{step:>28}{c['py']:>10}{r['calls_per_group']:>11.0f}"
            f"{over_s:>15}{c['c']:>9}{opt_s:>16}{diff_s:>12}"
        )
    print(
        "median ms per phase: "
        + ", ".join(
            f"{LABELS[impl]} " + " / ".join(f"{r['phase_ms_median'][p]:.2f}" for p in PHASES)
            for impl, r in s["impls"].items()
        )
        + "  (" + " / ".join(PHASES) + ")"
    )  # fmt: skip
    print(
        "main thread's CPU ms per step (median, mean of ranks): "
        + ", ".join(f"{LABELS[impl]} {r['cpu_ms_median']:.2f}" for impl, r in s["impls"].items())
    )
    for name, r in s["ratios"].items():
        print(
            f"ratio {name}: step time (median) {r['step_time_median']:.2f}x, main-thread CPU "
            f"{r['cpu_median']:.2f}x, Python calls per step {r['calls_per_step']:.2f}x, in "
            f"optimizer.step() {r['step_calls']:.2f}x"
        )
    for impl, r in s["impls"].items():
        journey = r["calls_per_step"]["journey"]
        if journey:  # fully_shard's own functions on one step (rank 0): the reading path
            n = sum(map(len, journey.values()))
            files = ", ".join(f"{f} {len(fns)}" for f, fns in journey.items())
            print(f"{LABELS[impl]}: one step enters {len(journey)} files, {n} functions ({files})")
    if s["profile_rank0"]:
        print(f"cProfile of one step of ours, rank 0:\n{s['profile_rank0']}")


def parse_args(argv: list[str] | None) -> tuple[list[RunOptions], Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=48, help="blocks (default 48)")
    parser.add_argument(
        "--nproc", default="1", help="world sizes, comma-separated, each run in turn (default 1)"
    )
    parser.add_argument("--batch", type=int, default=4, help="rows per rank (default 4)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument(
        "--round-steps", type=int, default=5, help="steps per implementation per round"
    )
    parser.add_argument(
        "--impls",
        default="ours,fsdp2,floor",
        help="comma-separated subset of ours,fsdp2,floor,hooks (floor: plain at W=1, DDP above; "
        "hooks: the floor with an empty hook skeleton on every block)",
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="also run ours-buckets (next to ours) with set_bucket_cap_mb(this many MiB)",
    )
    parser.add_argument(
        "--zero2",
        action="store_true",
        help="with --bucket-cap-mb: also run ours-zero2 (buckets, every block kept gathered "
        "from forward to backward)",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="run ours (and ours-buckets) as torch.compile(model, fullgraph=True) with this "
        "backend (default inductor): the graph path",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="print cProfile's top N of one step of ours (and of ours-buckets)",
    )
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    try:
        worlds = [int(w) for w in args.nproc.split(",") if w.strip()]
    except ValueError:
        parser.error(f"--nproc takes comma-separated integers, got {args.nproc!r}")
    if not worlds or min(worlds) < 1:
        parser.error("--nproc: each world size must be at least 1")
    names = [x.strip() for x in args.impls.split(",") if x.strip()]
    known = {"ours", "fsdp2", "floor", "hooks"}
    if not names or len(set(names)) != len(names) or set(names) - known:
        names_ok = ",".join(sorted(known))
        parser.error(f"--impls takes distinct names from {names_ok}, got {args.impls!r}")
    if args.blocks < 1 or args.batch < 1 or args.steps < 1 or args.round_steps < 1:
        parser.error("--blocks, --batch, --steps and --round-steps must be >= 1")
    if args.warmup < 0 or args.profile < 0:
        parser.error("--warmup and --profile must be >= 0")
    if args.bucket_cap_mb is not None:
        if not args.bucket_cap_mb > 0:
            parser.error("--bucket-cap-mb must be > 0")
        at = names.index("ours") + 1 if "ours" in names else 0
        names[at:at] = ["ours-buckets", "ours-zero2"] if args.zero2 else ["ours-buckets"]
    elif args.zero2:
        parser.error("--zero2 runs ours-zero2 with the buckets of --bucket-cap-mb: give one")
    runs = [
        RunOptions(
            blocks=args.blocks,
            world=w,
            batch=args.batch,
            steps=args.steps,
            warmup=args.warmup,
            round_steps=args.round_steps,
            impls=tuple(floor_of(w) if n == "floor" else n for n in names),
            seed=args.seed,
            lr=args.lr,
            profile=args.profile,
            bucket_cap_mb=args.bucket_cap_mb,
            compile=args.compile,
        )
        for w in worlds
    ]
    return runs, args.json_out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    runs, json_out = parse_args(argv)
    results = []
    for opts in runs:
        load_before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "ranks.json")
            spawn(_rank_main, args=(opts, _free_port(), out), nprocs=opts.world)  # type: ignore[no-untyped-call]
            ranks = json.loads(Path(out).read_text())
        load = (load_before, os.getloadavg()[0])
        summary = summarize(opts, ranks)
        summary["load_average_1min"] = list(load)
        print_report(summary, load)
        results.append(summary)
    report = {"runs": results}
    line = json.dumps(report, separators=(",", ":"))
    if json_out is not None:
        json_out.write_text(line + "\n")
    print(line)
    return report


if __name__ == "__main__":
    main()
