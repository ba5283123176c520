"""Parameters that already are DTensors: how we shard them further, and on which mesh.

A tensor-parallel parameter (``parallelize_module(block, root["tp"], ...)`` before
``fully_shard(block, mesh=root["dp"])``, or ``mesh=root["replicate", "shard"]`` for HSDP + TP
on a 3-D mesh) is sharded as its TP-local tensor over the data-parallel dims. The result must
be *one* DTensor whose metadata covers both shardings, so that ``full_tensor()``,
``state_dict()`` and DCP see the whole layout: it lives on the sub-mesh of ``root`` made of
the dp dims and the TP dim, in ``root``'s order (``root`` itself when those are all its dims),
with one placement per dim::

    root = (replicate=2, shard=2, tp=2)           TP: Shard(1) (a row-parallel weight)
    sharded DTensor on root: (Replicate(), Shard(0), Shard(1))
    local tensor (rank r): rows chunk(shard rank) of TP-local columns chunk(tp rank)

:class:`TPLayout` holds that: the parameter's own mesh and placements (what the module sees
again while gathered), the mesh the sharded DTensor lives on, and the placements there
before ours (``Replicate()`` on every dp dim). :func:`combined_placements` adds ours on the
shard dim.

A parameter on a full SPMD mesh (``fully_shard(m, mesh=world, dp_mesh_dims=
DataParallelMeshDims(shard=..., replicate=...))``, torch 2.13's way) is a DTensor on ``world``
itself with ``Replicate()`` on the dp dims. It is described the same way: its sharded DTensor
lives on ``world`` (a tuple of dims, flattened into one dim, replaces those dims), with our
shard on the shard dim, ``Replicate()`` on the replicate dim and its own placements elsewhere.
Its gradient keeps whatever placement it has on the dp dims (``Partial()`` when the batch is
a DTensor sharded over them): the reduce-scatter and all-reduce sum those, as in torch.
:func:`check_dp_mesh_dims` and :func:`check_spmd_param` check everything first; only then
:func:`build_spmd_mesh` creates the flattened dims (collective).

Which tensor dim we shard: by default the first one the other placements leave whole, so
that two plain ``Shard`` placements of different tensor dims describe the layout exactly (they
commute). When we shard a dim that a placement on a *later* (inner) mesh dim shards too, that
one split it first and we split its local rows: DTensor reads placements outer dim first, so
our placement is a strided shard over its pieces (torch's ``_StridedShard``, see
``_compat.strided_shard``), which torch releases before 2.13 can describe only for an even
split (:func:`check_strided_split`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ._compat import (
    can_concatenate_meshes,
    concatenate_meshes,
    flatten_mesh,
    strided_shard,
    strided_shard_handles_uneven,
)
from .errors import FullyShardNotImplementedError, FullyShardTypeError, FullyShardValueError
from .mesh import MeshInfo, compose_meshes, contiguous_stride, mesh_info
from .policies import DataParallelMeshDims


@dataclass(frozen=True)
class TPLayout:
    """A parameter that was a DTensor before we sharded it, and where its sharded DTensor lives.

    Attributes:
        mesh: the parameter's own mesh (the tensor-parallel sub-mesh).
        placements: its placements on ``mesh``; the unsharded parameter is a DTensor on
            ``mesh`` with these again, which is what the module computes with.
        size: its global shape; ``stride`` the contiguous strides of that shape.
        spmd: the mesh of the sharded DTensor: the dp dims and ``mesh``'s dims of one root.
        base: the placements on ``spmd`` before ours: ``Replicate()`` on the dp dims, the
            parameter's own placements on its dims.
        shard_index: the index in ``spmd`` of the dp dim we shard over.
        dp_dims: the dims of ``mesh`` that are data parallel (a full SPMD mesh): the
            gradient's placements there are kept for the reduction to sum; empty for TP.
        torch_order: ``spmd`` was concatenated (dp dims first, see
            :class:`~fully_shard.mesh.ComposedMesh`): the default shard dim is then 0, as in
            torch, so that the sharded DTensors are the ones torch's ``fully_shard`` makes.

    Example:
        >>> layout = tp_layout(mesh_info(root["dp"]), wq.weight, "wq.weight")  # doctest: +SKIP
        >>> layout.base, layout.shard_index  # on root (dp, tp)  # doctest: +SKIP
        ((Replicate(), Shard(dim=0)), 0)
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    size: torch.Size
    stride: tuple[int, ...]
    spmd: DeviceMesh
    base: tuple[Placement, ...]
    shard_index: int
    dp_dims: frozenset[int] = field(default_factory=frozenset)
    torch_order: bool = False

    def grad_placements(self, current: tuple[Placement, ...]) -> tuple[Placement, ...]:
        """The placements to bring an unsharded gradient (placed ``current``) to before taking
        its local tensor: the parameter's own (a ``Partial`` TP gradient is summed first),
        except on the dp dims, where the reduction does the summing."""
        return tuple(
            current[i] if i in self.dp_dims else own for i, own in enumerate(self.placements)
        )

    def local_grad(self, grad: DTensor) -> torch.Tensor:
        """This rank's TP-local tensor of an unsharded gradient: a ``Partial`` one (e.g. a
        sequence-parallel norm's weight) is summed over the TP ranks first, so that what the
        data-parallel reduction sums is each rank's own."""
        target = self.grad_placements(tuple(grad.placements))
        if tuple(grad.placements) != target:
            grad = grad.redistribute(placements=target)
        return grad.to_local()


