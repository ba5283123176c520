"""What a group moves, decided once: the description both runtimes execute.

A group's all-gather and reduction are fixed by facts that change only when its options do
(a ``set_*`` call replaces its :class:`~fully_shard.group.GroupConfig`) or when its shards are
replaced (``model.to(dtype)``, ``to_empty()``): each parameter's row split and padding, the
dtype it is gathered and computed in, the group's reduce dtype, the ops and divide factors of
its reduce-scatter and HSDP all-reduce, the process groups. :func:`describe` reads them once
into a frozen :class:`GroupDescription`; :attr:`ParamGroup.description
<fully_shard.group.ParamGroup.description>` keeps it until one of those changes. The eager
engine (``group.py``, driven by ``hooks.py``) and the traced one (``graph.py``) both execute
it; neither re-derives a layout, a dtype or a reduction rule::

    GroupDescription (group "layers.0", W = 2, gathers fp32 as one fp32 buffer)
      slots: w1  dim 0, chunk 8 of 15 rows, padded (8, 16) = 128 elements
             w2  dim 0, chunk 8 of 16 rows, padded (8, 15) = 120 elements
      all-gather: (W * 248,) fp32, rank r's 248 at [r * 248, (r + 1) * 248)
      reduce: fp32, reduce-scatter avg over "shard", all-reduce none, then / 1

What stays per step, because it can change between steps without a ``set_*`` call: which
parameters are trainable now (``requires_grad_()`` after ``fully_shard``), which got a
gradient, and the inputs of a gather whose sizes its source decides (a tensor subclass's own
all-gather, int8 blocks, a post-forward piece of ``reshard_after_forward=n``).

Example:
    >>> desc = model.layers[0]._fsdp_state.groups[0].description  # doctest: +SKIP
    >>> desc.world, desc.wire_dtype, desc.gather_total  # doctest: +SKIP
    (2, torch.float32, 248)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .collectives import ReducePlan, plan_reduction
from .packing import wire_dtype
from .persist import KeptWhole
from .quantize import PLAIN
from .storage import DenseStorage, WholeShard

if TYPE_CHECKING:
    from .group import GroupConfig
    from .mesh import MeshInfo
    from .param import ShardedParam
    from .persist import PersistentParam


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in its group's buffers, as plain numbers (the traced runtime reads
    fields, not properties).

    Attributes:
        dim: the tensor dim split over the shard ranks.
        world: how many ranks share it; ``chunk`` rows each, padded (``torch.chunk``'s split,
            :func:`fully_shard.layout.split_rows`); ``local_rows`` of them real on this rank.
        size: the unpadded full shape; ``padded_shard`` what every rank sends
            (``chunk`` rows on ``dim``), ``padded_numel`` its elements.
        compute_dtype: the dtype it is gathered and computed in (``param_dtype``, or its own
            where ``param_dtype_override_fn`` keeps it).
        orig_dtype: the sharded parameter's dtype (what the optimizer steps).

    Example:
        >>> slot = desc.slots[0]  # doctest: +SKIP
        >>> slot.chunk * slot.world >= slot.size[slot.dim]  # doctest: +SKIP
        True
    """

    dim: int
    world: int
    chunk: int
    local_rows: int
    size: tuple[int, ...]
    padded_shard: tuple[int, ...]
    padded_numel: int
    compute_dtype: torch.dtype
    orig_dtype: torch.dtype


