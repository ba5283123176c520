"""Mesh info: which mesh dim shards, which replicates (HSDP), their groups and the device.

A 1-D mesh shards over its only dim. A 2-D mesh is read as ``(replicate, shard)``: parameters
are placed ``(Replicate(), Shard(d))``, gradients are reduce-scattered over the shard dim and
all-reduced over the replicate dim (HSDP).

``reshard_after_forward=n``: :func:`post_forward_subgroup` splits the shard ranks into groups
of n consecutive ones (node-local ranks when n is the number of devices per node) and creates
their process groups, once per mesh.

Per-parameter meshes: ``shard_placement_fn`` may return a :class:`ShardPlacementResult` that
carries its own mesh (experts of a mixture of experts sharded over a sub-mesh, the rest over
the whole one); :class:`MeshResolver` turns each answer into the ``MeshInfo`` of the group
the parameter joins, one group per distinct mesh.

Parameters that are already DTensors (tensor parallel, or on a full SPMD mesh with
``dp_mesh_dims``) are described in :mod:`fully_shard.spmd`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

from ._compat import can_concatenate_meshes, concatenate_meshes, root_mesh
from .errors import (
    FullyShardAssertionError,
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
        mesh: the 2-D mesh ``(replicate, shard)`` of every such group of the mesh's ranks, one
            group a row (torch's post-forward mesh): the registered parameters between forward
            and backward are DTensors on it, ``(Replicate(), Shard(dim))``.

    Example:
        >>> sub = post_forward_subgroup(mesh_info(mesh), 2)  # doctest: +SKIP
        >>> sub.size, sub.rank  # on shard rank 3  # doctest: +SKIP
        (2, 1)
    """

    group: dist.ProcessGroup
    size: int
    rank: int
    mesh: DeviceMesh


# The attribute of a DeviceMesh that caches its subgroups by size: one set of process groups
# per mesh however many fully_shard calls ask, living and dying with the mesh object (a cache
# keyed by mesh value could outlive a destroyed process group and hand out dead groups).
_SUBGROUPS_ATTR = "_fully_shard_post_forward_subgroups"


class _SubgroupCache(dict[int, tuple[dist.ProcessGroup, DeviceMesh]]):
    """Subgroups by size. Pickles and copies as empty: a ProcessGroup cannot be pickled, and
    DeviceMesh pickles its ``__dict__`` (so ``copy.deepcopy(model)`` would fail otherwise)."""

    def __reduce__(self) -> tuple[type[_SubgroupCache], tuple[()]]:
        return (_SubgroupCache, ())


def _subgroup_ranks(info: MeshInfo, size: int) -> list[list[int]]:
    """Every group of ``size`` consecutive shard ranks in the whole job, as global ranks.

    Every rank computes the same list (creating a group is collective over the default group):
    the ranks of the mesh's root, the mesh's own dims moved last, in rows of ``size``. A mesh
    whose dims its root does not name (unflattened from a world mesh, as torchtitan builds
    them, or flattened) lists its copies itself: every rank sends its own copy's ranks (one
    ``all_gather_object``, once per mesh and size), taken in the order of the first global
    rank of each.
    """
    mesh = info.mesh
    root = root_mesh(mesh)
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if root is mesh:
        ranks = mesh.mesh
    elif names is None or root_names is None or any(n not in root_names for n in names):
        copies: list[list[int]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(copies, mesh.mesh.flatten().tolist())
        unique = list(dict.fromkeys(tuple(copy) for copy in copies))
        ranks = torch.tensor(unique)
    else:
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
    cached = cache.get(size)
    if cached is None:
        cached = cache[size] = _post_forward_groups(info, size)
    group, mesh = cached
    # Any assignment of pieces to ranks rebuilds the same tensor, as long as the piece a rank
    # keeps is the one its group rank puts in place: so the group's own rank, not ours (the
    # mesh's rows are sorted, so it is also this rank's coordinate on the mesh's shard dim).
    return SubgroupInfo(group=group, size=size, rank=int(group.rank()), mesh=mesh)


def _post_forward_groups(info: MeshInfo, size: int) -> tuple[dist.ProcessGroup, DeviceMesh]:
    """Create the groups of ``size`` ranks (rows) and the groups across them (columns), and
    this rank's ``(replicate, shard)`` mesh over the rows of its part of the job."""
    # Sorted: a process group orders its ranks so, and the mesh must agree with it.
    rows = [sorted(row) for row in _subgroup_ranks(info, size)]
    per_part = info.mesh.size() // size  # rows that cover one copy of the mesh's own dims
    parts = [rows[i : i + per_part] for i in range(0, len(rows), per_part)]
    columns = [[row[j] for row in part] for part in parts for j in range(size)]
    # torch's stubs leave new_subgroups_by_enumeration unannotated
    row_group, _ = dist.new_subgroups_by_enumeration(rows)  # type: ignore[no-untyped-call]
    column_group, _ = dist.new_subgroups_by_enumeration(columns)  # type: ignore[no-untyped-call]
    me = dist.get_rank()
    part = next((part for part in parts if any(me in row for row in part)), None)
    if row_group is None or column_group is None or part is None:
        raise FullyShardStateError(
            f"rank {me} is in no group of {size} consecutive ranks of mesh "
            f"{info.mesh}; call fully_shard on every rank of the mesh"
        )
    mesh = DeviceMesh.from_group(
        [column_group, row_group],
        info.mesh.device_type,
        mesh=torch.tensor(part, dtype=torch.int),
        mesh_dim_names=("replicate", "shard"),
    )
    return row_group, mesh


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
        'sub-mesh, e.g. mesh["dp"] (or mesh["replicate", "shard"] for HSDP + TP), or pass the '
        "whole mesh with dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...) if the "
        "parameters are already DTensors on it"
    )


