"""``ParamGroup``: the parameters of one ``fully_shard`` call, gathered and reduced together.

A group is the unit of communication: one all-gather brings all its parameters, one
reduce-scatter sends all its gradients. It is always in exactly one :class:`GroupState`; every
change goes through :meth:`ParamGroup._transition`, which checks the table below.

An all-gather, from the group's side: each parameter gives its inputs
(:meth:`ShardedParam.all_gather_inputs`); their dtypes and sizes, read now, decide the flat
buffer (one dtype, or ``uint8`` bytes for a mixed group); this rank's inputs are written
into its slice of the output (padding as zeros) and the output is gathered in place; then each
parameter gets its blocks back (copied straight into its storage where a view allows).

``reshard_after_forward=n`` adds one more place the parameters can be between forward and
backward: SHARDED, with every parameter holding its piece of an n-rank split
(:meth:`ParamGroup.reshard_after_forward`). The next unshard gathers those pieces within the
n-rank group, if no sharded parameter changed since; otherwise it drops them and gathers the
shards over the whole shard world.
"""

from __future__ import annotations

import contextlib
import enum
import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ._compat import local_tensor, profiler_enabled, set_grad_enabled, version
from .collectives import (
    Comm,
    Reduction,
    UserAllGather,
    UserReduceScatter,
    Waitable,
    divide_,
)
from .description import GroupDescription, describe, offsets
from .errors import FullyShardStateError
from .extensions import check_extension_plan
from .mesh import MeshInfo, SubgroupInfo
from .observer import (
    JOB_WIDE,
    CollectiveCall,
    Observer,
    ProfilerLabels,
    SpanKind,
    issue_observed,
)
from .packing import (
    GatherInput,
    ProcessGroupAllocator,
    allocate_buffer,
    copy_in,
    copy_out,
    pack_grads,
    split_sizes,
    whole_inputs,
    wire_dtype,
)
from .param import ShardedParam
from .persist import PersistentParam
from .policies import MixedPrecisionPolicy, OffloadPolicy, QuantizationPolicy
from .quantize import PLAIN
from .storage import DenseStorage, WholeShard


class GroupState(enum.Enum):
    """Where a group's parameters are: sharded, being gathered, or gathered."""

    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # all-gather issued, not yet waited for and copied out
    UNSHARDED = "unsharded"

    # Members are singletons: hash by identity in C. Enum's own __hash__ is a Python function,
    # and every transition check hashes two states (bench_overhead counts the calls).
    __hash__ = object.__hash__


_TRANSITIONS: dict[GroupState, frozenset[GroupState]] = {
    GroupState.SHARDED: frozenset({GroupState.UNSHARDING}),
    GroupState.UNSHARDING: frozenset({GroupState.UNSHARDED}),
    GroupState.UNSHARDED: frozenset({GroupState.SHARDED}),
}


@dataclass(frozen=True)
class GroupConfig:
    """The options of one group; ``FSDPModule.set_*`` replaces it with ``dataclasses.replace``.

    Attributes:
        reshard_after_forward: free the unsharded parameters after forward (and gather again
            for backward). ``None`` until the root's lazy init resolves it: ``False`` for the
            root, ``True`` for the others.
        reshard_after_backward: free them after backward. ``False`` keeps them gathered for
            the next forward (useful between gradient-accumulation micro-batches; the copies
            go stale once the optimizer steps).
        requires_gradient_sync: reduce-scatter gradients in backward. ``False`` keeps the
            unsharded gradients locally until a backward with sync on.
        mp_policy: dtypes for all-gather, compute and reduction.
        quantization_policy: which parameters all-gather block-quantized to int8.
        offload_policy: where the sharded state lives.
        post_forward: with ``reshard_after_forward=True``, reshard after forward only to this
            group of n consecutive shard ranks (``fully_shard(..., reshard_after_forward=n)``):
            each rank keeps 1/n of the padded parameters, and backward all-gathers within the
            n ranks. ``None``: reshard to the whole shard world.
        requires_all_reduce: HSDP: all-reduce the reduce-scattered gradients over the
            replicate dim. ``False`` keeps them (summed over backward passes) in the group
            until a backward with it on; the sharded ``.grad`` is not touched meanwhile.
        all_reduce_hook: called with the reduced gradient buffer ``(total,)`` (reduce dtype)
            after the reduce-scatter (1-D) or the HSDP all-reduce, before the last division.
        gradient_divide_factor: divide the summed gradients by this instead of the
            data-parallel size.
        force_sum_reduction_for_comms: collectives only ever sum; divisions run separately.
        unshard_in_backward: all-gather for backward (``False``: the parameters are not
            needed there, e.g. an embedding's).
        all_gather_comm, reduce_scatter_comm: a user's ``AllGather`` / ``ReduceScatter``.
        reduce_scatter_unused_params: reduce zeros for a trainable parameter that got no
            gradient in this backward, so that every rank sends the same layout.
        reduce_scatter_max_input_buffers: reduce-scatter inputs that may be in flight
            (CUDA overlap dial; recorded).
        reduce_scatter_group: a separate process group for the reduce-scatters, or ``None``
            for the shard group.
        allocate_from_process_group: take communication buffers from the process group's
            own allocator where the backend has one.
        symm_mem_backend: ``"NCCL"`` once ``set_symm_mem_for_comm`` was called (recorded).
        keep_unsharded_storage: a reshard registers the sharded parameters again but keeps the
            unsharded storage allocated, so every unshard writes into the same addresses
            (CUDA graphs replaying a captured step need them); costs the group's unsharded
            bytes for as long as it is set.
        compile_region: when the whole model is compiled (the graph path), trace this
            group's module as a nested compile region, once per block structure and called
            again for the others (``fully_shard.graph``); ``False`` traces it inline.
    """

    reshard_after_forward: bool | None = None
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    quantization_policy: QuantizationPolicy = field(default_factory=QuantizationPolicy)
    offload_policy: OffloadPolicy = field(default_factory=OffloadPolicy)
    post_forward: SubgroupInfo | None = None
    requires_all_reduce: bool = True
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    gradient_divide_factor: float | None = None
    force_sum_reduction_for_comms: bool = False
    unshard_in_backward: bool = True
    all_gather_comm: Any = None  # AllGather (ours or torch's: duck-typed)
    reduce_scatter_comm: Any = None  # ReduceScatter
    reduce_scatter_unused_params: bool = False
    reduce_scatter_max_input_buffers: int = 1
    reduce_scatter_group: dist.ProcessGroup | None = None
    allocate_from_process_group: bool = False
    symm_mem_backend: str | None = None
    keep_unsharded_storage: bool = False
    compile_region: bool = True