@dataclass(frozen=True)
class GroupDescription:
    """What one group moves: its layout, dtypes, process groups and reductions.

    Attributes:
        slots: one :class:`ParamSlot` per parameter, in group order.
        world, rank: the shard group's size and this rank's index in it.
        shard_group, shard_group_name: the group parameters are gathered over (the name is
            what functional collectives take).
        reduce_group, reduce_group_name: the group gradients are reduce-scattered over:
            ``set_reduce_scatter_group``'s, or the shard group.
        replicate_group, replicate_group_name, replicate_size: HSDP's replicas (``None`` and
            1 without).
        device: the compute device: where buffers are made.
        wire_dtype, gather_sizes, gather_total: the flat all-gather buffer when every
            parameter sends its plain shard (cast to its compute dtype; mixed dtypes travel as
            ``uint8`` bytes), each input's length in wire elements, and their sum (this rank's
            slice); ``wire_dtype`` is ``None`` when a source decides its inputs at each gather
            (a tensor subclass, int8 blocks), and a parameter that one shard rank holds whole
            in its compute dtype sends nothing.
        pieces: the parameters by compute dtype, in group order: the traced gather sends one
            buffer per piece (one piece unless ``param_dtype_override_fn`` mixes dtypes).
        reduce_dtype: the dtype gradients are packed and reduced in.
        reduction: the reduce-scatter, HSDP all-reduce and last division
            (:func:`~fully_shard.collectives.plan_reduction`), and ``one_rank_divisor`` the
            reduce-scatter's divisions when one shard rank skips it.
        native_avg: the backend has an AVG op (NCCL); gloo sums and divides.
        sync, reduce_unused, unshard_in_backward: the options of the same names
            (``requires_gradient_sync``, ``reduce_scatter_unused_params``).
        input_dtype: the dtype the group's module's floating-point forward inputs are cast
            to (``MixedPrecisionPolicy.forward_input_dtype``), or ``None`` to leave them.
        kept_whole: the parameters kept whole on every rank (``param_persistence_threshold``,
            :mod:`fully_shard.persist`), the third placement beside the slots' ``Shard``:
            never gathered, their gradients all-reduced at the end of backward as this
            says; ``None`` when the group has none. The slots, the gather and the
            reduce-scatter hold only the sharded parameters.

    Example:
        >>> group.description.reduction.reduce_scatter.op  # doctest: +SKIP
        'avg'
    """

    slots: tuple[ParamSlot, ...]
    world: int
    rank: int
    shard_group: dist.ProcessGroup
    shard_group_name: str
    reduce_group: dist.ProcessGroup
    reduce_group_name: str
    replicate_group: dist.ProcessGroup | None
    replicate_group_name: str | None
    replicate_size: int
    device: torch.device
    wire_dtype: torch.dtype | None
    gather_sizes: tuple[int, ...]
    gather_total: int
    pieces: tuple[tuple[int, ...], ...]
    reduce_dtype: torch.dtype
    reduction: ReducePlan
    one_rank_divisor: float
    native_avg: bool
    sync: bool
    reduce_unused: bool
    unshard_in_backward: bool
    input_dtype: torch.dtype | None
    kept_whole: KeptWhole | None = None


def _slot(p: ShardedParam) -> ParamSlot:
    layout = p.layout
    return ParamSlot(
        dim=layout.dim,
        world=layout.world,
        chunk=layout.chunk,
        local_rows=layout.local_rows,
        size=tuple(layout.size),
        padded_shard=tuple(layout.padded_shard_size),
        padded_numel=layout.padded_numel,
        compute_dtype=p.mp_policy.compute_dtype(p.orig_dtype),
        orig_dtype=p.orig_dtype,
    )


def _plain_gather(
    params: list[ShardedParam], slots: tuple[ParamSlot, ...], config: GroupConfig
) -> tuple[torch.dtype | None, tuple[int, ...]]:
    """The wire dtype and input sizes when every parameter sends its plain shard (or nothing,
    one rank holding it whole); ``(None, ())`` when some source decides its own inputs."""
    sent: list[ParamSlot] = []
    for p, slot in zip(params, slots, strict=True):
        side = p.unsharded_side
        if isinstance(side, WholeShard):
            continue
        if (
            not isinstance(side, DenseStorage)
            or p.gather_format(config.quantization_policy) is not PLAIN
        ):
            return None, ()
        sent.append(slot)
    if not sent:
        return None, ()
    wire = wire_dtype([s.compute_dtype for s in sent])
    if wire == torch.uint8:
        return wire, tuple(s.padded_numel * s.compute_dtype.itemsize for s in sent)
    return wire, tuple(s.padded_numel for s in sent)