@dataclass(frozen=True)
class ComposedMesh:
    """One mesh holding the data-parallel dims and a parameter's own (TP / EP) dims.

    A parameter that is already a DTensor (on tensor- or expert-parallel dims) and that we shard
    further must end as *one* DTensor on a mesh with both sets of dims, so that
    ``full_tensor()`` and DCP see the whole layout. Two ways to get that mesh:

    - ``sliced``: both meshes are named slices of one named parent (``root["dp"]`` and
      ``root["tp"]``): the sub-mesh of that parent with both sets of dims, in its order.
    - concatenated: trainers such as torchtitan slice every mesh out of meshes they
      ``_unflatten`` from one 1-D world mesh, so the parent names none of the dims; the two
      meshes compose when they are views of the same ranks whose dims are orthogonal (no rank
      pair shared), which is what ``DeviceMesh._concatenate`` checks and builds: the
      data-parallel dims first, then the parameter's, as torch's ``fully_shard`` builds it.

    Attributes:
        mesh: the composed mesh.
        dp_index: where the data-parallel mesh's dims are in ``mesh``, in their order.
        own_index: where the parameter mesh's dims are in ``mesh``, in their order.
        sliced: ``True`` when ``mesh`` is a slice of a named parent (its order); ``False``
            when concatenated (torch's order: the data-parallel dims first).

    Example:
        >>> world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))  # doctest: +SKIP
        >>> dense = world._unflatten(0, (2, 2), ("fsdp", "tp"))  # doctest: +SKIP
        >>> compose_meshes(dense["fsdp"], dense["tp"], "w").dp_index  # doctest: +SKIP
        (0,)
    """

    mesh: DeviceMesh
    dp_index: tuple[int, ...]
    own_index: tuple[int, ...]
    sliced: bool


