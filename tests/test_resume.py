"""Resume with nothing lost: kill ranks under torchrun, restart, and match an uninterrupted run.

``examples/train_resumable.py`` runs under ``torchrun --max-restarts 2`` with two planned
deaths: on the first attempt rank 1 dies in the middle of saving the step-6 checkpoint (its
shards are written, the checkpoint is not yet renamed complete), so the second attempt must
resume from step 3, not from the incomplete step 6; on the second attempt rank 0 dies mid-step
8, after the step-6 checkpoint was completed, so the third attempt resumes from step 6. The
final parameters must equal, bit for bit, those of the same training run without checkpoints
or deaths (fp32, deterministic data, restored RNG).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

from fully_shard import init_distributed
from harness import run_distributed

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_resumable.py"
STEPS, EVERY = 10, 3
TORCHRUN_TIMEOUT_S = 300


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


def test_killed_ranks_resume_from_the_last_complete_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "final.pt"
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
        f"--steps={STEPS}",
        f"--ckpt-every={EVERY}",
        f"--ckpt-dir={tmp_path / 'ckpt'}",
        f"--out={out}",
        "--crash=0:1:6:save",
        "--crash=1:0:8:step",
    ]
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S, check=False
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    events = [line for line in proc.stdout.splitlines() if line.startswith("[rank")]
    assert events == [
        "[rank 1] crashing at step 6 during save",
        "[rank 0] ignoring incomplete checkpoint step_000006.partial",
        "[rank 0] resumed from step_000003",
        "[rank 0] crashing at step 8 during step",
        "[rank 0] resumed from step_000006",
        "[rank 0] finished 10 steps",
    ], log
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
