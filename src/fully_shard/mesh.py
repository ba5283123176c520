"""Mesh info: which mesh dim shards, which replicates (HSDP), their groups and the device.

A 1-D mesh shards over its only dim. A 2-D mesh is read as ``(replicate, shard)``: parameters
are placed ``(Replicate(), Shard(d))``, gradients are reduce-scattered over the shard dim and
all-reduced over the replicate dim (HSDP).

``reshard_after_forward=n``: :func:`post_forward_subgroup` splits the shard ranks into groups
of n consecutive ones (node-local ranks when n is the number of devices per node) and creates
their process groups, once per mesh.

Tensor parallelism: a parameter that is already a DTensor on ``root["tp"]`` is sharded again
on ``root["dp"]`` (the mesh given to ``fully_shard``). Its sharded DTensor lives on ``root``
with one placement per root dim; :func:`tp_layout` checks the meshes and
:func:`combined_placements` writes the placements so that ``full_tensor()`` is exact.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ._compat import root_mesh, strided_shard, strided_shard_handles_uneven
from .errors import (
    FullyShardNotImplementedError,
    FullyShardStateError,
    FullyShardTypeError,
    FullyShardValueError,
)


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

    # The groups, sizes and ranks below are read on every unshard and reduction; a mesh never
    # changes, so each is looked up once (cached_property writes the instance dict directly,
    # which a frozen dataclass allows).

    @functools.cached_property
    def shard_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.shard_mesh_dim)

    @functools.cached_property
    def shard_size(self) -> int:
        return int(self.mesh.size(self.shard_mesh_dim))

    @functools.cached_property
    def shard_rank(self) -> int:
        return int(self.mesh.get_local_rank(self.shard_mesh_dim))

    @functools.cached_property
    def replicate_group(self) -> dist.ProcessGroup | None:
        if self.replicate_mesh_dim is None:
            return None
        return self.mesh.get_group(self.replicate_mesh_dim)

    @functools.cached_property
    def replicate_size(self) -> int:
        if self.replicate_mesh_dim is None:
            return 1
        return int(self.mesh.size(self.replicate_mesh_dim))

    @functools.cached_property
    def dp_size(self) -> int:
        """How many ranks a gradient is averaged over: shard size times replicate size."""
        return self.shard_size * self.replicate_size

    def placements(self, shard_dim: int) -> tuple[Placement, ...]:
        """The DTensor placements of a parameter sharded on tensor dim ``shard_dim``."""
        if self.replicate_mesh_dim is None:
            return (Shard(shard_dim),)
        return (Replicate(), Shard(shard_dim))


@dataclass(frozen=True)
class SubgroupInfo:
    """This rank's group of ``size`` consecutive shard ranks (``reshard_after_forward=size``).

    Attributes:
        group: the process group of those ranks.
        size: how many ranks it has (divides the shard world size).
        rank: this rank's index in it (its shard rank modulo ``size`` on a mesh built by
            ``init_device_mesh``); it picks which piece of the gathered tensor the rank keeps.

    Example:
        >>> sub = post_forward_subgroup(mesh_info(mesh), 2)  # doctest: +SKIP
        >>> sub.size, sub.rank  # on shard rank 3  # doctest: +SKIP
        (2, 1)
    """

    group: dist.ProcessGroup
    size: int
    rank: int


# The attribute of a DeviceMesh that caches its subgroups by size: one set of process groups
# per mesh however many fully_shard calls ask, living and dying with the mesh object (a cache
# keyed by mesh value could outlive a destroyed process group and hand out dead groups).
_SUBGROUPS_ATTR = "_fully_shard_post_forward_subgroups"


class _SubgroupCache(dict[int, dist.ProcessGroup]):
    """Subgroups by size. Pickles and copies as empty: a ProcessGroup cannot be pickled, and
    DeviceMesh pickles its ``__dict__`` (so ``copy.deepcopy(model)`` would fail otherwise)."""

    def __reduce__(self) -> tuple[type[_SubgroupCache], tuple[()]]:
        return (_SubgroupCache, ())


def _subgroup_ranks(info: MeshInfo, size: int) -> list[list[int]]:
    """Every group of ``size`` consecutive shard ranks in the whole job, as global ranks.

    Every rank computes the same list (creating a group is collective over the default group):
    the ranks of the mesh's root, the mesh's own dims moved last, in rows of ``size``.
    """
    mesh = info.mesh
    root = root_mesh(mesh)
    if root is mesh:
        ranks = mesh.mesh
    else:
        names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
        if names is None or root_names is None or any(n not in root_names for n in names):
            raise FullyShardNotImplementedError(
                f"reshard_after_forward=<int> needs the mesh's dims {names} to be dims of its "
                f"parent mesh {root} (a flattened sub-mesh is not supported); pass True or "
                "False, or a mesh built with init_device_mesh"
            )
        own = [root_names.index(n) for n in names]
        others = [d for d in range(root.ndim) if d not in own]
        ranks = root.mesh.permute(*others, *own)
    return [[int(r) for r in row] for row in ranks.reshape(-1, size).tolist()]


def post_forward_subgroup(info: MeshInfo, size: int) -> SubgroupInfo:
    """This rank's group of ``size`` consecutive shard ranks, creating all such groups once.

    Collective: every rank of the job must call it with the same ``size``, as when building a
    mesh. ``size`` must divide the shard world size (checked by ``fully_shard``). For an HSDP
    mesh the groups lie inside each replica (as in torch: the mesh flattened, in rows of n).

    Example:
        >>> info = mesh_info(init_device_mesh("cpu", (4,)))  # doctest: +SKIP
        >>> post_forward_subgroup(info, 2).size  # doctest: +SKIP
        2
    """
    cache: _SubgroupCache | None = getattr(info.mesh, _SUBGROUPS_ATTR, None)
    if cache is None:
        cache = _SubgroupCache()
        setattr(info.mesh, _SUBGROUPS_ATTR, cache)
    group = cache.get(size)
    if group is None:
        # torch's stubs leave new_subgroups_by_enumeration unannotated
        mine, _ = dist.new_subgroups_by_enumeration(_subgroup_ranks(info, size))  # type: ignore[no-untyped-call]
        if mine is None:
            raise FullyShardStateError(
                f"rank {dist.get_rank()} is in no group of {size} consecutive ranks of mesh "
                f"{info.mesh}; call fully_shard on every rank of the mesh"
            )
        group = cache[size] = mine
    # Any assignment of pieces to ranks rebuilds the same tensor, as long as the piece a rank
    # keeps is the one its group rank puts in place: so the group's own rank, not ours.
    return SubgroupInfo(group=group, size=size, rank=int(group.rank()))


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


@dataclass(frozen=True)
class TPLayout:
    """A tensor-parallel parameter as it was before we sharded it.

    Attributes:
        mesh: the 1-D tensor-parallel mesh, a sub-mesh of the same root as the dp mesh.
        placements: its placement on ``mesh`` (``Shard(k)`` or ``Replicate()``).
        size: its global shape; ``stride`` the contiguous strides of that shape.
        root: the 2-D mesh holding both the dp and the tp dims.
        dp_dim, tp_dim: the indices of the dp and tp dims in ``root``.

    Example:
        >>> layout = tp_layout(mesh_info(root["dp"]), wq.weight, "wq.weight")  # doctest: +SKIP
        >>> layout.placements, layout.dp_dim, layout.tp_dim  # doctest: +SKIP
        ((Shard(dim=0),), 0, 1)
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    size: torch.Size
    stride: tuple[int, ...]
    root: DeviceMesh
    dp_dim: int
    tp_dim: int