def compose_meshes(dp: DeviceMesh, own: DeviceMesh, fqn: str) -> ComposedMesh:
    """The mesh a parameter on ``own`` lives on once we shard it over ``dp`` too.

    Decided from the meshes' ranks and layout, not from a shared named parent (see
    :class:`ComposedMesh`). Raises, naming both meshes and what would be accepted, when they
    are not views of one job's ranks, share a dim, or are unnamed.
    """
    dp_names, own_names = dp.mesh_dim_names, own.mesh_dim_names
    if own == dp or (dp_names and own_names and set(dp_names) & set(own_names)):
        raise FullyShardValueError(
            f"parameter {fqn!r} is already a DTensor on mesh {own}, over the same dims as the "
            f"fully_shard mesh {dp}; fully_shard shards plain parameters itself: pass the "
            "module with plain tensors, or parallelize it on another dim (tensor parallel on "
            'root["tp"], fully_shard on root["dp"]); for parameters that are DTensors on the '
            "whole mesh pass dp_mesh_dims=DataParallelMeshDims(...)"
        )
    if dp_names is None or own_names is None:
        raise FullyShardValueError(
            f"parameter {fqn!r} is a DTensor on mesh {own} and fully_shard got mesh {dp}; both "
            "need mesh_dim_names to be composed into one mesh: build them with "
            "init_device_mesh(..., mesh_dim_names=(...)) and slice them by name"
        )
    root = root_mesh(dp)
    root_names = root.mesh_dim_names or ()
    if all(n in root_names for n in (*dp_names, *own_names)) and root[own_names] == own:
        names = sorted((*dp_names, *own_names), key=root_names.index)
        mesh = root if len(names) == root.ndim else root[tuple(names)]
        return ComposedMesh(
            mesh=mesh,
            dp_index=tuple(names.index(n) for n in dp_names),
            own_index=tuple(names.index(n) for n in own_names),
            sliced=True,
        )
    if not can_concatenate_meshes():
        raise FullyShardNotImplementedError(
            f"parameter {fqn!r} is a DTensor on mesh {own}, which is not a named slice of the "
            f"parent of the fully_shard mesh {dp}; this torch ({torch.__version__}) cannot "
            "compose meshes unflattened from a world mesh (torch 2.13 or newer can). Build one "
            'named mesh, root = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", '
            '"tp")), parallelize with root["tp"] and pass mesh=root["dp"]'
        )
    try:
        mesh = concatenate_meshes([dp, own])
    except (RuntimeError, ValueError, AttributeError) as e:
        raise FullyShardValueError(
            f"parameter {fqn!r} is a DTensor on mesh {own} (ranks {own.mesh.tolist()}), which "
            f"does not compose with the fully_shard mesh {dp} (ranks {dp.mesh.tolist()}): "
            f"{e}. The two must be views of one job's ranks along different dims: slices of "
            'one named mesh (root["dp"], root["tp"]) or of meshes unflattened from one world '
            'mesh (world._unflatten(0, (dp, tp), ("dp", "tp"))), as torchtitan builds them'
        ) from e
    return ComposedMesh(
        mesh=mesh,
        dp_index=tuple(range(dp.ndim)),
        own_index=tuple(range(dp.ndim, dp.ndim + own.ndim)),
        sliced=False,
    )


def contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of shape ``size``."""
    stride = [1] * len(size)
    for i in range(len(size) - 2, -1, -1):
        stride[i] = stride[i + 1] * max(size[i + 1], 1)
    return tuple(stride)


@dataclass(frozen=True)
class FSDPMeshInfo:
    """Which dim of a mesh shards (torch 2.13's ``FSDPMeshInfo``, with its constructor fields).

    For :class:`ShardPlacementResult` ``(placement, mesh_info=...)`` as written against torch:
    code that builds torch's ``FSDPMeshInfo(mesh, shard_mesh_dim=0)`` builds ours with the
    same arguments. ``fully_shard`` reads a 1-D mesh as (shard) and a 2-D one as
    (replicate, shard), so the dims must say that; the group sizes and ranks torch computes
    are properties here, read from the mesh when asked.

    Attributes:
        mesh: the mesh.
        shard_mesh_dim: the dim parameters are sharded over (``0`` for a 1-D mesh).
        replicate_mesh_dim: the dim they are replicated over, or ``None`` (see
            :class:`HSDPMeshInfo`).
        dp_mesh_dims: torch's full-SPMD-mesh mode for this mesh; not supported for a
            per-parameter mesh (must be ``None``).
        spmd_mesh: the full SPMD mesh of that mode (must be ``None``).

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> from fully_shard import FSDPMeshInfo, ShardPlacementResult
        >>> info = FSDPMeshInfo(expert_mesh, shard_mesh_dim=0)  # doctest: +SKIP
        >>> ShardPlacementResult(placement=Shard(0), mesh_info=info)  # doctest: +SKIP
    """

    mesh: DeviceMesh
    shard_mesh_dim: int | None = None
    replicate_mesh_dim: int | None = None
    dp_mesh_dims: object = None
    spmd_mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.mesh, DeviceMesh):
            raise FullyShardTypeError(
                f"{name}.mesh must be a DeviceMesh, got {type(self.mesh).__name__}"
            )
        if self.shard_mesh_dim is None:
            raise FullyShardAssertionError(
                f"{name} needs shard_mesh_dim (the mesh dim parameters are sharded over): "
                f"e.g. {name}(mesh, shard_mesh_dim=0) for a 1-D mesh"
            )
        for field_name in ("shard_mesh_dim", "replicate_mesh_dim"):
            dim = getattr(self, field_name)
            if dim is not None and not 0 <= dim < self.mesh.ndim:
                raise FullyShardValueError(
                    f"{name}.{field_name}={dim} is not a dim of the {self.mesh.ndim}-D mesh "
                    f"{self.mesh}"
                )
        if self.dp_mesh_dims is not None or self.spmd_mesh is not None:
            raise FullyShardNotImplementedError(
                f"{name} with dp_mesh_dims / spmd_mesh (torch's full-SPMD-mesh mode) is not "
                "supported for a per-parameter mesh; leave both None, or pass the full mesh "
                "to fully_shard(mesh=..., dp_mesh_dims=...) without a mesh of its own"
            )

    @property
    def shard_mesh_size(self) -> int:
        return self.mesh.size(self._shard_dim)

    @property
    def shard_process_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self._shard_dim)

    @property
    def shard_mesh_rank(self) -> int:
        return self.mesh.get_local_rank(self._shard_dim)

    @property
    def _shard_dim(self) -> int:
        if self.shard_mesh_dim is None:  # refused in __post_init__
            raise RuntimeError("FSDPMeshInfo without shard_mesh_dim (internal error)")
        return self.shard_mesh_dim


@dataclass(frozen=True)
class HSDPMeshInfo(FSDPMeshInfo):
    """A 2-D mesh that replicates over one dim and shards over the other (torch 2.13's
    ``HSDPMeshInfo``): ``HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)``.

    Attributes:
        replicate_mesh_dim: required here; the others as in :class:`FSDPMeshInfo`.

    Example:
        >>> from fully_shard import HSDPMeshInfo
        >>> HSDPMeshInfo(hsdp_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)  # doctest: +SKIP
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.replicate_mesh_dim is None:
            raise FullyShardAssertionError(
                "HSDPMeshInfo needs replicate_mesh_dim: HSDPMeshInfo(mesh, shard_mesh_dim=1, "
                "replicate_mesh_dim=0) for a (replicate, shard) mesh; FSDPMeshInfo shards only"
            )

    @property
    def replicate_mesh_size(self) -> int:
        return self.mesh.size(self._replicate_dim)

    @property
    def replicate_process_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self._replicate_dim)

    @property
    def replicate_mesh_rank(self) -> int:
        return self.mesh.get_local_rank(self._replicate_dim)

    @property
    def _replicate_dim(self) -> int:
        if self.replicate_mesh_dim is None:  # refused in __post_init__
            raise RuntimeError("HSDPMeshInfo without replicate_mesh_dim (internal error)")
        return self.replicate_mesh_dim


@dataclass(frozen=True)
class ShardPlacementResult:
    """What ``shard_placement_fn`` returns to shard a parameter over a mesh of its own.

    The parameters of one ``fully_shard`` call that name the same mesh form one group (one
    all-gather, one reduce-scatter), the others stay with the call's ``mesh``: e.g. the
    experts of a mixture-of-experts layer sharded over the ranks that hold the same experts,
    the router over all ranks.

    Built with our field name (``ShardPlacementResult(Shard(0), mesh)``) or torch 2.13's
    (``ShardPlacementResult(placement=Shard(0), mesh_info=FSDPMeshInfo(mesh,
    shard_mesh_dim=0))``, with :class:`FSDPMeshInfo` / :class:`HSDPMeshInfo` from here or
    torch's): the second positional argument may be either. torch's own
    ``ShardPlacementResult`` is accepted too (read by duck typing: its ``mesh_info.mesh``).

    Attributes:
        placement: ``Shard(dim)``, or ``None`` for the default dim.
        mesh: a 1-D (shard) or 2-D (replicate, shard: HSDP) mesh, like ``fully_shard``'s
            (taken from ``mesh_info`` when only that is given).
        mesh_info: the mesh info it was built with, or ``None``.

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> from fully_shard import ShardPlacementResult
        >>> def placement(p):  # doctest: +SKIP
        ...     return ShardPlacementResult(Shard(0), expert_mesh) if p.dim() == 3 else None
        >>> fully_shard(moe_layer, mesh=world, shard_placement_fn=placement)  # doctest: +SKIP
    """

    placement: Shard | None
    mesh: DeviceMesh = None  # type: ignore[assignment]  # filled from mesh_info when absent
    mesh_info: object = None  # FSDPMeshInfo / HSDPMeshInfo, ours or torch's

    def __post_init__(self) -> None:
        if self.placement is not None and not isinstance(self.placement, Shard):
            raise FullyShardTypeError(
                f"ShardPlacementResult.placement must be a Shard(dim) or None, got "
                f"{self.placement!r}"
            )
        given: object = self.mesh
        if given is not None and not isinstance(given, DeviceMesh) and hasattr(given, "mesh"):
            # torch's positional order: ShardPlacementResult(placement, mesh_info)
            if self.mesh_info is not None:
                raise FullyShardTypeError(
                    "ShardPlacementResult got a mesh info as its mesh and another as "
                    "mesh_info; pass one: ShardPlacementResult(placement, mesh) or "
                    "ShardPlacementResult(placement, mesh_info=...)"
                )
            object.__setattr__(self, "mesh_info", given)
            given = None
        info_mesh = None if self.mesh_info is None else getattr(self.mesh_info, "mesh", None)
        if self.mesh_info is not None and not isinstance(info_mesh, DeviceMesh):
            raise FullyShardTypeError(
                f"ShardPlacementResult.mesh_info must be an FSDPMeshInfo / HSDPMeshInfo with a "
                f"DeviceMesh .mesh, got {type(self.mesh_info).__name__}"
            )
        if given is None:
            given = info_mesh
        elif info_mesh is not None and info_mesh != given:
            raise FullyShardValueError(
                f"ShardPlacementResult got mesh {given} and a mesh_info on mesh {info_mesh}; "
                "pass one of them, or the same mesh"
            )
        if not isinstance(given, DeviceMesh):
            raise FullyShardTypeError(
                f"ShardPlacementResult.mesh must be a DeviceMesh, got {type(given).__name__}"
                + ("" if given is not None else " (pass mesh= or mesh_info=)")
            )
        object.__setattr__(self, "mesh", given)


