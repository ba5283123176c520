"""Join the job ``torchrun`` started: one process group, one device per rank, one mesh.

:func:`init_distributed` is the first line of a training script. It reads torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) and picks the device the way the PyTorch ecosystem does: on a machine with an
accelerator (CUDA, XPU, ...) and at least one per local rank, rank ``LOCAL_RANK`` takes device
``LOCAL_RANK`` and the device's own backend (NCCL on CUDA); without one, gloo on the CPU. The
same script then trains on 8 GPUs under ``torchrun --nproc-per-node 8`` and on the CPU of a
laptop, unchanged. Nothing in the engine imports this module: ``fully_shard`` works on any
mesh, however it was made.

Example:
    >>> from fully_shard import fully_shard, init_distributed
    >>> job = init_distributed()  # doctest: +SKIP  (under torchrun)
    >>> model = Model().to(job.device)  # doctest: +SKIP
    >>> fully_shard(model, mesh=job.mesh)  # doctest: +SKIP
    >>> job.shutdown()  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .errors import FullyShardLaunchError, FullyShardValueError

__all__ = ["Distributed", "init_distributed", "worker_environment"]

# What torchrun sets for every worker; init_process_group's env:// rendezvous reads the first
# two and the last two, init_distributed the middle two.
_TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@dataclass(frozen=True)
class Distributed:
    """This rank's place in the job: what :func:`init_distributed` set up.

    Attributes:
        rank: this process's rank in the default process group.
        world_size: the number of ranks.
        local_rank: this process's rank on its node (``LOCAL_RANK``); the accelerator index.
        backend: the default process group's backend (``"nccl"``, ``"gloo"``, ...).
        device: where this rank's tensors live: ``cuda:<local_rank>`` or ``cpu``. Create
            models and batches here (``model.to(job.device)``, ``to_empty(device=...)``).
        mesh: a :class:`~torch.distributed.device_mesh.DeviceMesh` over every rank on
            ``device``'s type, shaped as asked (1-D ``(world_size,)`` by default).

    Example:
        >>> from fully_shard import init_distributed
        >>> job = init_distributed()  # doctest: +SKIP
        >>> job.device, job.backend  # doctest: +SKIP
        (device(type='cuda', index=3), 'nccl')
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    mesh: DeviceMesh

    def shutdown(self) -> None:
        """Wait for every rank, then destroy the default process group.

        The barrier first: a rank that tears its connections down while another still runs
        a collective makes that one fail with a connection error instead of finishing.

        Example:
            >>> job = init_distributed()  # doctest: +SKIP
            >>> ...  # train
            >>> job.shutdown()  # doctest: +SKIP
        """
        dist.barrier()
        dist.destroy_process_group()


def worker_environment(
    rank: int, world_size: int, port: int, *, agent_store: bool = False
) -> dict[str, str]:
    """What ``torchrun`` sets for worker ``rank`` of a one-machine job, for scripts that
    start their ranks themselves (``torch.multiprocessing.spawn``) and then call
    :func:`init_distributed` in each, as a ``torchrun`` worker would.

    ``port``: where the rendezvous store listens on ``127.0.0.1`` (rank 0 hosts it, or the
    parent when ``agent_store``: every rank then connects to it as a client, as under
    torchrun's agent).

    Example:
        >>> env = worker_environment(1, 2, 29500)
        >>> env["RANK"], env["LOCAL_WORLD_SIZE"], env["MASTER_PORT"]
        ('1', '2', '29500')
    """
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    if agent_store:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return env


def init_distributed(
    mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None,
    *,
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
) -> Distributed:
    """Join the job, pick this rank's device and backend, and build the mesh.

    - Launched by ``torchrun`` (or anything that sets its environment variables): joins the
      default process group with the ``env://`` rendezvous. Already joined (a notebook, a test
      harness, a script that called ``init_process_group`` itself): keeps that group and its
      backend, and only builds the mesh.
    - Device: with an accelerator (``torch.accelerator``) and at least ``LOCAL_WORLD_SIZE``
      devices on this node, device ``LOCAL_RANK`` and its default backend (NCCL on CUDA, XCCL
      on XPU); without an accelerator, the CPU and gloo.
    - ``backend="gloo"`` forces the CPU on a machine with GPUs (a debugging run, more ranks
      than GPUs); any other backend names the accelerator's (``"nccl"``), or a mixed one
      (``"cpu:gloo,cuda:nccl"``) that still puts tensors on the accelerator.

    Args:
        mesh_shape: ranks along each mesh dimension; their product must be the world size.
            ``None``: 1-D ``(world_size,)``.
        mesh_dim_names: a name per mesh dimension (``("dp_replicate", "dp_shard")``).
        backend: the process group's backend; ``None`` picks it from the device.
        timeout: how long a collective may wait before the job fails (torch's default if
            ``None``); ignored when the group already exists.

    Returns:
        This rank's :class:`Distributed`; call its ``shutdown()`` at the end.

    Raises:
        FullyShardValueError: a mesh shape that does not multiply to the world size, names that
            do not match it, or a backend that differs from the existing group's (raised before
            anything is initialized).
        FullyShardLaunchError: torchrun's variables are missing, or this node has fewer
            accelerators than local ranks.

    Example:
        Under ``torchrun --nproc-per-node 8 train.py`` on a node with 8 GPUs every rank gets its
        own GPU and NCCL; the same script on a laptop gets gloo on the CPU::

            >>> from fully_shard import fully_shard, init_distributed
            >>> job = init_distributed()  # doctest: +SKIP
            >>> model = Model().to(job.device)  # doctest: +SKIP
            >>> fully_shard(model, mesh=job.mesh)  # doctest: +SKIP
            >>> hsdp = init_distributed((2, 8), ("replicate", "shard"))  # doctest: +SKIP
    """
    joined = dist.is_available() and dist.is_initialized()
    env = os.environ
    if joined:
        world_size, rank = dist.get_world_size(), dist.get_rank()
    else:
        missing = [name for name in _TORCHRUN_ENV if name not in env]
        if missing:
            raise FullyShardLaunchError(
                f"init_distributed: {', '.join(missing)} not set; launch the script with "
                "torchrun (`torchrun --standalone --nproc-per-node 2 train.py`), which sets "
                "them, or set them yourself (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, "
                "MASTER_ADDR, MASTER_PORT) for every process"
            )
        world_size, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    shape = _check_mesh(mesh_shape, mesh_dim_names, world_size)
    local_rank = int(env.get("LOCAL_RANK", rank))
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
    if joined:
        existing = str(dist.get_backend())
        # "undefined": init_process_group() was called without a backend and torch made one
        # per device type it found (gloo for CPU tensors, NCCL for CUDA ones): pick as usual.
        if existing != "undefined" and backend is not None and backend != existing:
            raise FullyShardValueError(
                f"init_distributed(backend={backend!r}): the default process group already "
                f"exists with backend {existing!r}; drop the argument to use that group, or "
                "destroy it first (dist.destroy_process_group())"
            )
        if existing != "undefined":
            backend = existing
    device = _pick_device(backend, local_rank, local_world_size)
    if backend is None:
        backend = _default_backend(device)
    if device.type != "cpu":
        torch.get_device_module(device.type).set_device(device)
    if not joined:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=mesh_dim_names)
    return Distributed(rank, world_size, local_rank, backend, device, mesh)


