"""Loss curves of the demo with and without int8 all-gathers, same seed, same data; a plot.

Trains the demo's model (``python -m fully_shard.demo``: a character-level Llama on the
bundled sonnets, AdamW with warm-up and cosine decay) once per configuration, on ``--nproc``
gloo ranks, and compares each run's losses with the fp32 run's:

* ``fp32``       -- unquantized all-gathers (the baseline);
* ``int8``       -- ``QuantizationPolicy(all_gather="int8", block_size=256)``;
* ``bf16``       -- ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, for scale:
  how far a perturbation everyone accepts moves the same curve;
* ``bf16+int8``  -- both: bf16 compute from an int8 gather.

Every run starts from the same weights and sees the same batches, so the curves differ only
by what quantization (or bf16) changes. It prints, per configuration, the final loss, the mean
over the last 10% of the steps, and their relative difference from fp32; writes them (and
every loss) as JSON with ``--json-out``, and the curves as a PNG with ``--plot`` (matplotlib,
only if installed; the script says so otherwise).

Example:
    $ python benchmarks/bench_quant_loss.py --size small --steps 200 --plot docs/quant-loss.png
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from bench_train import init_rank
from torch.multiprocessing.spawn import spawn

from fully_shard import demo

CONFIGS = {
    "fp32": {"mixed_precision": False, "quantize_all_gather": False},
    "int8": {"mixed_precision": False, "quantize_all_gather": True},
    "bf16": {"mixed_precision": True, "quantize_all_gather": False},
    "bf16+int8": {"mixed_precision": True, "quantize_all_gather": True},
}


def _rank_main(rank: int, cfg: demo.DemoConfig, port: int, out: str) -> None:
    job = init_rank(rank, cfg.nproc, cfg.device, "auto", port, timedelta(minutes=10))
    try:
        losses = demo.train(job, cfg)
        if rank == 0:
            Path(out).write_text(json.dumps(losses))
        dist.barrier()  # leave together, as the demo does
    finally:
        dist.destroy_process_group()
    demo.leave_rank()  # no interpreter finalization: see its docstring


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(cfg: demo.DemoConfig) -> list[float]:
    """The demo's per-step losses for ``cfg`` (its ranks spawned here)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "losses.json")
        spawn(_rank_main, args=(cfg, _free_port(), out), nprocs=cfg.nproc)  # type: ignore[no-untyped-call]
        losses: list[float] = json.loads(Path(out).read_text())
    return losses