def _check_placements(placements: tuple[Placement, ...], fqn: str, where: str) -> None:
    for placement in placements:
        if type(placement) not in (Shard, Replicate):  # not a strided or other subclass
            raise FullyShardValueError(
                f"parameter {fqn!r} is placed {placement} on its {where}; only Shard(dim) and "
                "Replicate() parameters can be sharded further"
            )


def tp_layout(info: MeshInfo, param: DTensor, fqn: str) -> TPLayout:
    """Check that ``param``'s mesh composes with the dp mesh ``info`` and describe its layout.

    The dp mesh (1-D, or 2-D for HSDP) and the parameter's own mesh (tensor or expert
    parallel, 1-D or 2-D) must be views of one job's ranks along different dims: named
    slices of one mesh (``root["dp"]``, ``root["tp"]``), or slices of meshes unflattened from
    one world mesh, as torchtitan builds them (:func:`~fully_shard.mesh.compose_meshes`).
    """
    own = param.device_mesh
    if own.ndim > 2:
        raise FullyShardNotImplementedError(
            f"parameter {fqn!r} is a DTensor on a {own.ndim}-D mesh {own}; fully_shard "
            "composes with 1-D (TP or EP) and 2-D (EP x TP) parameter meshes (or pass the "
            "whole mesh with dp_mesh_dims=DataParallelMeshDims(...))"
        )
    composed = compose_meshes(info.mesh, own, fqn)
    placements = tuple(param.placements)
    _check_placements(placements, fqn, "own mesh")
    base: list[Placement] = [Replicate()] * composed.mesh.ndim
    for index, placement in zip(composed.own_index, placements, strict=True):
        base[index] = placement
    size = param.size()
    return TPLayout(
        mesh=own,
        placements=placements,
        size=size,
        stride=contiguous_stride(size),
        spmd=composed.mesh,
        base=tuple(base),
        shard_index=composed.dp_index[info.shard_mesh_dim],
        torch_order=not composed.sliced,
    )


def tp_sharded_dims(layout: TPLayout) -> set[int]:
    """The tensor dims the parameter's own placements really split (over a mesh dim of more
    than one rank: a ``Shard`` over one rank leaves the dim whole)."""
    return {
        p.dim
        for j, p in enumerate(layout.base)
        if isinstance(p, Shard) and int(layout.spmd.size(j)) > 1
    }


def _inner_split(layout: TPLayout, shard_dim: int) -> int:
    """Into how many pieces the mesh dims inside ours split tensor dim ``shard_dim``."""
    pieces = 1
    for j in range(layout.shard_index + 1, len(layout.base)):
        p = layout.base[j]
        if isinstance(p, Shard) and p.dim == shard_dim:
            pieces *= int(layout.spmd.size(j))
    return pieces


def combined_placements(layout: TPLayout, shard_dim: int) -> tuple[Placement, ...]:
    """The placements on ``layout.spmd`` of the parameter we shard on tensor dim ``shard_dim``.

    Plain ``Shard(shard_dim)`` on our dim, unless an inner mesh dim shards the same tensor
    dim: then a strided shard over its pieces (see the module docstring).
    """
    placements = list(layout.base)
    split = _inner_split(layout, shard_dim)
    placements[layout.shard_index] = (
        strided_shard(shard_dim, split) if split > 1 else Shard(shard_dim)
    )
    return tuple(placements)