@dataclass
class _PendingGather:
    """An all-gather issued by :meth:`ParamGroup.unshard`, until its copy-out (never changed
    after it is made)."""

    work: Waitable | None
    # (world * total,) in the wire dtype; this rank's input is slice rank. None: nothing to
    # send (every shard is its unsharded tensor, WholeShard), so no buffer was made.
    output: torch.Tensor | None
    world: int
    inputs: list[list[GatherInput]]  # per parameter
    sizes: tuple[int, ...]  # per input, in wire elements
    # Plain dense shards in the description's layout: _copy_out may take (or establish) the
    # group's _DenseGather.
    plain: bool = False
    # A kept bucket's one copy-out for all its groups (SharedCopy), or None: this group's own.
    shared: SharedCopy | None = None


@dataclass
class _SharedInputs:
    """What a group sends in a bucket's all-gather: its inputs in the description's layout,
    their flat views when each fills its slot (one ``torch.cat``), per parameter (empty when
    replayed from the group's :class:`_DenseGather`), and whether the copy-out may take (or
    establish) the dense replay."""

    flat: list[GatherInput]
    whole: list[torch.Tensor] | None
    per_param: list[list[GatherInput]]
    plain: bool


@dataclass
class _DenseGather:
    """What a group's plain gathers repeat under one description (every side a
    :class:`~fully_shard.storage.DenseStorage`, every parameter one plain input in the
    description's layout, straight into storage): the wire dtype, the inputs (each
    ``data`` is the local shard itself), their flat views when each fills its slot (one
    ``torch.cat``), each storage's bytes object and full size, and the copy-out views."""

    wire: torch.dtype
    inputs: list[GatherInput]
    whole: list[torch.Tensor] | None
    storages: list[tuple[torch.UntypedStorage, int]]
    destinations: list[torch.Tensor]


# What unshard leaves when every shard is its unsharded tensor and nothing is sent (one
# shard rank, WholeShard): wait_for_unshard has nothing to copy.
_NOTHING_SENT = _PendingGather(None, None, 1, [], ())

# ParamGroup._gathered_versions when the gathered tensors are the shards themselves.
_ALIASED: tuple[int, ...] = (-1,)
# ShardedParam.local_shard's tensor, read as a C call (ParamGroup._reduces_to_itself).
_LOCAL_SHARD = operator.attrgetter("_local")


@dataclass
class _PendingReduce:
    work: Waitable | None
    output: torch.Tensor  # (total,) this rank's reduced chunk, in the reduce dtype
    input: torch.Tensor  # (W * total,) kept alive until the collective is done
    params: list[ShardedParam]
    offsets: list[int]


@dataclass
class _DirectReduce:
    """One shard rank, no replicas, nothing to divide and no hook: each gradient, in the
    parameter's dtype and on its device, is its own reduction and becomes the sharded
    gradient as it is (no buffer, no copy)."""

    params: list[ShardedParam]
    grads: list[torch.Tensor]
    work: Waitable | None = None  # no collective; read beside _PendingReduce's on a reset


@dataclass
class SharedReduce:
    """A reduction that a bucket (:mod:`fully_shard.bucket`) issued for several groups at once:
    every member holds the same one, and finishing it from any member finishes them all.

    Attributes:
        work: the bucket's collective (waited at most once), read on a reset like the others'.
        finish: waits for it and adds each member's slice into its sharded gradients.
    """

    work: Waitable | None
    finish: Callable[[], None]


def accumulate_grads(grads: Iterable[tuple[ShardedParam, torch.Tensor]]) -> None:
    """Add each reduced gradient into its parameter's sharded ``.grad``, with autograd off (in
    place on the DTensor's own local tensor): a group's reduction, or a bucket's for all its
    groups."""
    grad_was = torch.is_grad_enabled()
    set_grad_enabled(False)
    try:
        for p, local_grad in grads:
            p.accumulate_sharded_grad(local_grad)
    finally:
        set_grad_enabled(grad_was)


class SharedCopy:
    """One copy-out for every group of a bucket whose parameters stay gathered after forward
    (:mod:`fully_shard.bucket`): the first member to wait copies the bucket's ``(W, total)``
    columns into every member's storage with one ``split_with_sizes_copy``, and the others
    find theirs there. Their storages are then all allocated at the first member's forward,
    as they would all be by the last member's (they stay gathered until backward), while the
    gathered buffer is alive either way: nothing more is held, and one copy is issued instead
    of one per group.

    Only groups that replay their plain dense copy-out (:class:`_DenseGather`) under their
    current description and still wait for this gather take part; if any member cannot (its
    options changed between the gather and the wait), each copies its own.
    """

    def __init__(
        self, rows: torch.Tensor, members: list[ParamGroup], sizes: list[int], totals: list[int]
    ) -> None:
        self._rows = rows  # (W, bucket total) in the wire dtype
        self._members = members  # in column order
        self._sizes = sizes  # every member's parameters' columns, in order
        self._totals = totals  # each member's columns
        self._tried = False
        self._filled = False  # every member's columns copied out (all or none)

    def fill(self, caller: ParamGroup) -> bool:
        """Copy every member's columns out (once); whether they were (``caller``, a member,
        has just cleared its pending gather: it counts as waiting)."""
        if not self._tried:
            self._tried = True
            dests: list[torch.Tensor] = []
            for group in self._members:
                dense = group._dense
                pending = group._gather
                waiting = group is caller or (pending is not None and pending.shared is self)
                if dense is None or group._dense_for is not group._description or not waiting:
                    return False  # each member copies its own columns (columns())
                dests.extend(dense.destinations)
            for group in self._members:
                for untyped, nbytes in group._dense.storages:  # type: ignore[union-attr]
                    if untyped.nbytes() != nbytes:
                        untyped.resize_(nbytes)
            rows = self._rows
            copy_out(rows, rows.size(0), self._sizes, dests)
            self._filled = True
        return self._filled

    def columns(self, group: ParamGroup) -> torch.Tensor:
        """``group``'s ``(W, gather_total)`` columns of the bucket's buffer, for its own
        copy-out when :meth:`fill` did not fill it."""
        i = self._members.index(group)
        return self._rows.narrow(1, sum(self._totals[:i]), self._totals[i])