def tp_layout(info: MeshInfo, param: DTensor, fqn: str) -> TPLayout:
    """Check that ``param``'s mesh composes with the dp mesh ``info`` and describe its layout."""
    tp_mesh = param.device_mesh
    dp_names = info.mesh.mesh_dim_names
    tp_names = tp_mesh.mesh_dim_names
    if info.replicate_mesh_dim is not None:
        raise FullyShardNotImplementedError(
            f"parameter {fqn!r} is a DTensor on mesh {tp_mesh} and fully_shard was given a 2-D "
            "(HSDP) mesh; HSDP combined with tensor parallelism (a 3-D mesh) is not supported "
            'yet: pass the 1-D data-parallel sub-mesh, e.g. mesh=root["dp"]'
        )
    if tp_mesh == info.mesh or (dp_names and tp_names and set(dp_names) & set(tp_names)):
        raise FullyShardValueError(
            f"parameter {fqn!r} is already a DTensor on mesh {tp_mesh}, placed "
            f"{tuple(param.placements)}, over the same dims as the fully_shard mesh "
            f"{info.mesh}; fully_shard shards plain parameters itself: pass the module with "
            "plain tensors, or parallelize it on another dim of a 2-D "
            'mesh (tensor parallel on root["tp"], fully_shard on root["dp"])'
        )
    if tp_mesh.ndim != 1:
        raise FullyShardNotImplementedError(
            f"parameter {fqn!r} is a DTensor on a {tp_mesh.ndim}-D mesh {tp_mesh}; fully_shard "
            "composes with 1-D tensor-parallel meshes only"
        )
    root = root_mesh(info.mesh)
    if dp_names is None or tp_names is None or root_mesh(tp_mesh) is not root:
        raise FullyShardValueError(
            f"parameter {fqn!r} is a DTensor on mesh {tp_mesh}, which is not a sub-mesh of "
            f"the same parent as the fully_shard mesh {info.mesh}; build one named 2-D mesh, "
            'root = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp")), '
            'parallelize with root["tp"] and pass mesh=root["dp"]'
        )
    root_names = root.mesh_dim_names
    if root.ndim != 2 or root_names is None or dp_names[0] == tp_names[0]:
        raise FullyShardValueError(
            f"parameter {fqn!r} is a DTensor on mesh {tp_mesh} and fully_shard got mesh "
            f"{info.mesh}; they must be the two different dims of one 2-D mesh, got parent "
            f"{root}"
        )
    for placement in param.placements:
        if not isinstance(placement, (Shard, Replicate)):
            raise FullyShardValueError(
                f"parameter {fqn!r} is placed {placement} on its tensor-parallel mesh; only "
                "Shard(dim) and Replicate() parameters can be sharded further"
            )
    size = param.size()
    return TPLayout(
        mesh=tp_mesh,
        placements=tuple(param.placements),
        size=size,
        stride=contiguous_stride(size),
        root=root,
        dp_dim=root_names.index(dp_names[0]),
        tp_dim=root_names.index(tp_names[0]),
    )