def check_strided_split(layout: TPLayout, shard_dim: int, dp_size: int, fqn: str) -> None:
    """Refuse a strided layout (see :func:`combined_placements`) this torch cannot describe.

    Raises before anything is sharded: on a torch whose ``_StridedShard`` needs an even split,
    ``full_tensor()`` and checkpoints of an uneven one would fail later, far from the cause.
    """
    split = _inner_split(layout, shard_dim)
    if split == 1:
        return
    outer = math.prod(
        int(layout.spmd.size(j))
        for j, p in enumerate(layout.base[: layout.shard_index])
        if isinstance(p, Shard) and p.dim == shard_dim
    )
    pieces = dp_size * split * outer
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


# -- a full SPMD mesh: dp_mesh_dims -----------------------------------------------------------


@dataclass(frozen=True)
class SPMDPlan:
    """``dp_mesh_dims`` checked against a full mesh: which dims do what (nothing created yet).

    Attributes:
        full: the mesh given to ``fully_shard``; every parameter is a DTensor on it.
        shard_names, replicate_names: the dims sharded / replicated over (a tuple of several
            is flattened into one dim).
        spec_dims: the dims of the mesh the sharded DTensors live on, in ``full``'s order,
            each as the tuple of ``full``'s dims it stands for.
        shard_size: how many ranks share one parameter (the product of the shard dims).

    Example:
        >>> plan = check_dp_mesh_dims(world, DataParallelMeshDims(shard="dp"))  # doctest: +SKIP
        >>> plan.spec_dims  # world = (dp, tp)  # doctest: +SKIP
        (('dp',), ('tp',))
    """

    full: DeviceMesh
    shard_names: tuple[str, ...]
    replicate_names: tuple[str, ...]
    spec_dims: tuple[tuple[str, ...], ...]
    shard_size: int

    @property
    def dp_names(self) -> tuple[str, ...]:
        return (*self.replicate_names, *self.shard_names)


def check_dp_mesh_dims(mesh: object, dims: DataParallelMeshDims) -> SPMDPlan:
    """Check ``dims`` against the full mesh ``mesh``, before anything is created."""
    # Read again: DataParallelMeshDims is not frozen (like torch's), a field may have changed.
    shard, replicate = dims.shard_names, dims.replicate_names
    if not isinstance(mesh, DeviceMesh):
        raise FullyShardTypeError(
            f"fully_shard(dp_mesh_dims=...) needs mesh= the full SPMD DeviceMesh whose dims "
            f"{dims!r} names, got {type(mesh).__name__}"
        )
    names = mesh.mesh_dim_names
    if names is None:
        raise FullyShardValueError(
            f"fully_shard(dp_mesh_dims={dims!r}) needs a mesh with mesh_dim_names, got {mesh}; "
            "build it with init_device_mesh(..., mesh_dim_names=(...))"
        )
    if not shard:
        raise FullyShardNotImplementedError(
            f"dp_mesh_dims={dims!r} names no shard dim (replicate only, plain data "
            "parallelism); fully_shard needs a dim to shard over: name it in shard=..., or "
            "use DistributedDataParallel for replication alone"
        )
    for field_name, group in (("shard", shard), ("replicate", replicate)):
        for name in group:
            if name not in names:
                raise FullyShardValueError(
                    f"DataParallelMeshDims.{field_name} names {name!r}, which is not a dim of "
                    f"the mesh {mesh} (its dims: {names})"
                )
        if len(set(group)) != len(group):
            raise FullyShardValueError(
                f"DataParallelMeshDims.{field_name}={group} names a dim twice"
            )
        if list(group) != sorted(group, key=names.index):
            raise FullyShardValueError(
                f"DataParallelMeshDims.{field_name}={group} must list the dims in the mesh's "
                f"order {names}, e.g. {tuple(sorted(group, key=names.index))}"
            )
    both = set(shard) & set(replicate)
    if both:
        raise FullyShardValueError(
            f"DataParallelMeshDims names {sorted(both)} as both shard and replicate dims; each "
            "mesh dim either shards or replicates the parameters"
        )
    concatenated = len(shard) > 1 or len(replicate) > 1
    if replicate and names.index(replicate[0]) > names.index(shard[0]):
        concatenated = True  # the HSDP mesh is (replicate, shard): not a slice of the mesh
    if concatenated and not can_concatenate_meshes():
        raise FullyShardNotImplementedError(
            f"dp_mesh_dims={dims!r} needs dims flattened or reordered into a new mesh, which "
            f"this torch ({torch.__version__}) cannot build without new process groups; use "
            "torch 2.13 or newer, or name single dims with the replicate dim before the shard "
            "dim"
        )
    spec: list[tuple[str, ...]] = []
    for name in names:
        group = shard if name in shard else replicate if name in replicate else (name,)
        if group not in spec:
            spec.append(group)
    return SPMDPlan(
        full=mesh,
        shard_names=shard,
        replicate_names=replicate,
        spec_dims=tuple(spec),
        shard_size=math.prod(int(mesh.size(names.index(n))) for n in shard),
    )


