"""``examples/train_llama_2d.py`` runs under torchrun (4 gloo ranks) in both of its modes.

The example trains an unsharded replica beside the 2-D model and fails (non-zero exit) if they
drift apart by more than 1e-4; here we also read the difference it prints and check that the
DCP checkpoint it writes is complete.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_llama_2d.py"


@pytest.mark.parametrize("mode", ["tp", "hsdp"])
def test_train_llama_2d_example(tmp_path: Path, mode: str) -> None:
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += [str(EXAMPLE), "--mode", mode, "--steps", "4", "--checkpoint", str(ckpt)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", done.stdout)]
    assert len(losses) == 4, done.stdout
    diff = re.search(r"max \|2-D - unsharded\| over all parameters: (\S+)", done.stdout)
    assert diff is not None, done.stdout
    assert float(diff.group(1)) <= 1e-5
    assert (ckpt / ".metadata").is_file()
