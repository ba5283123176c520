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
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ._compat import root_mesh, strided_shard, strided_shard_handles_uneven
from .errors import FullyShardNotImplementedError, FullyShardValueError
from .mesh import MeshInfo, contiguous_stride


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

    def grad_placements(self, current: tuple[Placement, ...]) -> tuple[Placement, ...]:
        """The placements to bring an unsharded gradient (placed ``current``) to before taking
        its local tensor: the parameter's own (a ``Partial`` TP gradient is summed first)."""
        return self.placements


def _check_placements(placements: tuple[Placement, ...], fqn: str, where: str) -> None:
    for placement in placements:
        if type(placement) not in (Shard, Replicate):  # not a strided or other subclass
            raise FullyShardValueError(
                f"parameter {fqn!r} is placed {placement} on its {where}; only Shard(dim) and "
                "Replicate() parameters can be sharded further"
            )


def tp_layout(info: MeshInfo, param: DTensor, fqn: str) -> TPLayout:
    """Check that ``param``'s mesh composes with the dp mesh ``info`` and describe its layout.

    The dp mesh (1-D, or 2-D for HSDP) and the parameter's 1-D TP mesh must be different
    named dims of one root mesh, e.g. ``root["dp"]`` / ``root["replicate", "shard"]`` and
    ``root["tp"]``.
    """
    tp_mesh = param.device_mesh
    dp_names = info.mesh.mesh_dim_names
    tp_names = tp_mesh.mesh_dim_names
    if tp_mesh == info.mesh or (dp_names and tp_names and set(dp_names) & set(tp_names)):
        raise FullyShardValueError(
            f"parameter {fqn!r} is already a DTensor on mesh {tp_mesh}, placed "
            f"{tuple(param.placements)}, over the same dims as the fully_shard mesh "
            f"{info.mesh}; fully_shard shards plain parameters itself: pass the module with "
            "plain tensors, or parallelize it on another dim of one mesh (tensor parallel "
            'on root["tp"], fully_shard on root["dp"]); for parameters that are DTensors on '
            "the whole mesh pass dp_mesh_dims=DataParallelMeshDims(...)"
        )
    if tp_mesh.ndim != 1:
        raise FullyShardNotImplementedError(
            f"parameter {fqn!r} is a DTensor on a {tp_mesh.ndim}-D mesh {tp_mesh}; fully_shard "
            "composes with 1-D tensor-parallel meshes only (or pass the whole mesh with "
            "dp_mesh_dims=DataParallelMeshDims(...))"
        )
    # Compared by value, not by parent identity: DTensor may hand back an equal mesh object
    # that an earlier, equal-looking mesh created (its parent is then that other mesh).
    root = root_mesh(info.mesh)
    root_names = root.mesh_dim_names or ()
    if (
        dp_names is None
        or tp_names is None
        or tp_names[0] not in root_names
        or root[tp_names[0]] != tp_mesh
    ):
        raise FullyShardValueError(
            f"parameter {fqn!r} is a DTensor on mesh {tp_mesh}, which is not a sub-mesh of "
            f"the same parent as the fully_shard mesh {info.mesh}; build one named mesh, "
            'root = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp")) (or '
            '("replicate", "shard", "tp") for HSDP), parallelize with root["tp"] and pass '
            'mesh=root["dp"] (or root["replicate", "shard"])'
        )
    own = (*dp_names, *tp_names)
    if any(name not in root_names for name in dp_names):
        raise FullyShardNotImplementedError(
            f"parameter {fqn!r} is a DTensor on mesh {tp_mesh} and fully_shard got mesh "
            f"{info.mesh}, whose dims {dp_names} are not all dims of its parent {root} (a "
            "flattened dim?); slice both meshes from the parent by its dim names, or pass the "
            "parent with dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)"
        )
    placements = tuple(param.placements)
    _check_placements(placements, fqn, "tensor-parallel mesh")
    names = sorted(own, key=root_names.index)
    spmd = root if len(names) == root.ndim else root[tuple(names)]
    base: list[Placement] = [Replicate()] * len(names)
    base[names.index(tp_names[0])] = placements[0]
    size = param.size()
    return TPLayout(
        mesh=tp_mesh,
        placements=placements,
        size=size,
        stride=contiguous_stride(size),
        spmd=spmd,
        base=tuple(base),
        shard_index=names.index(dp_names[info.shard_mesh_dim]),
    )


def tp_sharded_dims(layout: TPLayout) -> set[int]:
    """The tensor dims the parameter's own placements already shard."""
    return {p.dim for p in layout.base if isinstance(p, Shard)}


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
