"""The compiled step's first call (its compilation) against depth: ours against torch's order.

Each configuration (a model, a depth, an implementation) runs in a process of its own with an
empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` a new directory), so that none reuses what
another compiled. A configuration spawns ``--nproc`` gloo ranks, builds the model from the
same seed and times its first training step (the slowest rank's), which is where everything
compiles. Then it builds our eager engine on the same model beside it and times both in turns
(``--steps`` each, alternating), so the compiled step and the eager one meet the same load.

Models (``--model``):

* ``blocks``: ``bench_overhead.py``'s, ``--depth`` blocks of ``nn.Sequential(nn.Linear(16, 16),
  nn.ReLU())``, ``fully_shard`` on each and on the root, SGD, an MSE loss, 4 rows per rank;
* ``llama``: ``bench_train.py``'s Llama-style model at ``--size`` (``small``, ``medium``; the
  depth is the size's), AdamW, cross entropy.

Implementations (``--impls``):

* ``ours-graph``: ``torch.compile(model, fullgraph=True)`` of the sharded model, each block a
  nested compile region (the default: traced and compiled once per block structure);
* ``ours-graph-inline``: the same with ``model.set_compile_region(False)``: every block traced
  and lowered anew (the one graph before regions);
* ``fsdp2-compiled``: torch's ``fully_shard`` in torchtitan's order, each block
  ``torch.compile(block, fullgraph=True)`` and then sharded (its hooks run eagerly);
* ``ours-blocks``: ours in the same order: each block compiled, then sharded, our hooks eager
  between the blocks' graphs and the root's own layers not compiled (what it compiles is what
  ``fsdp2-compiled`` compiles).

Reported per configuration: the first step, the compiled step (median of ``--steps``) beside
our eager step in the same process, the graphs the backend compiled, and for ours the regions
in the traced graph (``invoke_subgraph`` calls, distinct bodies). The load average of the
machine before and after each configuration is printed beside it: on a shared machine it
moves compile times more than anything else, so compare rows measured under similar load.
The last line printed is one JSON object with every number. ``--repeat N`` runs every
configuration ``N`` times, in turns, and prints each configuration's median first step and
its ratio to torch's order on the same model: a first step is mostly C++ builds, which move
it by a second or two from run to run.

Example:
    $ python benchmarks/bench_compile.py --model blocks --depth 12,48 --nproc 1
    $ python benchmarks/bench_compile.py --model blocks --depth 12,48 --nproc 1 --repeat 3 \
        --impls ours-graph,fsdp2-compiled
    $ python benchmarks/bench_compile.py --model llama --size small,medium --nproc 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_train import SIZES, Llama, _free_port, init_rank, make_batches, own_mesh
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.multiprocessing.spawn import spawn

import fully_shard as fs

IMPLS = ("ours-graph", "ours-graph-inline", "fsdp2-compiled", "ours-blocks")
WIDTH = 16  # the blocks model's width, as bench_overhead's


@dataclass(frozen=True)
class Config:
    """One configuration, run in its own process (picklable, sent to every rank)."""

    model: str  # "blocks" or "llama"
    depth: int  # blocks: the number of blocks; llama: the size's layers
    size: str  # llama's size ("" for blocks)
    impl: str
    world: int
    steps: int
    backend: str  # torch.compile's
    seed: int = 0


def _blocks(depth: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(depth)))


def _counting_backend(backend: str, counts: dict[str, int]) -> Any:
    """``backend``, counting the graphs dynamo hands it and the regions in them."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(backend)

    def compile_graph(gm: torch.fx.GraphModule, example: Any) -> Any:
        calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
        counts["graphs"] += 1
        counts["region_calls"] += len(calls)
        counts["region_bodies"] += len({n.args[1] for n in calls})
        return inner(gm, example)

    return compile_graph


