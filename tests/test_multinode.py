"""``examples/train.py`` under ``torchrun``, launched as a user launches it.

- ``nodes=2`` (the suite): ``torchrun --nnodes 2 --rdzv-backend c10d``, two "nodes" on
  loopback. Two torchrun agents (one process each, ``--node-rank 0`` and ``1``) meet at a c10d
  rendezvous on ``127.0.0.1:<free port>``, as the multi-node recipe in
  ``docs/recipes/multi-node.md`` launches. Both agents must exit 0, their two processes must
  be global ranks 0 and 1 of a world of 2 on two different nodes, and rank 0 must log every
  training step. (With ``c10d`` the rendezvous, not ``--node-rank``, assigns the node ranks,
  so the test does not ask which agent got which.)
- ``nodes=1`` (``nox -s soak``): the README's ``torchrun --standalone --nproc-per-node 2``.
  The suite's launch of ``train.py`` is the two-node one, which goes through the same
  ``init_distributed`` from torchrun's environment; every other example runs on the warm pool
  (``test_docs.py``).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from matrix import thinned

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(nodes: int, node_rank: int, port: int, env: dict[str, str]) -> subprocess.Popen[str]:
    if nodes == 1:
        launch = ["--standalone", "--nproc-per-node", "2"]  # a rendezvous on a free local port
    else:
        launch = ["--nnodes", str(nodes), "--nproc-per-node", "1", "--node-rank", str(node_rank)]
        launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        launch += ["--rdzv-id", f"fully-shard-test-{port}", "--max-restarts", "0"]
    command = [sys.executable, "-m", "torch.distributed.run", *launch]
    command += [str(REPO / "examples" / "train.py"), "--steps", "3"]
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.parametrize("nodes", thinned([1, 2], [2]), ids=lambda n: f"nodes={n}")
def test_train_example_runs_under_torchrun(nodes: int) -> None:
    port = _free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    # With two nodes, node 0 hosts the rendezvous store (its address is the endpoint); node 1
    # joins it.
    agents = [_torchrun(nodes, rank, port, env) for rank in range(nodes)]
    outputs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.communicate()
    for rank, (agent, out) in enumerate(zip(agents, outputs, strict=True)):
        assert agent.returncode == 0, f"agent {rank} exited with {agent.returncode}:\n{out}"
    both = "".join(outputs)
    # Global ranks 0 and 1 of a world of 2: on nodes 0 and 1, or both on node 0.
    placed = set(re.findall(r"rank (\d)/(\d) on node (\d)", both))
    expected = {("0", "2", "0"), ("1", "2", "1" if nodes == 2 else "0")}
    assert placed == expected, both
    losses = re.findall(r"step (\d): loss (\S+)", both)
    assert [step for step, _ in losses] == ["0", "1", "2"], both