def _tail_mean(xs: list[float]) -> float:
    n = max(1, len(xs) // 10)
    return sum(xs[-n:]) / n


def _smooth(xs: list[float], window: int = 10) -> list[float]:
    out = []
    for i in range(len(xs)):
        part = xs[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def summarize(curves: dict[str, list[float]]) -> dict[str, Any]:
    """Final and tail-mean losses per configuration, and their relative differences to fp32."""
    base = curves["fp32"]
    rows = {}
    for name, losses in curves.items():
        rows[name] = {
            "final": losses[-1],
            "tail_mean": _tail_mean(losses),
            "final_rel_diff_vs_fp32": (losses[-1] - base[-1]) / base[-1],
            "tail_mean_rel_diff_vs_fp32": (_tail_mean(losses) - _tail_mean(base))
            / _tail_mean(base),
            "max_smoothed_rel_diff_vs_fp32": max(
                abs(a - b) / b for a, b in zip(_smooth(losses), _smooth(base), strict=True)
            ),
        }
    return rows


def across_seeds(rows_by_seed: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration, its final loss vs the fp32 run of the same seed, over the seeds."""
    names = next(iter(rows_by_seed.values())).keys()
    out = {}
    for name in names:
        diffs = sorted(rows[name]["final_rel_diff_vs_fp32"] for rows in rows_by_seed.values())
        out[name] = {
            "final_rel_diff_vs_fp32": diffs,
            "median": statistics.median(diffs),
            "min": diffs[0],
            "max": diffs[-1],
            "max_abs": max(abs(d) for d in diffs),
            "within_1pct": sum(abs(d) <= 0.01 for d in diffs),
        }
    return out


def _print_rows(args: argparse.Namespace, seed: int, rows: dict[str, Any]) -> None:
    print(
        f"\n== demo size={args.size}, W={args.nproc}, {args.steps} steps, seed {seed} "
        "(weights and data, the same for every config)"
    )
    print(f"{'config':<12}{'final':>9}{'vs fp32':>10}{'last-10% mean':>15}{'vs fp32':>10}")
    for name, r in rows.items():
        print(
            f"{name:<12}{r['final']:>9.4f}{100 * r['final_rel_diff_vs_fp32']:>+9.2f}%"
            f"{r['tail_mean']:>15.4f}{100 * r['tail_mean_rel_diff_vs_fp32']:>+9.2f}%"
        )


def plot(curves: dict[str, list[float]], path: Path, title: str) -> bool:
    """Loss curves and their smoothed relative difference to fp32; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return False
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    base = _smooth(curves["fp32"])
    for name, losses in curves.items():
        steps = range(1, len(losses) + 1)
        (line,) = top.plot(steps, _smooth(losses), label=name, linewidth=1.2)
        top.plot(steps, losses, color=line.get_color(), alpha=0.15, linewidth=0.6)
        rel = [100 * (a - b) / b for a, b in zip(_smooth(losses), base, strict=True)]
        bottom.plot(steps, rel, color=line.get_color(), linewidth=1.0)
    top.set_ylabel("loss (faint: per step; bold: mean of 10)")
    top.set_title(title)
    top.legend()
    bottom.axhline(0, color="black", linewidth=0.5)
    for bound in (-1, 1):
        bottom.axhline(bound, color="grey", linewidth=0.5, linestyle="--")
    bottom.set_ylabel("vs fp32 (%, mean of 10)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(demo.SIZES), default="small")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}"
    )
    parser.add_argument(
        "--seeds",
        default="0",
        help="comma-separated demo seeds (weights and batches); every config runs with each",
    )
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="write the curves as a PNG")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if "fp32" not in names or any(n not in CONFIGS for n in names):
        parser.error(f"--configs takes names from {','.join(CONFIGS)} and must include fp32")
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    if not seeds:
        parser.error("--seeds takes a comma-separated list of integers")
    per_seed: dict[int, dict[str, Any]] = {}
    for seed in seeds:
        base = demo.DemoConfig(
            size=args.size, steps=args.steps, nproc=args.nproc, sample_chars=0, seed=seed
        )
        curves = {}
        for name in names:
            print(f"== seed {seed}: {name}", flush=True)
            curves[name] = run(replace(base, **CONFIGS[name]))
        per_seed[seed] = {"rows": summarize(curves), "curves": curves}
        _print_rows(args, seed, per_seed[seed]["rows"])
    across = across_seeds({s: r["rows"] for s, r in per_seed.items()})
    if len(seeds) > 1:
        print(f"\n== across seeds {','.join(map(str, seeds))}: final loss vs fp32 of the same seed")
        print(f"{'config':<12}{'median':>9}{'min':>9}{'max':>9}{'max |d|':>9}{'|d|<=1%':>9}")
        for name, a in across.items():
            print(
                f"{name:<12}{100 * a['median']:>+8.2f}%{100 * a['min']:>+8.2f}%"
                f"{100 * a['max']:>+8.2f}%{100 * a['max_abs']:>8.2f}%"
                f"{a['within_1pct']:>6}/{len(seeds)}"
            )
    first = per_seed[seeds[0]]
    rows, curves = first["rows"], first["curves"]
    summary = {
        "config": vars(args) | {"plot": str(args.plot)},
        "rows": rows,
        "curves": curves,
        "seeds": {str(seed): r for seed, r in per_seed.items()},
        "across_seeds": across,
    }
    summary["config"]["json_out"] = str(args.json_out)
    if args.plot is not None:
        title = (
            f"demo '{args.size}', W={args.nproc}, seed {seeds[0]}: int8 all-gathers vs fp32 "
            "(same seed)"
        )
        if plot(curves, args.plot, title):
            print(f"plot: {args.plot}")
        else:
            print("plot skipped: matplotlib is not installed")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(summary) + "\n")
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