def build(
    cfg: Config, impl: str, mesh: DeviceMesh, counts: dict[str, int]
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model from the seed, sharded (and compiled) as ``impl``; ``"ours"`` is eager."""
    torch.manual_seed(cfg.seed)
    model: nn.Module = _blocks(cfg.depth) if cfg.model == "blocks" else Llama(SIZES[cfg.size])
    blocks: nn.Module = model if cfg.model == "blocks" else model.layers
    backend = _counting_backend(cfg.backend, counts)
    shard: Any = torch_fully_shard if impl == "fsdp2-compiled" else fs.fully_shard
    for i, block in enumerate(list(blocks)):
        if impl in ("fsdp2-compiled", "ours-blocks"):  # torchtitan's order: compile, then shard
            block = torch.compile(block, backend=backend, fullgraph=True)
            blocks[i] = block  # type: ignore[index]
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    if impl == "ours-graph-inline":
        model.set_compile_region(False)  # type: ignore[operator]
    if cfg.model == "blocks":
        optim: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, foreach=True)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if impl.startswith("ours-graph"):
        model = torch.compile(model, backend=backend, fullgraph=True)  # type: ignore[assignment]
    return model, optim


def _batches(cfg: Config, rank: int, n: int) -> list[Any]:
    if cfg.model == "llama":
        return [b.chunk(cfg.world)[rank] for b in make_batches(SIZES[cfg.size], cfg.world, n, 0)]
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(step * 1_000 + rank)
        out.append((torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)))
    return out


def _step(cfg: Config, model: nn.Module, optim: torch.optim.Optimizer, batch: Any) -> float:
    if cfg.model == "llama":
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    else:
        x, y = batch
        loss = F.mse_loss(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    optim.step()
    optim.zero_grad(set_to_none=True)
    return float(loss.detach())


def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step takes its slowest rank's time
    return float(elapsed)


def _rank_main(rank: int, cfg: Config, port: int, out_path: str) -> None:
    job = init_rank(rank, cfg.world, "cpu", "gloo", port, timedelta(minutes=30))  # C++
    counts = {"graphs": 0, "region_calls": 0, "region_bodies": 0}
    batches = _batches(cfg, rank, cfg.steps + 1)
    model, optim = build(cfg, cfg.impl, own_mesh(job.mesh, cfg.impl), counts)
    first = _timed(lambda: _step(cfg, model, optim, batches[0]))
    first_counts = dict(counts)
    eager, eager_optim = build(cfg, "ours", own_mesh(job.mesh, "ours"), {"graphs": 0})
    _step(cfg, eager, eager_optim, batches[0])  # its lazy init
    times: dict[str, list[float]] = {"compiled": [], "eager": []}
    for i, batch in enumerate(batches[1:]):
        # Alternate which one goes first, so that neither always follows the other.
        order = [("compiled", model, optim), ("eager", eager, eager_optim)]
        for name, m, o in order if i % 2 == 0 else order[::-1]:
            times[name].append(_timed(lambda m=m, o=o, b=batch: _step(cfg, m, o, b)))
    if rank == 0:
        result = {
            "config": asdict(cfg),
            "first_step_s": first,
            "step_ms": 1e3 * statistics.median(times["compiled"]),
            "eager_step_ms": 1e3 * statistics.median(times["eager"]),
            "recompiled_after_first_step": counts["graphs"] != first_counts["graphs"],
            **first_counts,
        }
        Path(out_path).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run_child(cfg: Config) -> None:
    """Inside a configuration's process: spawn the ranks, print their JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        spawn(_rank_main, args=(cfg, _free_port(), out), nprocs=cfg.world, join=True)
        print(Path(out).read_text())


def run_config(cfg: Config) -> dict[str, Any]:
    """One configuration in a fresh process with an empty inductor cache."""
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(asdict(cfg))],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"{cfg} failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["load"] = [before, os.getloadavg()[0]]
    return result


def print_row(r: dict[str, Any]) -> None:
    cfg = r["config"]
    name = f"{cfg['model']} {cfg['size'] or cfg['depth']}"
    regions = (
        f"{r['region_bodies']} bodies / {r['region_calls']} calls" if r["region_calls"] else "-"
    )
    print(
        f"{name:<14} {cfg['impl']:<18} W={cfg['world']} first step {r['first_step_s']:7.1f} s"
        f"  step {r['step_ms']:7.2f} ms (our eager {r['eager_step_ms']:7.2f} ms)"
        f"  graphs {r['graphs']}  regions {regions}"
        f"  load {r['load'][0]:.1f}->{r['load'][1]:.1f}",
        flush=True,
    )


def print_medians(results: list[dict[str, Any]]) -> None:
    """Per configuration, the median first step of its runs and, beside ``fsdp2-compiled`` on
    the same model, the ratio of the medians (the C++ builds of a first step move it by a
    second or two from run to run, a tenth of it: one run each does not settle 1.2x)."""
    firsts: dict[tuple[str, int, str], list[float]] = {}
    for r in results:
        cfg = r["config"]
        firsts.setdefault((cfg["model"], cfg["depth"], cfg["impl"]), []).append(r["first_step_s"])
    print("median first step (s), each configuration's runs:")
    for (model, depth, impl), xs in firsts.items():
        median = statistics.median(xs)
        torch_order = firsts.get((model, depth, "fsdp2-compiled"))
        ratio = (
            f"  {median / statistics.median(torch_order):.2f}x torch's order"
            if torch_order and impl != "fsdp2-compiled"
            else ""
        )
        runs = ", ".join(f"{x:.1f}" for x in xs)
        print(f"  {model} {depth:<4} {impl:<18} {median:6.1f} [{runs}]{ratio}", flush=True)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("blocks", "llama"), default="blocks")
    parser.add_argument("--depth", default="12,48", help="blocks model: comma list of depths")
    parser.add_argument("--size", default="small", help="llama model: comma list of sizes")
    parser.add_argument(
        "--impls", default=",".join(IMPLS), help="comma list of " + ", ".join(IMPLS)
    )
    parser.add_argument("--nproc", type=int, default=1, help="ranks (gloo on CPU)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the first")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every configuration this many times, in turns; report the median first step",
    )
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        run_child(Config(**json.loads(args.child)))
        return []
    impls = args.impls.split(",")
    for impl in impls:
        if impl not in IMPLS:
            parser.error(f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")
    base = Config("", 0, "", "", args.nproc, args.steps, args.compile_backend)
    if args.model == "blocks":
        shapes = [replace(base, model="blocks", depth=int(d)) for d in args.depth.split(",")]
    else:
        shapes = [
            replace(base, model="llama", size=s, depth=SIZES[s].n_layers)
            for s in args.size.split(",")
        ]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()}", flush=True)
    results = []
    for _ in range(args.repeat):  # in turns: a slow minute falls on every configuration
        for shape in shapes:
            for impl in impls:
                result = run_config(replace(shape, impl=impl))
                print_row(result)
                results.append(result)
    if args.repeat > 1:
        print_medians(results)
    summary = json.dumps(results)
    if args.json_out is not None:
        args.json_out.write_text(summary)
    print(summary)
    return results


if __name__ == "__main__":
    main()