class Bucketing(Protocol):
    """What a group asks of the bucket it belongs to (:class:`fully_shard.bucket.Buckets`):
    whether the bucket takes over this unshard, or this reduction, for several groups at once.
    """

    def unshard(self, group: ParamGroup, async_op: bool) -> bool:
        """Issue one all-gather for ``group`` and the bucket's next groups; False: not taken."""
        ...

    def park(self, group: ParamGroup, packed: list[tuple[int, torch.Tensor | None]]) -> bool:
        """Keep ``group``'s gradients for the bucket's reduce-scatter; False: not taken."""
        ...


@dataclass
class _PartialReduce:
    """HSDP with ``requires_all_reduce`` off: reduce-scattered, not yet all-reduced, summed."""

    output: torch.Tensor  # (total,) in the reduce dtype, before the last division
    params: list[ShardedParam]
    offsets: list[int]

    def slice_of(self, p: ShardedParam) -> torch.Tensor | None:
        for q, off in zip(self.params, self.offsets, strict=True):
            if q is p:
                return self.output[off : off + p.padded_numel]
        return None


class ParamGroup:
    """The parameters one ``fully_shard`` call owns, and their shared all-gather/reduce buffers.

    Example:
        >>> group = model._fsdp_state.group  # doctest: +SKIP
        >>> group.state, len(group.params)  # doctest: +SKIP
        (<GroupState.SHARDED: 'sharded'>, 4)
    """

    def __init__(
        self,
        params: list[ShardedParam],
        modules: tuple[nn.Module, ...],
        info: MeshInfo,
        config: GroupConfig,
        comm: Comm,
        persistent: list[PersistentParam] | None = None,
    ) -> None:
        self.params = params
        # The parameters kept whole on every rank (param_persistence_threshold): shown at
        # every unshard and hidden at every reshard, never gathered or reduce-scattered.
        self.persistent: list[PersistentParam] = [] if persistent is None else persistent
        # Their gradients wait for the end of backward's all-reduce (a post-backward with
        # gradient sync on ran since the last one: fully_shard.persist).
        self.persistent_ready = False
        self.modules = modules
        self.info = info
        self.config = config
        # The configs this group has had, by value (module.py's _replace_config: set_* calls
        # take an equal one back, so that the graph path may guard on identity).
        self.configs_seen: dict[GroupConfig, GroupConfig] = {}
        # What the group moves (fully_shard.description), read at the first use after the
        # config (a set_* call replaces the object) or the shards changed, and the config it
        # was read from: both runtimes execute it.
        self._description: GroupDescription | None = None
        self._described: GroupConfig | None = None
        # The description under which every shard was found to be its unsharded tensor
        # (one shard rank, WholeShard sides) and the unsharded parameters were made: its
        # unshards send, allocate and copy nothing (a new description looks again).
        self._whole_for: GroupDescription | None = None
        # Likewise for plain dense gathers: what they repeat, and the description it is for.
        self._dense: _DenseGather | None = None
        self._dense_for: GroupDescription | None = None
        self.comm = comm
        self.state = GroupState.SHARDED
        self._gather: _PendingGather | None = None  # only while UNSHARDING
        self._pending_reduce: _PendingReduce | _DirectReduce | SharedReduce | None = None
        # The buckets this group's collectives merge into (set_bucket_cap_mb), or None.
        self.bucket: Bucketing | None = None
        # Kept across backward passes (like gradients with sync off), not per iteration.
        self._partial_reduce: _PartialReduce | None = None
        # The graph path's gradient accumulator (fully_shard.graph): a leaf whose .grad sums
        # the packed unreduced gradients of compiled backward passes with gradient sync off.
        self.graph_grads: torch.Tensor | None = None
        # Its twin for the kept-whole parameters' gradients (flat, unpadded, in group order).
        self.graph_kept_grads: torch.Tensor | None = None
        self._initialized = False
        # Whether a parameter may hold a post-forward piece (reshard_after_forward=n): set
        # when one is cut, cleared when they are dropped, so that the usual reshard and
        # unshard skip the per-parameter drop.
        self._pieces_cut = False
        # The sharded parameters (sync_with_module replaces them and bumps the count), read by
        # sharded_versions.
        self._sharded: tuple[nn.Parameter, ...] = tuple(p.sharded_param for p in params)
        self._sharded_count = 0
        # sharded_versions() when the gathered copy (and so any post-forward piece cut from it)
        # was taken; _ALIASED when the gathered tensors are the shards themselves.
        self._gathered_versions: tuple[int, ...] = ()
        # Who watches this group (fully_shard.observer): profiler labels always, tools while on.
        self.labels = ProfilerLabels()
        self.observers: tuple[Observer, ...] = (self.labels,)
        # While observers is this very tuple, begin / end have nobody to tell unless a
        # profiler records (or a label is open): the engine's hot paths test that inline and
        # make no call then (13 spans per group per step).
        self.unwatched = self.observers
        # The group's name in labels and messages: its modules' qualified names under the root,
        # set at the root's lazy init (until then, their class names).
        self.label = "+".join(type(m).__name__ for m in modules)
        # Each module's qualified name under the root ("" for the root), from the same moment:
        # messages name parameters from the root, as the user's state_dict() keys do.
        self.module_names: tuple[str, ...] = ()

    @property
    def description(self) -> GroupDescription:
        """What the group moves (:class:`~fully_shard.description.GroupDescription`), read once
        per config object (``set_*`` calls replace it) and per set of shards, and executed by
        both runtimes."""
        desc, config = self._description, self.config
        if desc is None or self._described is not config:
            desc = self._description = describe(self.params, self.info, config, self.persistent)
            self._described = config
        return desc

    def sync_with_module(self) -> None:
        """Pick up the shards ``Module._apply`` replaced (``to()``, ``to_empty()``) and read
        the description again at its next use: dtypes and sides may have changed."""
        for p in self.params:
            p.sync_with_module(self.config.quantization_policy)
        for pp in self.persistent:
            pp.sync_with_module()
        self._description = None
        self._sharded = tuple(p.sharded_param for p in self.params)
        self._sharded_count += 1

    def __repr__(self) -> str:
        quant = self.config.quantization_policy
        tag = f" (int8/{quant.block_size})"
        names = ", ".join(
            [p.fqn + (tag if p.gather_format(quant) is not PLAIN else "") for p in self.params]
            + [f"{pp.fqn} (whole)" for pp in self.persistent]
        )
        return f"ParamGroup([{names}], {self.state.name})"

    # -- observers --------------------------------------------------------------------------

    def begin(self, kind: SpanKind) -> None:
        """Tell the observers that a span of ``kind`` starts.

        Hot callers write this method's first test out before calling it (``observers is
        not unwatched or labels.open or profiler_enabled()``), and :meth:`end`'s likewise.
        """
        if self.observers is self.unwatched and not (self.labels.open or profiler_enabled()):
            return
        for observer in self.observers:
            observer.begin(self, kind)

    def end(self, kind: SpanKind) -> None:
        """Tell the observers that the span of ``kind`` ends."""
        if self.observers is self.unwatched and not self.labels.open:
            return
        for observer in reversed(self.observers):
            observer.end(self, kind)

    @contextlib.contextmanager
    def span(self, kind: SpanKind) -> Iterator[None]:
        """``begin`` / ``end`` around a block, ``end`` also when the block raises."""
        self.begin(kind)
        try:
            yield
        finally:
            self.end(kind)

    def _transition(self, new: GroupState, call: str) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise FullyShardStateError(
                f"rank {self.info.mesh.get_rank()}: {call} moved a parameter group from "
                f"{self.state.name} to {new.name}, which is not a legal transition "
                f"(group {self!r}); call reset_iter_state() on the root to recover"
            )
        self.state = new

    # -- lifecycle --------------------------------------------------------------------------

    def lazy_init(self, module_names: tuple[str, ...]) -> None:
        """Adopt parameters ``_apply`` replaced and create the unsharded parameter objects;
        ``module_names``: the group's modules' qualified names under the root.

        Runs once: a second root's lazy init (a submodule ran or was unsharded alone first)
        must not free a group that is gathered right now.
        """
        if self._initialized:
            return
        self._initialized = True
        self.module_names = module_names
        sub = self.config.post_forward
        self.sync_with_module()
        for p in self.params:
            if sub is not None:  # hooks patched on since fully_shard: refused as it would
                own = local_tensor(p.sharded_param)
                check_extension_plan(own, p.fqn, p.shard_dim, p.tp is not None, sub.size)
            if p.local_shard.device.type == "meta":
                raise FullyShardStateError(
                    f"parameter {self.name_from_root(p.fqn)!r} is still on the meta device at "
                    "the first forward; "
                    "call module.to_empty(device=...) and initialise the parameters "
                    "(e.g. reset_parameters()) before running the model"
                )
            p.alloc_storage()
            p.set_unsharded_grad_dtype()
            p.free_storage()
        for pp in self.persistent:
            if pp.local.device.type == "meta":
                raise FullyShardStateError(
                    f"parameter {self.name_from_root(pp.fqn)!r} is still on the meta device at "
                    "the first forward; call module.to_empty(device=...) and initialise the "
                    "parameters (e.g. reset_parameters()) before running the model"
                )

    def name_from_root(self, fqn: str) -> str:
        """A parameter's ``fqn`` (relative to the sharded module; ``[i].name`` in a list
        group) as its qualified name under the root (``layers.0.in_proj.weight``)."""
        index, rest = 0, fqn
        if len(self.modules) > 1 and fqn.startswith("[") and "]." in fqn:
            head, rest = fqn[1:].split("].", 1)
            index = int(head)
        prefix = self.module_names[index] if index < len(self.module_names) else ""
        return f"{prefix}.{rest}" if prefix else rest

    # -- unshard / reshard ------------------------------------------------------------------

    def unshard(self, async_op: bool) -> None:
        """Start gathering the full parameters (no-op unless SHARDED; hot callers test that
        first)."""
        state = self.state
        if state is not GroupState.SHARDED:
            return
        if self.bucket is not None and self.bucket.unshard(self, async_op):
            return
        if GroupState.UNSHARDING not in _TRANSITIONS[state]:  # the table, read inline
            self._transition(GroupState.UNSHARDING, "unshard()")
        self.state = GroupState.UNSHARDING
        if self.observers is not self.unwatched or self.labels.open or profiler_enabled():
            self.begin("unshard")
        if not self.params:
            return
        desc = self._description
        if desc is None or self._described is not self.config:
            desc = self.description
        if desc is self._whole_for:
            # Every shard is its unsharded tensor, already made for this description: nothing
            # is sent, allocated or copied (the general path below would find the same), and
            # what is shown cannot go stale.
            self._gathered_versions = _ALIASED
            self._gather = _NOTHING_SENT
            return
        if desc is self._dense_for and self._dense is not None:
            self._unshard_dense(desc, self._dense, async_op)
            return
        self._unshard_general(desc, async_op)

    def _unshard_general(self, desc: GroupDescription, async_op: bool) -> None:
        """Gather what each parameter's unsharded side sends, as its sources say now."""
        group, world, rank = desc.shard_group, desc.world, desc.rank
        sub = self.config.post_forward
        pieces = sub is not None and self._pieces_usable()
        if pieces and sub is not None:
            group, world, rank = sub.group, sub.size, sub.rank
        else:
            self._drop_pieces()
            self._gathered_versions = self.sharded_versions()
        # What is sent is data, never part of a graph (as in torch): unshard(async_op=True)
        # may be called from a forward with grad enabled, on shards that require grad (a
        # shard torch's replicate() made a Parameter of), and copying those into views of
        # the flat buffer with autograd recording would fail.
        grad_was = torch.is_grad_enabled()
        set_grad_enabled(False)  # torch.no_grad(), without its Python calls
        try:
            # Asked now, not at construction: dtypes follow model.to(dtype), sizes the source.
            quant = self.config.quantization_policy
            inputs = [p.all_gather_inputs(quant) for p in self.params]
            flat_inputs = [gi for per_param in inputs for gi in per_param]
            if not flat_inputs and self.config.all_gather_comm is None:
                # Nothing to send (one shard rank, every shard its unsharded tensor): no
                # buffer, no copy, no collective; wait_for_unshard shows the parameters.
                self._gather = _PendingGather(None, None, world, inputs, ())
                return
            wire: torch.dtype | None = desc.wire_dtype
            if wire is not None and not pieces:  # plain shards: the layout decided once
                sizes, total = desc.gather_sizes, desc.gather_total
            else:  # the sources decide (a subclass's inputs, int8 blocks, post-forward pieces)
                wire = wire_dtype([gi.dtype for gi in flat_inputs])
                sizes = tuple(split_sizes(flat_inputs, wire))
                total = sum(sizes)
            # In place: this rank's input is its own slice of the output, so no separate
            # input buffer exists.
            output = allocate_buffer(
                self._allocator(self.config.all_gather_comm), total * world, wire, self.info.device
            )
            flat_in = output.narrow(0, rank * total, total)
            copy_in(flat_in, flat_inputs)
        finally:
            set_grad_enabled(grad_was)
        work = self._issue_all_gather(output, flat_in, group, world, async_op)
        # The plain path the next unshards may take (_copy_out decides once it has the
        # destinations): the description's layout, every side dense, one input each.
        plain = (
            wire is desc.wire_dtype
            and not pieces
            and sub is None
            and self.config.all_gather_comm is None
            and not self.config.allocate_from_process_group
            and len(flat_inputs) == len(self.params)
            and all(isinstance(p.unsharded_side, DenseStorage) for p in self.params)
        )
        self._gather = _PendingGather(work, output, world, inputs, sizes, plain)

    def _issue_all_gather(
        self,
        output: torch.Tensor,
        flat_in: torch.Tensor,
        group: dist.ProcessGroup,
        world: int,
        async_op: bool,
    ) -> Waitable | None:
        if world == 1 and self.config.all_gather_comm is None:
            # One rank: the output is this rank's own input, so nothing is sent (and nothing
            # is counted: W=1 moves no bytes). A user's AllGather is still called.
            return None
        comm = self.comm if self.config.all_gather_comm is None else self._user_all_gather
        if self.observers is self.unwatched and not (JOB_WIDE.observers or profiler_enabled()):
            # Nobody to tell: the profiler labels would issue it as it is.
            return comm.all_gather(output, flat_in, group, async_op)
        return issue_observed(
            self,
            CollectiveCall("all_gather", flat_in, group),
            lambda: comm.all_gather(output, flat_in, group, async_op),
        )

    def _unshard_dense(self, desc: GroupDescription, dense: _DenseGather, async_op: bool) -> None:
        """The general path's work for plain dense shards, from what it found the first time
        under this description (:class:`_DenseGather`): the same buffer, bytes and collective."""
        if self._pieces_cut:
            self._drop_pieces()
        self._gathered_versions = self.sharded_versions()
        world, total = desc.world, desc.gather_total
        grad_was = torch.is_grad_enabled()
        set_grad_enabled(False)  # data, never part of a graph (as the general path)
        try:
            output = torch.empty(total * world, dtype=dense.wire, device=desc.device)
            flat_in = output.narrow(0, desc.rank * total, total)
            if dense.whole is not None:
                torch.cat(dense.whole, out=flat_in)  # copy_in's own shortcut
            else:
                copy_in(flat_in, dense.inputs)
        finally:
            set_grad_enabled(grad_was)
        work = self._issue_all_gather(output, flat_in, desc.shard_group, world, async_op)
        self._gather = _PendingGather(work, output, world, [], desc.gather_sizes, True)

    def _pieces_usable(self) -> bool:
        """Every parameter holds its post-forward piece and none changed since it was cut."""
        return all(p.has_post_forward() for p in self.params) and (
            self._gathered_versions == self.sharded_versions()
        )

    def _drop_pieces(self) -> None:
        if not self._pieces_cut:
            return
        self._pieces_cut = False
        for p in self.params:
            p.drop_post_forward()

    def wait_for_unshard(self) -> None:
        """Finish an unshard: wait for the all-gather, copy out, show the full parameters
        (no-op unless UNSHARDING; hot callers test that first)."""
        if self.state is not GroupState.UNSHARDING:
            return
        pending = self._gather
        self._gather = None
        if pending is not None:
            if pending.work is not None:
                pending.work.wait()
            if self.observers is not self.unwatched or self.labels.open or profiler_enabled():
                self.begin("all_gather_copy_out")
            if pending is not _NOTHING_SENT:
                grad_was = torch.is_grad_enabled()
                set_grad_enabled(False)  # data into storage, as the copy-in: never recorded
                try:
                    self._copy_out(pending)
                finally:
                    set_grad_enabled(grad_was)
            if self.observers is not self.unwatched or self.labels.open:
                self.end("all_gather_copy_out")
        for p in self.params:
            unsharded = p.unsharded_param
            if unsharded is None:
                raise RuntimeError(f"{p.fqn}: no unsharded parameter after alloc (internal error)")
            # Trainable is whatever the sharded parameter says now: requires_grad_() after
            # fully_shard is followed, not the value it had when it was wrapped.
            unsharded.requires_grad_(p.sharded_param.requires_grad)
            if p.post_forward_shown is not None:
                p.register(unsharded)
            else:  # ShardedParam.register, inline (twice per parameter per step)
                for module, name in p.slots:
                    module._parameters[name] = unsharded
        for pp in self.persistent:
            pp.show()
        if GroupState.UNSHARDED not in _TRANSITIONS[self.state]:
            self._transition(GroupState.UNSHARDED, "wait_for_unshard()")
        self.state = GroupState.UNSHARDED
        if self.observers is not self.unwatched or self.labels.open:
            self.end("unshard")

    def _copy_out(self, pending: _PendingGather) -> None:
        shared = pending.shared
        if shared is not None:
            if shared.fill(self):
                return  # the bucket's one copy-out filled this group's storage too
            pending = replace(pending, output=shared.columns(self), shared=None)
        dense = self._dense
        if pending.plain and dense is not None and self._dense_for is self._description:
            for untyped, nbytes in dense.storages:  # DenseStorage.alloc's resize
                if untyped.nbytes() != nbytes:
                    untyped.resize_(nbytes)
            if pending.output is not None:
                copy_out(pending.output, pending.world, pending.sizes, dense.destinations)
            return
        # Allocated only now, not at unshard: a prefetched group in flight holds just the
        # all-gather output.
        for p in self.params:
            p.alloc_storage()
        world, output = pending.world, pending.output
        if output is None:  # nothing was sent: the storage is the shard itself
            for p in self.params:
                p.finish_all_gather(None)
            if self.config.all_gather_comm is None and all(
                isinstance(p.unsharded_side, WholeShard) for p in self.params
            ):
                # The next unshards under this description need none of it (unshard).
                self._whole_for = self._description
            return
        dests = [p.all_gather_destinations() for p in self.params]
        if all(d is not None for d in dests):
            flat_dests = [t for d in dests if d is not None for t in d]
            copy_out(output, world, pending.sizes, flat_dests)
            for p in self.params:
                p.finish_all_gather(None)
            if pending.plain:
                self._remember_dense(pending, flat_dests, output.dtype)
            return
        blocks = list(torch.split(output.view(world, -1), list(pending.sizes), dim=1))
        for p, inputs in zip(self.params, pending.inputs, strict=True):
            mine, blocks = blocks[: len(inputs)], blocks[len(inputs) :]
            p.finish_all_gather(mine)

    def _remember_dense(
        self, pending: _PendingGather, dests: list[torch.Tensor], wire: torch.dtype
    ) -> None:
        """After a plain gather copied straight into every storage: what the next unshards
        under this description repeat (the inputs are the shards themselves, updated in place
        by the optimizer; the storages and their views live as long as the sides)."""
        inputs = [gi for per_param in pending.inputs for gi in per_param]
        storages = []
        for p in self.params:
            side = p.unsharded_side
            if not isinstance(side, DenseStorage) or side.storage is None:
                return
            storages.append(
                (side.storage.untyped_storage(), side.storage.numel() * side.storage.itemsize)
            )
        if pending.output is None:
            return
        whole = whole_inputs(inputs, pending.output)
        self._dense = _DenseGather(wire, inputs, whole, storages, dests)
        self._dense_for = self._description

    def sharded_versions(self) -> tuple[int, ...]:
        """How many times the sharded parameters were replaced, then each one's version
        counter: changes with every in-place write and every replacement."""
        # map over a C callable: no comprehension frame (read twice per group per step)
        return (self._sharded_count, *map(version, self._sharded))

    def gathered_copy_is_stale(self) -> bool:
        """Gathered, but a sharded parameter changed since, e.g. by an optimizer step."""
        if self.state is not GroupState.UNSHARDED:
            return False
        if self._gathered_versions is _ALIASED:  # the shards themselves, while still theirs
            return self._whole_for is None or self._whole_for is not self._description
        return self._gathered_versions != self.sharded_versions()

    def reshard_after_forward(self, backward_follows: bool) -> None:
        """Reshard at the end of forward: to the post-forward group when one is configured and
        a backward will come to use it (``reshard_after_forward=n``), else fully."""
        sub = self.config.post_forward
        if sub is None or not backward_follows or self.state is not GroupState.UNSHARDED:
            self.reshard()
            return
        with self.span("reshard"):
            self._pieces_cut = True
            for p in self.params:
                p.reshard_to_post_forward(sub, free=not self.config.keep_unsharded_storage)
            for pp in self.persistent:
                pp.hide()
            self._transition(GroupState.SHARDED, "reshard_after_forward()")

    def post_forward_nbytes(self) -> int:
        """Bytes this rank holds in post-forward pieces now (``reshard_after_forward=n``)."""
        return sum(p.post_forward_nbytes() for p in self.params)

    def reshard(self) -> None:
        """Free the full parameters and show the sharded DTensors again (no-op if SHARDED).

        Post-forward pieces are freed too: the next all-gather is over the whole shard world.
        """
        state = self.state
        if state is GroupState.SHARDED:
            if self._pieces_cut:
                self._drop_pieces()
            return
        if state is GroupState.UNSHARDING:
            self.wait_for_unshard()
        if self.observers is not self.unwatched or self.labels.open or profiler_enabled():
            self.begin("reshard")
        # Whole shards (unshard's shortcut) hold no bytes of their own to free.
        whole = self._whole_for is not None and self._whole_for is self._description
        free = not (self.config.keep_unsharded_storage or whole)
        dense = self._dense
        if free and dense is not None and self._dense_for is self._description:
            for untyped, _ in dense.storages:  # DenseStorage.free, each
                untyped.resize_(0)
            free = False
        for p in self.params:
            if free:
                p.free_storage()
            if p.post_forward_shown is not None:
                p.register(p.sharded_param)
            else:  # ShardedParam.register, inline (twice per parameter per step)
                sharded = p.sharded_param
                for module, name in p.slots:
                    module._parameters[name] = sharded
        for pp in self.persistent:
            pp.hide()
        if GroupState.SHARDED not in _TRANSITIONS[self.state]:
            self._transition(GroupState.SHARDED, "reshard()")
        self.state = GroupState.SHARDED
        if self.observers is not self.unwatched or self.labels.open:
            self.end("reshard")

    # -- gradients --------------------------------------------------------------------------

    def _allocator(self, user_comm: Any) -> Any:
        """Who allocates communication buffers: the user's comm, the process group, torch."""
        if user_comm is not None:
            return user_comm
        if self.config.allocate_from_process_group:
            return ProcessGroupAllocator(self.info.shard_group)
        return None

    @property
    def _user_all_gather(self) -> UserAllGather:
        return UserAllGather(self.config.all_gather_comm)

    def reduce_grads(self) -> None:
        """Issue the reduce-scatter of this backward's gradients, or keep them if sync is off.

        Packed: every trainable parameter with a gradient (and, with
        ``reduce_scatter_unused_params``, every trainable one: zeros where none came; with
        a partial HSDP sum pending, the parameters in it), in group order, at the offsets
        :func:`~fully_shard.description.offsets` gives.
        """
        desc = self._description
        if desc is None or self._described is not self.config:
            desc = self.description
        params = self.params
        if self.persistent:
            self._keep_persistent_grads(desc)
        trainable = [i for i, p in enumerate(params) if p.sharded_param.requires_grad]
        if not self.config.requires_gradient_sync:
            for i in trainable:
                params[i].keep_unsharded_grad(desc.reduce_dtype)
            return
        if self._pending_reduce is not None:  # in flight from an earlier backward
            self.finish_reduce()
        partial = self._partial_reduce
        grads = [(i, params[i].take_unsharded_grad()) for i in trainable]
        packed = [
            (i, g)
            for i, g in grads
            if g is not None
            or desc.reduce_unused
            or (partial is not None and partial.slice_of(params[i]) is not None)
        ]
        if self.bucket is not None and self.bucket.park(self, packed):
            return
        if not packed:
            return
        world = desc.world
        if world == 1 and self._reduces_to_itself(packed, desc.reduce_dtype):
            direct = [g for _, g in packed if g is not None]
            self._pending_reduce = _DirectReduce([params[i] for i, _ in packed], direct)
            return
        config = self.config
        allocator = (
            None
            if config.reduce_scatter_comm is None and not config.allocate_from_process_group
            else self._allocator(config.reduce_scatter_comm)
        )
        flat_in, starts, total = self._pack(packed, desc, allocator)
        members = [params[i] for i, _ in packed]
        # The unsharded gradients are in the buffer now: free them before the reduce-scatter
        # output is allocated (a vocabulary-sized head packed last would otherwise stay
        # alive beside it).
        del grads, packed
        rs = desc.reduction.reduce_scatter
        if world == 1 and self.config.reduce_scatter_comm is None:
            # One shard rank: the reduce-scatter's result is its input, divided as the op
            # would; no collective (HSDP's all-reduce over the replicas still follows).
            # (flat_in was made here and filled without autograd: nothing records the divide.)
            divide_(flat_in, desc.one_rank_divisor)
            self._pending_reduce = _PendingReduce(None, flat_in, flat_in, members, starts)
            return
        output = allocate_buffer(allocator, total, desc.reduce_dtype, desc.device)
        work = self._issue_reduce_scatter(output, flat_in, desc.reduce_group, rs)
        self._pending_reduce = _PendingReduce(work, output, flat_in, members, starts)

    def _keep_persistent_grads(self, desc: GroupDescription) -> None:
        """The persistent parameters' gradients join their pending sums; with gradient sync
        on, the group waits for the end of backward's all-reduce (every rank's group does,
        since every rank runs this post-backward)."""
        pending = False
        for pp in self.persistent:
            if pp.requires_grad:
                pending |= pp.keep_grad(desc.reduce_dtype, unused=desc.reduce_unused)
        if self.config.requires_gradient_sync and pending:
            self.persistent_ready = True

    def _issue_reduce_scatter(
        self, output: torch.Tensor, flat_in: torch.Tensor, group: dist.ProcessGroup, rs: Reduction
    ) -> Waitable | None:
        comm = self.comm
        if self.config.reduce_scatter_comm is not None:
            comm = UserReduceScatter(self.config.reduce_scatter_comm)  # type: ignore[assignment]  # only reduce_scatter is called
        if self.observers is self.unwatched and not (JOB_WIDE.observers or profiler_enabled()):
            # Nobody to tell: the profiler labels would issue it as it is.
            return comm.reduce_scatter(output, flat_in, group, rs, async_op=True)
        return issue_observed(
            self,
            CollectiveCall("reduce_scatter", flat_in, group),
            lambda: comm.reduce_scatter(output, flat_in, group, rs, async_op=True),
        )

    def _pack(
        self,
        packed: list[tuple[int, torch.Tensor | None]],
        desc: GroupDescription,
        allocator: Any,
    ) -> tuple[torch.Tensor, list[int], int]:
        """The reduce-scatter input ``(W * total,)``, rank by rank, each packed parameter's
        offset in a rank's ``total`` elements, and ``total``."""
        starts, total = offsets(desc.slots, [i for i, _ in packed])
        world = desc.world
        flat_in = allocate_buffer(allocator, world * total, desc.reduce_dtype, desc.device)
        columns = flat_in.view(world, total)
        grad_was = torch.is_grad_enabled()
        set_grad_enabled(False)  # a create_graph backward's gradients: copied, not recorded
        try:
            slots = desc.slots
            pack_grads(
                columns,
                [
                    (off, slots[i].padded_numel, g, slots[i].dim, slots[i].chunk)
                    for (i, g), off in zip(packed, starts, strict=True)
                ],
            )
        finally:
            set_grad_enabled(grad_was)
        return flat_in, starts, total

    def _reduces_to_itself(
        self, packed: list[tuple[int, torch.Tensor | None]], reduce_dtype: torch.dtype
    ) -> bool:
        """One shard rank: whether each gradient already is its reduction (no replicas, no
        divide factor, no user comm or hook) in the form the sharded gradient takes (the
        shard's dtype, device and shape, contiguous, outside any autograd graph)."""
        config = self.config
        if (
            self.info.replicate_group is not None
            or config.gradient_divide_factor is not None
            or config.reduce_scatter_comm is not None
            or config.all_reduce_hook is not None
        ):
            return False
        for i, g in packed:
            local = _LOCAL_SHARD(self.params[i])
            if (
                g is None
                or g.requires_grad
                or not g.dtype == reduce_dtype == local.dtype
                or g.device != local.device
                or g.shape != local.shape
                or not g.is_contiguous()
            ):
                return False
        return True

    def finish_reduce(self) -> None:
        """Wait for the in-flight reduce-scatter, all-reduce (HSDP), add into the sharded grads.

        The order of torch's FSDP2: reduce-scatter; for HSDP either keep the result as a
        partial sum (``requires_all_reduce`` off) or add the earlier partial sums and
        all-reduce; the user's all-reduce hook; the last division; the sharded ``.grad``.
        """
        pending = self._pending_reduce
        if pending is None:
            return
        self._pending_reduce = None
        if isinstance(pending, SharedReduce):
            pending.finish()
            return
        if isinstance(pending, _DirectReduce):
            accumulate_grads(zip(pending.params, pending.grads, strict=True))
            return
        if pending.work is not None:
            pending.work.wait()
        output = pending.output
        desc = self._description
        if desc is None or self._described is not self.config:
            desc = self.description
        plan = desc.reduction
        replicate_group = self.info.replicate_group
        if replicate_group is not None:
            partial = self._partial_reduce
            with torch.no_grad():
                if partial is not None:
                    for p, off in zip(pending.params, pending.offsets, strict=True):
                        earlier = partial.slice_of(p)
                        if earlier is not None:
                            output[off : off + p.padded_numel].add_(earlier)
            if not self.config.requires_all_reduce:
                self._partial_reduce = _PartialReduce(output, pending.params, pending.offsets)
                return
            self._partial_reduce = None
            rg = replicate_group
            ar: Reduction = plan.all_reduce
            issue_observed(
                self,
                CollectiveCall("all_reduce", output, rg),
                lambda: self.comm.all_reduce(output, rg, ar, async_op=False),
            )
        hook = self.config.all_reduce_hook
        if hook is not None:
            hook(output)
        if plan.post_divide is not None:
            divide_(output, plan.post_divide)
        grad_was = torch.is_grad_enabled()
        set_grad_enabled(False)  # as accumulate_grads, without its generator's calls
        try:
            base = int(output.storage_offset())  # eager: a plain int
            for p, off in zip(pending.params, pending.offsets, strict=True):
                p.accumulate_sharded_grad(p.local_grad_from(output, base + off))
        finally:
            set_grad_enabled(grad_was)

    def has_pending_reduce(self) -> bool:
        return self._pending_reduce is not None

    # -- buckets (fully_shard.bucket): one collective for several groups ---------------------

    def start_shared_gather(self) -> _SharedInputs:
        """Begin an unshard whose all-gather a bucket issues: move to UNSHARDING and say what
        this group sends (plain shards, laid out as the description says)."""
        self._transition(GroupState.UNSHARDING, "unshard() (bucketed)")
        if self.observers is not self.unwatched or self.labels.open or profiler_enabled():
            self.begin("unshard")
        if self._pieces_cut:
            self._drop_pieces()
        self._gathered_versions = self.sharded_versions()
        desc, dense = self.description, self._dense
        if dense is not None and self._dense_for is desc:  # as _unshard_dense repeats it
            return _SharedInputs(dense.inputs, dense.whole, [], True)
        quant = self.config.quantization_policy
        per_param = [p.all_gather_inputs(quant) for p in self.params]
        flat = [gi for gis in per_param for gi in gis]
        plain = len(flat) == len(self.params) and all(
            isinstance(p.unsharded_side, DenseStorage) for p in self.params
        )
        return _SharedInputs(flat, None, per_param, plain)

    def adopt_gather(
        self,
        work: Waitable | None,
        columns: torch.Tensor | None,
        inputs: _SharedInputs,
        shared: SharedCopy | None = None,
    ) -> None:
        """The bucket's all-gather is out: ``columns`` ``(W, gather_total)`` is this group's
        part of its ``(W, bucket total)`` buffer; :meth:`wait_for_unshard` waits for ``work``
        (shared by the bucket's groups, so waited once) and copies them out, or finds them
        copied by ``shared``, the bucket's one copy-out (``columns`` None: ``shared`` has them).
        """
        desc = self.description
        self._gather = _PendingGather(
            work, columns, desc.world, inputs.per_param, desc.gather_sizes, inputs.plain, shared
        )

    def adopt_reduce(self, shared: SharedReduce) -> None:
        """The bucket's reduce-scatter carries this group's gradients: finishing it is this
        group's :meth:`finish_reduce` (or any other member's)."""
        self._pending_reduce = shared

    def release_reduce(self, shared: SharedReduce) -> None:
        """``shared`` is being finished by another member: nothing is left pending here."""
        if self._pending_reduce is shared:
            self._pending_reduce = None

    def shares_reduction(self) -> bool:
        """Whether a bucket may reduce this group's gradients now: no HSDP partial sum is kept
        or to be kept (``requires_all_reduce`` off), which only this group's reduction adds."""
        if self._partial_reduce is not None:
            return False
        return self.info.replicate_group is None or self.config.requires_all_reduce

    def discard_iteration_state(self) -> None:
        """After an exception: wait out collectives in flight, drop grads, free, reshard."""
        pending = self._pending_reduce
        gather = self._gather
        for work in (
            None if gather is None else gather.work,
            None if pending is None else pending.work,
        ):
            if work is not None:
                # The exception that brought us here is what matters, not a second one.
                with contextlib.suppress(Exception):
                    work.wait()
        self._gather = None
        self._pending_reduce = None
        for p in self.params:
            if p.unsharded_param is not None:
                p.unsharded_param.grad = None
        for pp in self.persistent:
            if pp.unsharded_param is not None:
                pp.unsharded_param.grad = None
            if self.persistent_ready:  # the failed iteration's sums, not yet reduced
                pp.pending_grad = None
        self.persistent_ready = False
        if self.state is GroupState.UNSHARDING:
            self.state = GroupState.UNSHARDED
        self.reshard()