def _reduce_dtype(params: Sequence[ShardedParam | PersistentParam]) -> torch.dtype:
    """One reduce dtype per group (``fully_shard`` checked the trainable parameters agree)."""
    trainable = [p for p in params if p.sharded_param.requires_grad] or params
    first = trainable[0]
    return first.mp_policy.reduce_dtype_for(first.orig_dtype)


def _kept_whole(
    persistent: Sequence[PersistentParam], info: MeshInfo, config: GroupConfig, dtype: torch.dtype
) -> KeptWhole | None:
    """The end-of-backward all-reduce of the persistent parameters: a sum over every
    data-parallel rank, divided as the group's reduction divides (its plan for one flat
    group of them all: the division split around the sum where the dtype could overflow)."""
    if not persistent:
        return None
    plan = plan_reduction(
        dtype,
        info.dp_size,
        1,
        factor=config.gradient_divide_factor,
        force_sum=True,
        device_type=info.device.type,
    )
    replicate = info.replicate_group
    return KeptWhole(
        fqns=tuple(p.fqn for p in persistent),
        groups=(info.shard_group,) if replicate is None else (info.shard_group, replicate),
        pre_divide=plan.reduce_scatter.pre_divide,
        post_divide=plan.post_divide,
    )


def describe(
    params: list[ShardedParam],
    info: MeshInfo,
    config: GroupConfig,
    persistent: Sequence[PersistentParam] = (),
) -> GroupDescription:
    """Read the description of a group of ``params`` (and ``persistent`` ones, kept whole)
    on ``info`` with ``config``, now.

    Example:
        >>> desc = describe(group.params, group.info, group.config)  # doctest: +SKIP
    """
    slots = tuple(_slot(p) for p in params)
    wire, sizes = _plain_gather(params, slots, config)
    pieces: dict[torch.dtype, list[int]] = {}
    for i, slot in enumerate(slots):
        pieces.setdefault(slot.compute_dtype, []).append(i)
    both: list[ShardedParam | PersistentParam] = [*params, *persistent]
    reduce_dtype = _reduce_dtype(both) if both else torch.float32
    reduction = plan_reduction(
        reduce_dtype,
        info.shard_size,
        info.replicate_size,
        factor=config.gradient_divide_factor,
        force_sum=config.force_sum_reduction_for_comms,
        device_type=info.device.type,
    )
    replicate = info.replicate_group
    reduce_group = config.reduce_scatter_group or info.shard_group
    return GroupDescription(
        slots=slots,
        world=info.shard_size,
        rank=info.shard_rank,
        shard_group=info.shard_group,
        shard_group_name=info.shard_group.group_name,
        reduce_group=reduce_group,
        reduce_group_name=reduce_group.group_name,
        replicate_group=replicate,
        replicate_group_name=None if replicate is None else replicate.group_name,
        replicate_size=info.replicate_size,
        device=info.device,
        wire_dtype=wire,
        gather_sizes=sizes,
        gather_total=sum(sizes),
        pieces=tuple(tuple(ix) for ix in pieces.values()),
        reduce_dtype=reduce_dtype,
        reduction=reduction,
        one_rank_divisor=reduction.reduce_scatter.divisor(group_size=1),
        native_avg=dist.get_backend(info.shard_group) != dist.Backend.GLOO,
        sync=config.requires_gradient_sync,
        reduce_unused=config.reduce_scatter_unused_params,
        unshard_in_backward=config.unshard_in_backward,
        input_dtype=config.mp_policy.forward_input_dtype(),
        kept_whole=_kept_whole(persistent, info, config, reduce_dtype),
    )


def offsets(slots: tuple[ParamSlot, ...], members: list[int]) -> tuple[list[int], int]:
    """Where each of ``members`` (slot indices, in order) starts in one rank's row of a packed
    gradient buffer, and the row's length: the layout both runtimes pack gradients in.

    Example:
        >>> offsets(desc.slots, [0, 1])  # doctest: +SKIP
        ([0, 128], 248)
    """
    starts, total = [], 0
    for i in members:
        starts.append(total)
        total += slots[i].padded_numel
    return starts, total