def tp_sharded_dims(layout: TPLayout) -> set[int]:
    """The tensor dims tensor parallelism already shards."""
    return {p.dim for p in layout.placements if isinstance(p, Shard)}


def combined_placements(layout: TPLayout, shard_dim: int) -> tuple[Placement, ...]:
    """The placements on ``layout.root`` of a TP parameter we shard on tensor dim ``shard_dim``.

    DTensor reads placements outer mesh dim first. If TP shards another tensor dim the order
    does not matter and plain ``Shard`` is exact. If TP shards the same dim, TP split it first
    and we split TP's local rows: that is plain ``Shard`` when the TP dim is the outer one, and
    a strided shard over TP's pieces when the dp dim is outer (the usual ``("dp", "tp")``).
    """
    tp_placement = layout.placements[0]
    dp_placement: Placement = Shard(shard_dim)
    if (
        isinstance(tp_placement, Shard)
        and tp_placement.dim == shard_dim
        and layout.dp_dim < layout.tp_dim
    ):
        dp_placement = strided_shard(shard_dim, int(layout.mesh.size()))
    placements: list[Placement] = [Replicate(), Replicate()]
    placements[layout.dp_dim] = dp_placement
    placements[layout.tp_dim] = tp_placement
    return tuple(placements)


def check_strided_split(layout: TPLayout, shard_dim: int, dp_size: int, fqn: str) -> None:
    """Refuse a strided layout (see :func:`combined_placements`) this torch cannot describe.

    Raises before anything is sharded: on a torch whose ``_StridedShard`` needs an even split,
    ``full_tensor()`` and checkpoints of an uneven one would fail later, far from the cause.
    """
    placement = combined_placements(layout, shard_dim)[layout.dp_dim]
    if type(placement) is Shard:  # not the strided subclass
        return
    pieces = dp_size * int(layout.mesh.size())
    if layout.size[shard_dim] % pieces == 0 or strided_shard_handles_uneven():
        return
    raise FullyShardNotImplementedError(
        f"parameter {fqn!r} of shape {tuple(layout.size)} would be sharded on dim {shard_dim} "
        f"by both tensor parallelism and fully_shard, into {pieces} uneven pieces; this torch "
        f"({torch.__version__}) cannot describe an uneven strided layout (full_tensor() and "
        "checkpoints would fail). Shard another dim (shard_placement_fn returning Shard(d) for "
        f"a dim tensor parallelism leaves whole), make dim {shard_dim} divisible by {pieces}, "
        "or use torch 2.13 or newer"
    )


def contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of shape ``size``."""
    stride = [1] * len(size)
    for i in range(len(size) - 2, -1, -1):
        stride[i] = stride[i + 1] * max(size[i + 1], 1)
    return tuple(stride)