def check_spmd_param(plan: SPMDPlan, param: object, fqn: str) -> None:
    """``param`` must be a DTensor on the full mesh with ``Replicate()`` on every dp dim."""
    full = plan.full
    if not isinstance(param, DTensor):
        raise FullyShardValueError(
            f"parameter {fqn!r} is a plain tensor; with dp_mesh_dims every parameter must be a "
            f"DTensor on the full mesh {full} (e.g. distribute_tensor(p, mesh, [Replicate(), "
            "...]) or distribute_module), with Replicate() on the data-parallel dims"
        )
    if param.device_mesh != full:
        raise FullyShardValueError(
            f"parameter {fqn!r} is a DTensor on mesh {param.device_mesh}, not on the mesh "
            f"given to fully_shard {full}; with dp_mesh_dims every parameter lives on that "
            "full mesh"
        )
    names = full.mesh_dim_names or ()
    placements = tuple(param.placements)
    for name in plan.dp_names:
        placement = placements[names.index(name)]
        if placement != Replicate():
            raise FullyShardValueError(
                f"parameter {fqn!r} is placed {placement!r} on the data-parallel dim {name!r}; "
                "with dp_mesh_dims the parameters must be Replicate() on every data-parallel "
                f"dim {plan.dp_names} (fully_shard shards them there itself)"
            )
    _check_placements(placements, fqn, f"mesh {full}")


@dataclass(frozen=True)
class SPMDMesh:
    """The meshes of a checked :class:`SPMDPlan`, built.

    Attributes:
        plan: what was checked.
        info: the data-parallel view (1-D shard mesh, or 2-D (replicate, shard) for HSDP)
            whose process groups gather and reduce.
        spec: the mesh the sharded DTensors live on (``plan.spec_dims``).

    Example:
        >>> spmd = build_spmd_mesh(check_dp_mesh_dims(world, dims))  # doctest: +SKIP
        >>> spmd.info.shard_size  # doctest: +SKIP
        2
    """

    plan: SPMDPlan
    info: MeshInfo
    spec: DeviceMesh


def build_spmd_mesh(plan: SPMDPlan) -> SPMDMesh:
    """Build the dp mesh and the sharded DTensors' mesh (flattening dims: collective)."""
    full = plan.full

    def dim_mesh(group: tuple[str, ...]) -> DeviceMesh:
        return full[group[0]] if len(group) == 1 else flatten_mesh(full, group)

    shard, replicate = plan.shard_names, plan.replicate_names
    hsdp = replicate + shard  # the (replicate, shard) order of a 2-D dp mesh
    if not replicate:
        dp = dim_mesh(shard)
    elif len(hsdp) == 2 and _in_order(full, hsdp):
        dp = full[hsdp]
    else:
        dp = concatenate_meshes([dim_mesh(replicate), dim_mesh(shard)])
    if all(len(group) == 1 for group in plan.spec_dims):
        spec = full
    else:
        spec = concatenate_meshes([dim_mesh(group) for group in plan.spec_dims])
    return SPMDMesh(plan=plan, info=mesh_info(dp), spec=spec)


def _in_order(mesh: DeviceMesh, names: tuple[str, ...]) -> bool:
    order = mesh.mesh_dim_names or ()
    return list(names) == sorted(names, key=order.index)


def spmd_layout(spmd: SPMDMesh, param: DTensor) -> TPLayout:
    """The layout of ``param`` (checked by :func:`check_spmd_param`) on ``spmd.spec``."""
    plan = spmd.plan
    names = plan.full.mesh_dim_names or ()
    placements = tuple(param.placements)
    base: list[Placement] = []
    for group in plan.spec_dims:
        dp = group in (plan.shard_names, plan.replicate_names)
        base.append(Replicate() if dp else placements[names.index(group[0])])
    size = param.size()
    return TPLayout(
        mesh=plan.full,
        placements=placements,
        size=size,
        stride=contiguous_stride(size),
        spmd=spmd.spec,
        base=tuple(base),
        shard_index=plan.spec_dims.index(plan.shard_names),
        dp_dims=frozenset(names.index(n) for n in plan.dp_names),
    )