def _check_mesh(
    mesh_shape: tuple[int, ...] | None, names: tuple[str, ...] | None, world_size: int
) -> tuple[int, ...]:
    """The mesh shape to build, or a clear error (before any process group exists)."""
    shape = (world_size,) if mesh_shape is None else tuple(mesh_shape)
    if not shape or any(not isinstance(n, int) or n < 1 for n in shape):
        raise FullyShardValueError(
            f"init_distributed: mesh_shape={mesh_shape!r} must be a non-empty tuple of positive "
            f"ints, e.g. ({world_size},) or (2, {max(1, world_size // 2)})"
        )
    if math.prod(shape) != world_size:
        raise FullyShardValueError(
            f"init_distributed: mesh_shape={shape} holds {math.prod(shape)} ranks but the job "
            f"has {world_size} (WORLD_SIZE); pass a shape whose product is {world_size}, or "
            "launch that many processes"
        )
    if names is not None and len(names) != len(shape):
        raise FullyShardValueError(
            f"init_distributed: mesh_dim_names={names!r} names {len(names)} dimension(s) but "
            f"mesh_shape={shape} has {len(shape)}; give one name per dimension"
        )
    return shape


def _accelerator() -> torch.device | None:
    """This machine's accelerator type (``cuda``, ``xpu``, ...), or ``None``."""
    accel = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accel is not None:
        found = accel.current_accelerator() if accel.is_available() else None
        return None if found is None else torch.device(found.type)
    return torch.device("cuda") if torch.cuda.is_available() else None


def _device_count(device_type: str) -> int:
    accel = getattr(torch, "accelerator", None)
    if accel is not None:
        return int(accel.device_count())
    return int(torch.get_device_module(device_type).device_count())


def _default_backend(device: torch.device) -> str:
    """The backend torch pairs with ``device``'s type: gloo on CPU, NCCL on CUDA, ..."""
    pick = getattr(dist, "get_default_backend_for_device", None)  # torch >= 2.7
    if pick is not None:
        return str(pick(device))
    known: Mapping[str, str] = {"cpu": "gloo", "cuda": "nccl"}
    if device.type not in known:
        raise FullyShardLaunchError(
            f"init_distributed: no default backend known for {device.type!r} on torch "
            f"{torch.__version__}; pass backend= explicitly"
        )
    return known[device.type]


def _pick_device(backend: str | None, local_rank: int, local_world_size: int) -> torch.device:
    """``cuda:<local_rank>`` (or the accelerator's type) or ``cpu``, for ``backend``."""
    cpu = torch.device("cpu")
    if backend is not None and all(b.split(":")[-1] == "gloo" for b in backend.split(",")):
        return cpu  # "gloo" or "cpu:gloo", asked for or the existing group's: only CPU tensors
    accel = _accelerator()
    if accel is None or (backend is None and _default_backend(accel) == "gloo"):
        if backend is not None:
            raise FullyShardLaunchError(
                f"init_distributed(backend={backend!r}) needs an accelerator and this machine "
                "has none (torch.accelerator.is_available() is False); use backend='gloo' or "
                "leave backend out to train on the CPU"
            )
        return cpu  # no accelerator, or one no collective backend drives (MPS): the CPU
    count = _device_count(accel.type)
    if count < local_world_size:
        raise FullyShardLaunchError(
            f"init_distributed: {local_world_size} ranks on this node (LOCAL_WORLD_SIZE) but "
            f"only {count} {accel.type} device(s): one device per rank is needed. Launch at "
            f"most {count} processes per node (torchrun --nproc-per-node {count}), or pass "
            "backend='gloo' to run every rank on the CPU"
        )
    return torch.device(accel.type, local_rank)
