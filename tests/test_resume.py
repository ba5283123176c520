"""Resume with nothing lost: kill ranks, restart, and match an uninterrupted run.

``examples/train_resumable.py`` runs three times in a row, as ``torchrun --max-restarts 2``
would start it, with two planned deaths: on the first attempt rank 1 dies in the middle of
saving the step-6 checkpoint (its shards are written, the checkpoint is not yet renamed
complete), so the second attempt must resume from step 3, not from the incomplete step 6; on
the second attempt rank 0 dies mid-step 8, after the step-6 checkpoint was completed, so the
third attempt resumes from step 6. The final parameters must equal, bit for bit, those of the
same training run without checkpoints or deaths (fp32, deterministic data, restored RNG).

How it is launched. On the warm 2-rank pool of ``harness.py``, each attempt runs the example's
``main()`` in both ranks with the environment torchrun gives attempt ``n``
(``TORCHELASTIC_RESTART_COUNT``); a planned death ends its rank's process (``os._exit``), the
pool stops the other rank, as torchrun's agent does, and starts two new ones for the next
attempt. ``FULLY_SHARD_LAUNCHERS=pool,fresh`` (``nox -s soak``) also runs it under
``torchrun --max-restarts 2`` itself, whose agent restarts the ranks.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fully_shard import init_distributed
from harness import RankError, fresh_pool, run_distributed

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_resumable.py"
STEPS, EVERY = 10, 3
CRASHES = ("0:1:6:save", "1:0:8:step")  # attempt:rank:step:when (the example's --crash)
LAUNCHERS = tuple(os.environ.get("FULLY_SHARD_LAUNCHERS", "pool").split(","))
TORCHRUN_TIMEOUT_S = 300
ATTEMPT_TIMEOUT_S = 120


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_resumable", EXAMPLE)
    if spec is None or spec.loader is None:
        raise ImportError(EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_resumable", module)
    spec.loader.exec_module(module)
    return module


def _uninterrupted() -> dict[str, torch.Tensor]:
    example = _example()
    job = init_distributed()  # the pool's group, kept
    return example.train(example.Config(steps=STEPS, ckpt_every=EVERY), job)  # type: ignore[no-any-return]


def _attempt(attempt: int, argv: list[str], log: str) -> None:
    """Inside a rank: the example's ``main()`` as torchrun's attempt ``attempt`` runs it.

    It prints into ``<log>.rank<r>``, a file: a rank that dies mid-attempt keeps what it
    printed (with ``flush=True``) before. The process group is the pool's: the example's
    ``init_process_group`` and ``destroy_process_group`` calls are no-ops, and its store is
    the pool's (the agent's store, as torchrun hosts it by default), seen through the
    example's per-attempt prefix.
    """
    env = {"TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with (
        open(f"{log}.rank{dist.get_rank()}", "w") as out,
        mock.patch.dict(os.environ, env),
        mock.patch.object(sys, "argv", [str(EXAMPLE), *argv]),
        mock.patch.object(dist, "init_process_group"),
        mock.patch.object(dist, "destroy_process_group"),
        contextlib.redirect_stdout(out),
    ):
        _example().main()


def _on_pool(argv: list[str], logs: Path) -> list[str]:
    """The three attempts on the warm pool; every line that each rank printed, in order."""
    fresh_pool(2)  # its ranks get killed: none may hold an earlier job's compile semaphores
    lines = []
    for attempt in range(3):
        log = str(logs / f"attempt{attempt}")
        crash = [c for c in CRASHES if c.startswith(f"{attempt}:")]
        if crash:
            rank = int(crash[0].split(":")[1])
            with pytest.raises(RankError) as info:
                run_distributed(_attempt, 2, attempt, argv, log, timeout=ATTEMPT_TIMEOUT_S)
            died = info.value.failures[rank]
            assert (died.type_name, died.message) == (
                "ProcessDied",
                "worker process exited with code 1",
            ), str(info.value)
        else:
            run_distributed(_attempt, 2, attempt, argv, log, timeout=ATTEMPT_TIMEOUT_S)
        for rank in range(2):
            lines += Path(f"{log}.rank{rank}").read_text().splitlines()
    return lines


def _under_torchrun(argv: list[str], cwd: Path) -> list[str]:
    """The example under ``torchrun --max-restarts 2``; what its ranks printed."""
    env = dict(os.environ)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port picked by the rendezvous, never a fixed one
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--monitor-interval",
        "0.2",
        str(EXAMPLE),
        *argv,
    ]
    proc = subprocess.run(
        cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_killed_ranks_resume_from_the_last_complete_checkpoint(
    launcher: str, tmp_path: Path
) -> None:
    out = tmp_path / "final.pt"
    argv = [f"--steps={STEPS}", f"--ckpt-every={EVERY}", f"--ckpt-dir={tmp_path / 'ckpt'}"]
    argv += [f"--out={out}", *(f"--crash={c}" for c in CRASHES)]
    lines = _on_pool(argv, tmp_path) if launcher == "pool" else _under_torchrun(argv, tmp_path)
    events = [line for line in lines if line.startswith("[rank")]
    assert events == [
        "[rank 1] crashing at step 6 during save",
        "[rank 0] ignoring incomplete checkpoint step_000006.partial",
        "[rank 0] resumed from step_000003",
        "[rank 0] crashing at step 8 during step",
        "[rank 0] resumed from step_000006",
        "[rank 0] finished 10 steps",
    ], "\n".join(lines)
    resumed = torch.load(out, weights_only=True)
    reference = run_distributed(_uninterrupted, 2, timeout=120)[0]
    assert resumed.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(resumed[name], value), f"{name} differs after resuming"
    # and training did move them: an unchanged model would match trivially
    example = _example()
    torch.manual_seed(0)
    initial = dict(example.Net().named_parameters())
    assert all(not torch.equal(initial[n].detach(), v) for n, v in reference.items())
