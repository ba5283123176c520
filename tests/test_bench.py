"""The benchmarks, run end to end on their smallest sizes: what they report must hold.

No timing is checked (these machines are noisy). What is checked is what the benchmark's
comparison rests on: the three unquantized implementations train to the unsharded reference's
losses (ours with int8 all-gathers to within 1%), the bytes our engine (plain and int8) and
torch's FSDP2 put into each collective equal the ZeRO-3 formula, and every number the report
quotes is there.

How the benchmarks are launched. Each script's ``main()`` spawns its ranks with
``torch.multiprocessing.spawn``: fresh interpreters that import torch, seconds of CPU each on
the 2 busy cores of CI. Here ``main()`` runs in the test's process with its ``spawn`` replaced
by a job on the warm pool of ``harness.py``: the same rank function on the same number of
ranks, whose ``init_process_group`` and ``destroy_process_group`` calls are made no-ops (the
pool's group is up and stays up) and whose closing ``os._exit(0)`` ends the job instead of
the process. Everything else, the parent's reference run, summary and report included, is the
script's own code. ``FULLY_SHARD_LAUNCHERS=pool,fresh`` (``nox -s soak``) also runs every
script as a user does, ``python benchmarks/<script>.py ...`` in a fresh process, spawn and all.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import fully_shard
from harness import run_distributed
from matrix import FULL_MATRIX, thinned
from parity import needs_torch_fsdp2_on_cpu

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
LAUNCHERS = tuple(os.environ.get("FULLY_SHARD_LAUNCHERS", "pool").split(","))
JOB_TIMEOUT_S = 240


class _RankLeft(Exception):
    """A rank function called ``os._exit(code)``: on the pool, the end of its job."""

    def __init__(self, code: int) -> None:
        super().__init__(f"os._exit({code})")
        self.code = code


def _leave(code: int) -> None:
    raise _RankLeft(code)


def _spawned_rank(fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    """Inside a pool rank: ``fn(rank, *args)``, what ``spawn`` runs in a fresh process."""
    with (
        mock.patch.object(dist, "init_process_group"),  # the pool's group is already up
        mock.patch.object(dist, "destroy_process_group"),  # and stays up for the next job
        mock.patch.object(os, "_exit", _leave),  # the scripts' (and leave_rank's) last call
        warnings.catch_warnings(),  # a script's warning filters stay with its job
    ):
        try:
            fn(dist.get_rank(), *args)
        except _RankLeft as left:
            if left.code != 0:
                raise
    torch.set_num_threads(1)  # as every pool job expects, whatever the script set


def _pool_spawn(fn: Callable[..., None], args: tuple[Any, ...] = (), nprocs: int = 1) -> None:
    """A ``torch.multiprocessing.spawn`` that runs the ranks on the warm pool."""
    run_distributed(_spawned_rank, nprocs, fn, args, timeout=JOB_TIMEOUT_S)


@contextlib.contextmanager
def _parent_state() -> Iterator[None]:
    """Undo what a script's parent side sets in this process (threads, an environment key)."""
    threads, env = torch.get_num_threads(), dict(os.environ)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        for key in set(os.environ) - set(env):
            del os.environ[key]
        os.environ.update(env)