class MeshResolver:
    """Reads each answer of ``shard_placement_fn``: the placement, and the group's mesh info.

    Meshes that compare equal share one ``MeshInfo`` (and so one group); the call's own mesh
    is ``default``.

    Example:
        >>> resolver = MeshResolver(mesh_info(world))  # doctest: +SKIP
        >>> result = ShardPlacementResult(Shard(0), sub)  # doctest: +SKIP
        >>> placement, info = resolver.resolve(result, "experts.w1")  # doctest: +SKIP
        >>> info.shard_size  # doctest: +SKIP
        2
    """

    def __init__(self, default: MeshInfo) -> None:
        self.default = default
        self._infos: dict[DeviceMesh, MeshInfo] = {default.mesh: default}

    def resolve(self, result: object, fqn: str) -> tuple[object, MeshInfo]:
        """``(placement, info)`` for ``result``; a placement that is not ours to judge (not
        ``Shard`` / ``None``) is passed on for the caller's error."""
        mesh = _result_mesh(result, fqn)
        if mesh is None:
            return result, self.default
        info = self._infos.get(mesh)
        if info is None:
            info = self._infos[mesh] = mesh_info(mesh)
        return getattr(result, "placement", None), info


def _result_mesh(result: object, fqn: str) -> DeviceMesh | None:
    torch_info = getattr(result, "mesh_info", None)
    if isinstance(result, ShardPlacementResult):
        if torch_info is None:
            return result.mesh
    elif torch_info is None or not hasattr(result, "placement"):
        return None
    # A mesh info (torch's ShardPlacementResult(placement, mesh_info), or ours built with
    # torch's field name): FSDPMeshInfo / HSDPMeshInfo, ours or torch's.
    mesh = getattr(torch_info, "mesh", None)
    if not isinstance(mesh, DeviceMesh):
        raise FullyShardTypeError(
            f"shard_placement_fn returned {result!r} for parameter {fqn!r}, whose mesh_info "
            "has no DeviceMesh .mesh; return fully_shard.ShardPlacementResult(placement, mesh)"
        )
    want = (0, None) if mesh.ndim == 1 else (1, 0)
    got = (
        getattr(torch_info, "shard_mesh_dim", None),
        getattr(torch_info, "replicate_mesh_dim", None),
    )
    if got != want:
        raise FullyShardValueError(
            f"shard_placement_fn returned a mesh_info for parameter {fqn!r} that shards mesh "
            f"dim {got[0]} and replicates dim {got[1]} of {mesh}; fully_shard reads a 1-D mesh "
            "as (shard) and a 2-D one as (replicate, shard): pass it in that order"
        )
    return mesh
