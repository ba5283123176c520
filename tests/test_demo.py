"""The demo: what its summary promises, and one run the way a user runs it.

Each run checks what the summary promises: the measured bytes of every collective equal the
formula for them, every rank reports its memory, and ``--trace`` writes a Chrome trace with
every kind of event for every group on every rank (and the PNG when matplotlib is installed).
The one-rank run is ``python -m fully_shard.demo`` in a fresh process (its launcher, a spawned
rank and the exit code included: the fewest interpreters that start). The others run the same
command line's ``demo.train`` on the warm pool of ``harness.py``, which is all a rank of the
demo does between joining and leaving its process group; ``FULLY_SHARD_LAUNCHERS=pool,fresh``
(``nox -s soak``) also runs them in a fresh process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from unittest import mock

import pytest
import torch

import fully_shard
from fully_shard import demo, init_distributed
from harness import run_distributed

KINDS = {"forward", "backward", "unshard", "reshard", "all_gather", "reduce_scatter"}
LAUNCHERS = tuple(os.environ.get("FULLY_SHARD_LAUNCHERS", "pool").split(","))


def _run_demo(*args: str, timeout: float = 180) -> str:
    src = str(Path(fully_shard.__file__).parents[1])  # the copy under test, not an install
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "fully_shard.demo", *args, "--timeout", str(timeout - 30)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _train_rank(cfg: demo.DemoConfig) -> str:
    """Inside a pool rank: the demo's training and summary; what the rank printed.

    Without tqdm (the progress falls back to plain lines): tqdm's bar takes a
    multiprocessing lock, a named semaphore that would outlive this job in the pool's process
    and be reported leaked at the end of the session if that process is ever killed. The
    fresh-process run below shows the bar.
    """
    out = io.StringIO()
    with (
        mock.patch.dict(sys.modules, {"tqdm": None}),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(out),
    ):
        demo.train(init_distributed(), cfg)  # the pool's group, kept
    return out.getvalue()


def _demo(launcher: str, *args: str, timeout: float = 180) -> str:
    """The demo's command line ``args``: what rank 0 printed, on ``--nproc`` pool ranks
    (``launcher="pool"``) or in a fresh process (``"fresh"``)."""
    if launcher == "fresh":
        return _run_demo(*args, timeout=timeout)
    cfg = demo.parse_args(args)
    return run_distributed(_train_rank, cfg.nproc, cfg, timeout=timeout)[0]  # type: ignore[no-any-return]


def _measured_and_theory(out: str, op: str) -> tuple[int, int]:
    match = re.search(rf"{op}\s+measured\s+([\d,]+) B\s+theory\s+([\d,]+) B", out)
    assert match, out
    measured, theory = (int(g.replace(",", "")) for g in match.groups())
    return measured, theory


def _check_summary(out: str, nproc: int) -> None:
    for op in ("all-gather", "reduce-scatter"):
        measured, theory = _measured_and_theory(out, op)
        assert measured == theory, f"{op}: measured {measured} B, formula {theory} B"
        # One rank sends nothing (the engine's one-rank path issues no collective).
        assert (theory == 0) == (nproc == 1), f"{op}: {theory} B on {nproc} rank(s)"
    for rank in range(nproc):
        assert re.search(rf"rank {rank}: .* sharded .* unsharded replica \(\d+%\)", out), out
    assert re.search(r"loss\s+\d+\.\d+ -> \d+\.\d+ over \d+ steps", out), out


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_demo_with_trace_in_mixed_precision_on_uneven_shards(launcher: str, tmp_path: Path) -> None:
    # W = 3 leaves uneven dim-0 shards (64 rows), so the formula's padding is checked too.
    out = _demo(
        launcher,
        "--nproc", "3", "--size", "tiny", "--steps", "2", "--sample", "4", "--mixed-precision",
        "--trace", str(tmp_path),
    )  # fmt: skip
    _check_summary(out, nproc=3)
    assert "bf16" in out and "2 per block" in out

    data = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    groups = {"root"} | {f"layers.{i}" for i in range(demo.SIZES["tiny"].n_layers)}
    for rank in range(3):
        for group in groups:
            kinds = {e["cat"] for e in spans if e["pid"] == rank and e["args"]["group"] == group}
            assert kinds == KINDS, f"rank {rank}, {group}: {sorted(kinds)}"
    png = tmp_path / "memory.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists() and "plot skipped" in out


def test_demo_on_one_rank_without_reshard() -> None:
    out = _run_demo(
        "--nproc", "1", "--size", "tiny", "--steps", "1", "--sample", "0", "--no-reshard"
    )
    _check_summary(out, nproc=1)
    assert "reshard_after_forward=False" in out and "1 per group" in out
    assert "W = 1: one rank sends nothing" in out


def test_expected_comm_bytes_by_hand() -> None:
    # (5, 3) on 2 ranks: ceil(5/2) = 3 rows of 3 -> 9 elements per rank; (4,) -> 2 elements.
    got = demo.expected_comm_bytes(
        [([torch.Size([5, 3])], 2), ([torch.Size([4])], 1)], world=2, param_bytes=2, reduce_bytes=4
    )
    assert got.all_gather == 2 * 9 * 2 + 1 * 2 * 2
    assert got.reduce_scatter == 2 * 9 * 4 + 2 * 2 * 4
    assert got.total == got.all_gather + got.reduce_scatter


def test_expected_comm_bytes_with_int8_all_gathers_by_hand() -> None:
    # (40, 30) on 2 ranks: 20 rows of 30 -> 600 elements per rank, quantized in blocks of 256
    # (600 int8 values + 3 scales); (40,) is 1-D: 20 fp32 elements, unquantized.
    policy = fully_shard.QuantizationPolicy(all_gather="int8", block_size=256)
    got = demo.expected_comm_bytes(
        [([torch.Size([40, 30]), torch.Size([40])], 2)], 2, 4, 4, quantization=policy
    )
    assert (got.int8_values, got.int8_scales) == (2 * 600, 2 * 3 * 4)
    assert got.all_gather == 2 * (600 + 3 * 4) + 2 * 20 * 4
    assert got.reduce_scatter == 2 * (600 + 20) * 4  # gradients are not quantized


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_demo_with_int8_all_gathers_counts_their_bytes(launcher: str) -> None:
    out = _demo(launcher, "--nproc", "2", "--size", "tiny", "--steps", "2", "--sample", "4",
                "--quantize-all-gather")  # fmt: skip
    _check_summary(out, nproc=2)
    assert "all-gather=int8, blocks of 256" in out
    values, scales, plain = (
        int(g.replace(",", ""))
        for g in re.search(
            r"int8 values ([\d,]+) B, fp32 scales ([\d,]+) B, unquantized ([\d,]+) B", out
        ).groups()  # type: ignore[union-attr]
    )
    measured, theory = _measured_and_theory(out, "all-gather")
    assert measured == theory == values + scales + plain and values > 10 * plain


def test_the_bundled_text_ships_inside_the_package() -> None:
    path = Path(fully_shard.__file__).parent / demo.TEXT_RESOURCE
    text = demo.load_text()
    assert path.is_file() and text == path.read_text(encoding="utf-8")
    assert len(text) > 20_000 and "Shall I compare thee to a summer's day?" in text


def test_seed_reaches_the_config() -> None:
    assert demo.parse_args([]).seed == 0  # the seed every documented number was taken with
    assert demo.parse_args(["--seed", "3"]).seed == 3


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--nproc", "0"], "--nproc must be at least 1"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--size", "huge"], "invalid choice"),
    ):
        with pytest.raises(SystemExit):
            demo.parse_args(argv)
        assert message in capsys.readouterr().err


def test_progress_without_tqdm_prints_plain_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    progress = demo._Progress(total=20, enabled=True)
    for step in range(20):
        progress.update(step, loss=1.0 / (step + 1), step_ms=5.0)
    progress.close()
    lines = capsys.readouterr().out.splitlines()
    assert "pip install tqdm" in lines[0]
    steps = [int(m.group(1)) for line in lines if (m := re.match(r"step\s+(\d+)/20", line))]
    assert steps == [1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20]


def test_progress_bar_starts_no_thread(capsys: pytest.CaptureFixture[str]) -> None:
    """tqdm's monitor thread stays off: nothing of the bar is alive at interpreter exit."""
    pytest.importorskip("tqdm")
    before = {t.ident for t in threading.enumerate()}
    progress = demo._Progress(total=3, enabled=True)
    for step in range(3):
        progress.update(step, loss=1.0, step_ms=5.0)
    started = {t.name for t in threading.enumerate() if t.ident not in before}
    progress.close()
    assert progress.bar is not None and started == set()
    assert "training" in capsys.readouterr().out
