"""Mesh info: which mesh dim shards, which replicates (HSDP), their groups and the device.

A 1-D mesh shards over its only dim. A 2-D mesh is read as ``(replicate, shard)``: parameters
are placed ``(Replicate(), Shard(d))``, gradients are reduce-scattered over the shard dim and
all-reduced over the replicate dim (HSDP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

from .errors import FullyShardStateError, FullyShardTypeError, FullyShardValueError


@dataclass(frozen=True)
class MeshInfo:
    """The data-parallel view of a ``DeviceMesh``.

    Attributes:
        mesh: the mesh the sharded DTensors live on.
        shard_mesh_dim: the mesh dim parameters are sharded over (the last one).
        replicate_mesh_dim: the mesh dim parameters are replicated over (HSDP), or ``None``.
        device: the compute device: where all-gathers, forward and backward run.

    Example:
        >>> info = mesh_info(init_device_mesh("cpu", (2,)))  # doctest: +SKIP
        >>> info.shard_size, info.replicate_size  # doctest: +SKIP
        (2, 1)
    """

    mesh: DeviceMesh
    shard_mesh_dim: int
    replicate_mesh_dim: int | None
    device: torch.device

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.shard_mesh_dim)

    @property
    def shard_size(self) -> int:
        return int(self.mesh.size(self.shard_mesh_dim))

    @property
    def shard_rank(self) -> int:
        return int(self.mesh.get_local_rank(self.shard_mesh_dim))

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        if self.replicate_mesh_dim is None:
            return None
        return self.mesh.get_group(self.replicate_mesh_dim)

    @property
    def replicate_size(self) -> int:
        if self.replicate_mesh_dim is None:
            return 1
        return int(self.mesh.size(self.replicate_mesh_dim))

    @property
    def dp_size(self) -> int:
        """How many ranks a gradient is averaged over: shard size times replicate size."""
        return self.shard_size * self.replicate_size

    def placements(self, shard_dim: int) -> tuple[Placement, ...]:
        """The DTensor placements of a parameter sharded on tensor dim ``shard_dim``."""
        if self.replicate_mesh_dim is None:
            return (Shard(shard_dim),)
        return (Replicate(), Shard(shard_dim))


def _device_of(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    # One process per accelerator: torchrun sets the current device (or LOCAL_RANK) per rank.
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the default process group, on CUDA when the backend is NCCL.

    Example:
        >>> mesh = default_mesh()  # doctest: +SKIP  (needs torch.distributed initialised)
    """
    if not dist.is_available() or not dist.is_initialized():
        raise FullyShardStateError(
            "fully_shard(mesh=None) needs torch.distributed to be initialised: launch the ranks "
            "with `torchrun --nproc-per-node N script.py` and call "
            "`torch.distributed.init_process_group()` (backend 'gloo' on CPU, 'nccl' on GPU) "
            "before fully_shard, or pass mesh=init_device_mesh(...)"
        )
    backend = str(dist.get_backend()).lower()
    device_type = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def mesh_info(mesh: object) -> MeshInfo:
    """Check ``mesh`` and read off its data-parallel dims (1-D: shard; 2-D: replicate, shard)."""
    if not isinstance(mesh, DeviceMesh):
        raise FullyShardTypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; "
            "build one with init_device_mesh('cpu' or 'cuda', (world_size,))"
        )
    if mesh.ndim == 1:
        return MeshInfo(mesh, shard_mesh_dim=0, replicate_mesh_dim=None, device=_device_of(mesh))
    if mesh.ndim == 2:
        return MeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0, device=_device_of(mesh))
    raise FullyShardValueError(
        f"mesh must be 1-D (shard) or 2-D (replicate, shard) for fully_shard, got a {mesh.ndim}-D "
        f"mesh of shape {tuple(mesh.shape)}; for tensor parallelism pass the data-parallel "
        'sub-mesh, e.g. mesh["dp"]'
    )