def _run(script: str, *args: str, launcher: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run ``benchmarks/<script>.py`` with ``args``; what it printed.

    ``launcher``: ``"pool"`` (its ``main`` here, its ranks on the warm pool) or ``"fresh"`` (a
    new interpreter running the copy of fully_shard under test, not an install). A script's
    own failure raises either way (an exception; a non-zero exit).
    """
    if launcher == "fresh":
        src = str(Path(fully_shard.__file__).parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(
            [sys.executable, str(BENCHMARKS / f"{script}.py"), *args],
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT_S,
            env=env,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout
    # By name from sys.path, which the pool's ranks share: they unpickle the rank function.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module(script)
    monkeypatch.setattr(module, "spawn", _pool_spawn)
    out = io.StringIO()
    with _parent_state(), contextlib.redirect_stdout(out):
        code = module.main(list(args))
    assert not isinstance(code, int) or code == 0, out.getvalue()  # device_check: 0 or 1
    return out.getvalue()


@needs_torch_fsdp2_on_cpu
@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("wrap", ["blocks", "head"])
def test_bench_tiny_reports_theory_bytes_and_reference_losses(
    wrap: str, launcher: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "bench.json"
    # DDP (which does not depend on --wrap) and the timing-only floor run in one of the two, to
    # keep the test short.
    blocks = wrap == "blocks"
    floor = ["ours-nogather"] if blocks else []
    ddp = ["ddp"] if blocks else []
    zero2 = [] if blocks else ["ours-zero2"]
    names = ["ours", "ours-int8", "fsdp2", *ddp, *floor, *zero2]
    stdout = _run(
        "bench_train", "--size", "tiny", "--nproc", "2", "--wrap", wrap, "--steps", "3",
        "--warmup", "1", "--impls", ",".join(names), "--json-out", str(out),
        launcher=launcher, monkeypatch=monkeypatch,
    )  # fmt: skip
    summary = json.loads(out.read_text())
    theory = summary["theory_zero3_per_rank"]
    groups = {"blocks": 3, "head": 4}[wrap]  # 2 blocks + root (+ [norm, output])
    assert theory["groups"] == groups
    assert theory["reduce_scatter"] == theory["param_bytes"]  # dims divide W=2: no padding

    impls = summary["impls"]
    assert set(impls) == set(names)
    # int8 values + 4 B per 256-element block scale for every weight; the norms stay fp32.
    assert 0.25 < theory["all_gather_int8"] / theory["all_gather"] <= 0.27
    for name in ("ours", "ours-int8", "fsdp2", *floor):
        r = impls[name]
        assert r["measured_over_theory"] == {"all_gather": 1.0, "reduce_scatter": 1.0}, name
        assert r["comm_calls_per_step"] == {
            "all_gather": theory["all_gather_calls"],
            "reduce_scatter": theory["reduce_scatter_calls"],
        }, name
        assert r["comm_bytes_per_rank_equal"], name
    if zero2:  # one bucket (25 MiB), gathered once: each rank's shards out, the gradients in
        r = impls["ours-zero2"]
        assert r["comm_calls_per_step"] == {"all_gather": 1, "reduce_scatter": 1}
        shards = theory["reduce_scatter"] // 2
        assert r["comm_bytes_per_step"] == {"all_gather": shards, "reduce_scatter": 2 * shards}
    for name, r in impls.items():
        assert len(r["losses"]) == 1 + 3  # warm-up + timed, every step against the reference
        if name == "ours-int8":  # computes with quantized weights: close, not equal
            assert abs(r["final_loss_rel_diff_vs_ref"]) < 1e-2, r["final_loss_rel_diff_vs_ref"]
            assert r["max_abs_loss_diff_vs_ref"] > 0
        elif name == "ours-nogather":  # every rank computes with its own rows in every slot
            assert r["max_abs_loss_diff_vs_ref"] > 1e-3, r["max_abs_loss_diff_vs_ref"]
        else:
            assert r["max_abs_loss_diff_vs_ref"] < 1e-5, name
        assert len(r["step_ms"]["all"]) == 3, name
        assert set(r["phase_ms_median"]) == {"forward", "backward", "optimizer"}, name
        assert sum(r["phase_ms_median"].values()) > 0, name
        assert all(p > 0 for p in r["peak_bytes_per_rank"]), name
    assert set(summary["ratios"]) == {
        "ours/fsdp2",
        "ours-int8/ours",
        "ours-int8/fsdp2",
        *(f"{mine}/ddp" for mine in ("ours", "ours-int8") if ddp),
        *(f"ours-nogather/{other}" for other in ("ours", "fsdp2", *ddp) if floor),
        *(f"ours-zero2/{other}" for other in ("ours", "fsdp2") if zero2),
    }
    assert "ratio ours-int8/fsdp2: step time (median)" in stdout
    if ddp:
        assert impls["ddp"]["comm_bytes_per_step"] == {"all_reduce": theory["param_bytes"]}
        # Sharded state: the parameters plus AdamW's two moments, each split over 2 ranks, is
        # less than DDP's (parameters, moments and gradient buckets, whole on every rank).
        ddp_state = max(impls["ddp"]["state_bytes_per_rank"])
        assert max(impls["ours"]["state_bytes_per_rank"]) < ddp_state
        assert "ratio ours/ddp: step time (median)" in stdout
        assert "ratio ours-int8/ddp: step time (median)" in stdout


@needs_torch_fsdp2_on_cpu
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_bench_overhead_counts_calls_and_matches_the_floor(
    launcher: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "overhead.json"
    stdout = _run(
        "bench_overhead", "--blocks", "2", "--nproc", "1,2", "--steps", "2", "--warmup", "1",
        "--impls", "ours,fsdp2,floor,hooks", "--bucket-cap-mb", "25", "--zero2",
        "--json-out", str(out), launcher=launcher, monkeypatch=monkeypatch,
    )  # fmt: skip
    runs = json.loads(out.read_text())["runs"]
    assert [r["config"]["world"] for r in runs] == [1, 2]
    for run, floor in zip(runs, ("plain", "ddp"), strict=True):
        assert run["config"]["groups"] == 3  # 2 blocks + the root
        impls = run["impls"]
        assert set(impls) == {"ours", "ours-buckets", "ours-zero2", "fsdp2", floor, "hooks"}
        for name, r in impls.items():
            # Same weights, same batches, same averaged gradients: the floor's losses.
            assert r["max_abs_loss_diff_vs_floor"] < 1e-6, name
            assert len(r["step_ms"]["all"]) == 2, name
            calls = r["calls_per_step"]
            assert calls["total"] == calls["py"] + calls["c"] > 0, name
            phases = calls["phases"]
            assert set(phases) == {"forward", "backward", "step", "zero_grad"}, name
            assert sum(p["total"] for p in phases.values()) <= calls["total"], name
            assert phases["step"]["total"] > 0, name
            assert r["calls_per_group"] == calls["py"] / 3, name
            assert r["cpu_ms_median"] > 0, name
        assert impls[floor]["calls_over_floor_per_group"] == 0
        # The empty skeleton: 2 module hooks and, on grad, a Function and a tensor hook per block.
        assert impls["hooks"]["calls_over_floor_per_group"] > 0
        ratios = {f"ours/{floor}", f"fsdp2/{floor}", "ours/fsdp2", f"hooks/{floor}"}
        ratios |= {f"ours-buckets/{floor}", "ours-buckets/ours", f"ours-zero2/{floor}"}
        assert set(run["ratios"]) == ratios
        assert f"ratio ours/{floor}: step time (median)" in stdout


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_bench_overhead_compiles_ours_whole_with_and_without_buckets(
    launcher: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "overhead.json"
    stdout = _run(
        "bench_overhead", "--blocks", "2", "--nproc", "2", "--steps", "2", "--warmup", "1",
        "--impls", "ours,floor", "--bucket-cap-mb", "25", "--compile", "aot_eager",
        "--json-out", str(out), launcher=launcher, monkeypatch=monkeypatch,
    )  # fmt: skip
    (run,) = json.loads(out.read_text())["runs"]
    assert run["config"]["compile"] == "aot_eager"
    assert set(run["impls"]) == {"ours", "ours-buckets", "ddp"}
    for name, r in run["impls"].items():
        # Compiled whole, bucketed or not: the floor's losses.
        assert r["max_abs_loss_diff_vs_floor"] < 1e-6, name
        assert len(r["step_ms"]["all"]) == 2, name
    assert "ours compiled whole (aot_eager)" in stdout


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_bench_collectives_reports_both_versions_of_each_collective(
    launcher: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The script itself raises if TorchComm's result differs from torch's by a single bit.
    stdout = _run(
        "bench_collectives", "--nproc", "2", "--mib", "0.01,0.1", "--calls", "2",
        launcher=launcher, monkeypatch=monkeypatch,
    )  # fmt: skip
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["world"] == 2
    assert [row["shard_mib"] for row in report["rows"]] == [0.01, 0.1]
    for row in report["rows"]:
        for op in ("all_gather", "reduce_scatter"):
            assert row[f"torch {op}"] > 0 and row[f"ours {op}"] > 0
            assert row[f"{op} ours/torch"] == row[f"ours {op}"] / row[f"torch {op}"]


@needs_torch_fsdp2_on_cpu
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_device_check_passes_every_scenario_on_cpu(
    launcher: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a GPU machine runs (benchmarks/device_check.py --device cuda), on gloo ranks here:
    # every option against its reference, the int8 cost table and the verified-where rows.
    # One step each in the suite, two in the soak; the suite leaves out the compiled
    # scenarios (the graph path against eager, the unsharded model and torch: test_graph.py
    # and test_compile.py; the soak runs them here too).
    every = ["fp32", "no-reshard", "prefetch", "accum", "checkpoint", "offload", "int8"]
    every += ["torch-fp32", "torch-bf16", "hsdp", "tp", "3d", "compile", "compile-fullgraph"]
    every += ["float8", "checker", "dcp", "plan", "muon"]
    names = thinned(every, [n for n in every if not n.startswith("compile")])
    steps = "2" if FULL_MATRIX else "1"
    out, table = tmp_path / "check.json", tmp_path / "rows.md"
    stdout = _run(
        "device_check", "--device", "cpu", "--nproc", "2", "--steps", steps, "--quant-sizes",
        "4096", "--quant-worlds", "2,4", "--quant-reps", "2", "--json-out", str(out),
        "--table-out", str(table), "--only", ",".join(names), launcher=launcher,
        monkeypatch=monkeypatch,
    )  # fmt: skip
    summary = json.loads(out.read_text())
    assert summary["ok"]
    (run,) = summary["runs"]
    assert (run["backend"], run["world"], run["setup"]) == ("gloo", 2, "CPU gloo W=2")
    assert summary["options"]["scenarios"] == names
    # plan reads the CUDA allocator (N/A on CPU); every other check passes, the graph path's
    # and Muon's included
    for name, result in run["results"].items():
        if name == "plan":
            continue
        assert result["status"] == "PASS", (name, result)
        assert {"loss", "param"} <= result.keys()
    assert run["results"]["plan"]["status"] == "N/A"  # no CUDA allocator on CPU
    rows = summary["rows"]
    assert [r["check"].split(":")[0] for r in rows] == names
    assert all(r["setup"] == "CPU gloo W=2" and r["torch"] == torch.__version__ for r in rows)
    lines = table.read_text().splitlines()
    assert lines[0].startswith("device_check on CPU, torch ")
    assert len([line for line in lines if line.startswith("| ")]) == 2 + len(names)
    costs = summary["quant_costs"]
    assert [(c["shard_elems"], c["world"]) for c in costs] == [(4096, 2), (4096, 4)]
    for c in costs:
        assert c["saved_bytes"] == (c["world"] - 1) * (4 * 4096 - (4096 + 4 * 16))
        assert c["int8_in_us"] > 0 and c["int8_out_us"] > 0
    assert "break-even GB/s" in stdout


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_bench_quant_loss_compares_curves_with_the_fp32_run(
    launcher: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, png = tmp_path / "loss.json", tmp_path / "loss.png"
    stdout = _run(
        "bench_quant_loss", "--size", "tiny", "--steps", "3", "--configs", "fp32,int8",
        "--json-out", str(out), "--plot", str(png), launcher=launcher, monkeypatch=monkeypatch,
    )  # fmt: skip
    summary = json.loads(out.read_text())
    rows, curves = summary["rows"], summary["curves"]
    assert set(rows) == set(curves) == {"fp32", "int8"}
    assert all(len(c) == 3 for c in curves.values())
    assert rows["fp32"]["final_rel_diff_vs_fp32"] == 0.0
    want = (curves["int8"][-1] - curves["fp32"][-1]) / curves["fp32"][-1]
    assert rows["int8"]["final_rel_diff_vs_fp32"] == want
    assert curves["int8"] != curves["fp32"]  # the int8 run did compute with other weights
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists() and "plot skipped" in stdout


def test_bench_quant_loss_summarizes_each_config_over_seeds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("bench_quant_loss")
    # Hand-made rows for three seeds: int8 ends 2% below, 0.5% above and 0.1% below fp32.
    rows = {
        seed: {"fp32": {"final_rel_diff_vs_fp32": 0.0}, "int8": {"final_rel_diff_vs_fp32": d}}
        for seed, d in ((0, -0.02), (1, 0.005), (2, -0.001))
    }
    across = bench.across_seeds(rows)
    assert across["fp32"]["max_abs"] == 0.0 and across["fp32"]["within_1pct"] == 3
    assert across["int8"] == {
        "final_rel_diff_vs_fp32": [-0.02, -0.001, 0.005],
        "median": -0.001,
        "min": -0.02,
        "max": 0.005,
        "max_abs": 0.02,
        "within_1pct": 2,
    }


@needs_torch_fsdp2_on_cpu
@pytest.mark.skipif("fresh" not in LAUNCHERS, reason="a process per configuration (nox -s soak)")
def test_bench_compile_counts_regions_per_configuration(tmp_path: Path) -> None:
    """Each configuration in its own process (no pool: that is the point of the script);
    aot_eager, three blocks: the regions are counted, ours compiles one graph, torch's order
    compiles each block and so does ours in that order, nothing recompiles after the first
    step."""
    out = tmp_path / "compile.json"
    subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_compile.py"), "--depth", "3", "--steps", "1",
         "--compile-backend", "aot_eager", "--json-out", str(out)],
        check=True, timeout=JOB_TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    rows = {r["config"]["impl"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"ours-graph", "ours-graph-inline", "fsdp2-compiled", "ours-blocks"}
    # The first block's input needs no gradient: inlined (a region called once); the other
    # two share one region.
    assert (rows["ours-graph"]["region_bodies"], rows["ours-graph"]["region_calls"]) == (1, 2)
    assert rows["ours-graph-inline"]["region_calls"] == 0
    # torchtitan's order, ours and torch's alike: each block's own graphs, no region.
    assert rows["ours-blocks"]["region_calls"] == rows["fsdp2-compiled"]["region_calls"] == 0
    assert rows["ours-blocks"]["graphs"] == rows["fsdp2-compiled"]["graphs"]
    assert rows["ours-graph"]["graphs"] == rows["ours-graph-inline"]["graphs"] == 1
    for r in rows.values():
        assert r["first_step_s"] > 0 and r["step_ms"] > 0 and r["eager_step_ms"] > 0
        assert not r["recompiled_after_first_step"]
