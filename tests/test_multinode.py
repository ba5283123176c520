"""Multi-node launch: ``torchrun --nnodes 2 --rdzv-backend c10d``, two "nodes" on loopback.

Two torchrun agents (one process each, ``--node-rank 0`` and ``1``) meet at a c10d rendezvous
on ``127.0.0.1:<free port>`` and run ``examples/train.py``, the script the multi-node recipe in
``docs/recipes/multi-node.md`` launches. Both agents must exit 0, their two processes must be
global ranks 0 and 1 of a world of 2 on two different nodes, and rank 0 must log every
training step. (With ``c10d`` the rendezvous, not ``--node-rank``, assigns the node ranks, so
the test does not ask which agent got which.)
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(node_rank: int, port: int, env: dict[str, str]) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--node-rank",
        str(node_rank),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"fully-shard-test-{port}",
        "--max-restarts",
        "0",
        str(REPO / "examples" / "train.py"),
        "--steps",
        "3",
    ]
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_two_nodes_on_loopback_train_together() -> None:
    port = _free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    # Node 0 hosts the rendezvous store (its address is the endpoint); node 1 joins it.
    nodes = [_torchrun(rank, port, env) for rank in (0, 1)]
    outputs = []
    try:
        for node in nodes:
            out, _ = node.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    for rank, (node, out) in enumerate(zip(nodes, outputs, strict=True)):
        assert node.returncode == 0, f"node {rank} exited with {node.returncode}:\n{out}"
    both = "".join(outputs)
    # One process per node: global ranks 0 and 1 of a world of 2, on nodes 0 and 1.
    placed = set(re.findall(r"rank (\d)/(\d) on node (\d)", both))
    assert placed == {("0", "2", "0"), ("1", "2", "1")}, both
    losses = re.findall(r"step (\d): loss (\S+)", both)
    assert [step for step, _ in losses] == ["0", "1", "2"], both
