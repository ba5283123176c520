"""``init_distributed``: which device, backend and mesh each machine gets, and the errors.

A GPU node is faked honestly on this CPU machine: ``torch.accelerator`` reports CUDA devices,
and the calls that would touch them (``set_device``, ``init_process_group``,
``init_device_mesh``) are replaced by recorders, so each test checks what would be called with
what. The last tests run on the warm 2-rank pool, where the group already exists.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import fully_shard.launch as launch
from fully_shard import FullyShardLaunchError, FullyShardValueError, init_distributed
from harness import run_distributed

TORCHRUN_ENV = {
    "RANK": "11",
    "WORLD_SIZE": "16",
    "LOCAL_RANK": "3",
    "LOCAL_WORLD_SIZE": "8",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}


class Machine:
    """What a node looks like to ``init_distributed``, and what it asked the node to do."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
        self.calls: list[tuple[str, Any]] = []
        for name, value in TORCHRUN_ENV.items():
            monkeypatch.setenv(name, value)
        accel = torch.accelerator
        monkeypatch.setattr(accel, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(
            accel, "current_accelerator", lambda: torch.device("cuda") if gpus else None
        )
        monkeypatch.setattr(accel, "device_count", lambda: gpus)
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        monkeypatch.setattr(torch.cuda, "set_device", self._record("set_device"))
        monkeypatch.setattr(dist, "init_process_group", self._record("init_process_group"))
        monkeypatch.setattr(launch, "init_device_mesh", self._record("init_device_mesh"))

    def _record(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> str:
            self.calls.append((name, (args, kwargs)))
            return f"<{name}>"

        return record


def test_a_gpu_node_gives_each_local_rank_its_gpu_and_nccl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = Machine(monkeypatch, gpus=8)
    d = init_distributed((2, 8), ("replicate", "shard"))
    assert (d.rank, d.world_size, d.local_rank) == (11, 16, 3)
    assert (d.backend, d.device) == ("nccl", torch.device("cuda", 3))
    assert node.calls == [
        ("set_device", ((torch.device("cuda", 3),), {})),
        ("init_process_group", (("nccl",), {"init_method": "env://", "timeout": None})),
        ("init_device_mesh", (("cuda", (2, 8)), {"mesh_dim_names": ("replicate", "shard")})),
    ]


@pytest.mark.parametrize(
    ("gpus", "backend", "device"),
    [
        (0, None, "cpu"),  # no accelerator: gloo on the CPU
        (8, "gloo", "cpu"),  # asked for on a GPU node
        (8, "cpu:gloo", "cpu"),  # a per-device backend string naming gloo only
        (8, "cpu:gloo,cuda:nccl", "cuda:3"),  # one naming the accelerator's too
    ],
)
def test_the_backend_decides_between_cpu_and_gpu(
    monkeypatch: pytest.MonkeyPatch, gpus: int, backend: str | None, device: str
) -> None:
    node = Machine(monkeypatch, gpus=gpus)
    d = init_distributed(backend=backend)
    assert (d.backend, d.device) == (backend or "gloo", torch.device(device))
    assert node.calls[-2][1][0][0] == (backend or "gloo")  # init_process_group's backend
    assert node.calls[-1][1][0] == (torch.device(device).type, (16,))  # the mesh


@pytest.mark.parametrize(
    ("gpus", "kwargs", "error", "says"),
    [
        (4, {}, FullyShardLaunchError, r"only 4 cuda device.*--nproc-per-node 4.*backend='gloo'"),
        (0, {"backend": "nccl"}, FullyShardLaunchError, r"needs an accelerator"),
        (8, {"mesh_shape": (3, 5)}, FullyShardValueError, r"holds 15 ranks but the job has 16"),
        (8, {"mesh_shape": (0, 16)}, FullyShardValueError, r"tuple of positive ints"),
        (8, {"mesh_shape": (16,), "mesh_dim_names": ("a", "b")}, FullyShardValueError, r"one name"),
    ],
)
def test_bad_launches_raise_before_anything_is_initialized(
    monkeypatch: pytest.MonkeyPatch, gpus: int, kwargs: dict[str, Any], error: type, says: str
) -> None:
    node = Machine(monkeypatch, gpus=gpus)
    with pytest.raises(error, match=says):
        init_distributed(**kwargs)
    assert node.calls == []


def test_a_script_started_without_torchrun_is_told_how_to_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = Machine(monkeypatch, gpus=0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(FullyShardLaunchError, match=r"LOCAL_WORLD_SIZE, MASTER_PORT not set.*"):
        init_distributed()
    assert node.calls == []


def _join_the_existing_group() -> tuple[Any, ...]:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("init_process_group called on an initialized group")

    dist.init_process_group, real = refuse, dist.init_process_group  # type: ignore[assignment]
    try:
        d = init_distributed()
        hsdp = init_distributed((1, 2), ("replicate", "shard"))
        try:
            init_distributed(backend="nccl")
            mismatch = ""
        except FullyShardValueError as e:
            mismatch = str(e)
    finally:
        dist.init_process_group = real
    return (
        d.rank,
        d.backend,
        str(d.device),
        d.mesh.device_type,
        tuple(d.mesh.shape),
        hsdp.mesh.mesh_dim_names,
        mismatch,
    )


def test_an_existing_group_is_reused_with_its_backend() -> None:
    results = run_distributed(_join_the_existing_group, 2, timeout=60)
    for rank, (r, backend, device, mesh_type, shape, names, mismatch) in enumerate(results):
        assert (r, backend, device, mesh_type, shape) == (rank, "gloo", "cpu", "cpu", (2,))
        assert names == ("replicate", "shard")
        assert "already exists with backend 'gloo'" in mismatch
