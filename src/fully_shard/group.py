"""``ParamGroup``: the parameters of one ``fully_shard`` call, gathered and reduced together.

A group is the unit of communication: one all-gather brings all its parameters, one
reduce-scatter sends all its gradients. It is always in exactly one :class:`GroupState`; every
change goes through :meth:`ParamGroup._transition`, which checks the table below.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._compat import version
from .collectives import (
    Comm,
    ProcessGroupAllocator,
    ReducePlan,
    Reduction,
    UserAllGather,
    UserReduceScatter,
    Waitable,
    allocate_buffer,
    copy_in,
    copy_out,
    divide_,
    pack_grad,
    plan_reduction,
)
from .errors import FullyShardStateError
from .mesh import MeshInfo
from .observer import CollectiveCall, Observer, ProfilerLabels, SpanKind, issue_observed
from .param import ShardedParam
from .policies import MixedPrecisionPolicy, OffloadPolicy


class GroupState(enum.Enum):
    """Where a group's parameters are: sharded, being gathered, or gathered."""

    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # all-gather issued, not yet waited for and copied out
    UNSHARDED = "unsharded"


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
        offload_policy: where the sharded state lives.
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
    """

    reshard_after_forward: bool | None = None
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload_policy: OffloadPolicy = field(default_factory=OffloadPolicy)
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


@dataclass
class _PendingReduce:
    work: Waitable | None
    output: torch.Tensor  # (total,) this rank's reduced chunk, in the reduce dtype
    input: torch.Tensor  # (W * total,) kept alive until the collective is done
    params: list[ShardedParam]
    offsets: list[int]


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
    ) -> None:
        self.params = params
        self.modules = modules
        self.info = info
        self.config = config
        self.comm = comm
        self.state = GroupState.SHARDED
        self.compute_dtype = params[0].compute_dtype if params else torch.float32
        self._split_numels = [p.padded_numel for p in params]
        self._total = sum(self._split_numels)
        self._unshard_work: Waitable | None = None
        self._ag_output: torch.Tensor | None = None  # (W * total,) only while UNSHARDING
        self._all_dim0 = all(p.shard_dim == 0 for p in params)
        self._pending_reduce: _PendingReduce | None = None
        # Kept across backward passes (like gradients with sync off), not per iteration.
        self._partial_reduce: _PartialReduce | None = None
        self._initialized = False
        # (id, version) of each sharded parameter when the gathered copy was taken.
        self._gathered_versions: list[tuple[int, int]] = []
        # Who watches this group (fully_shard.observer): profiler labels always, tools while on.
        self.observers: tuple[Observer, ...] = (ProfilerLabels(),)
        # The group's name in labels and messages: its modules' qualified names under the root,
        # set at the root's lazy init (until then, their class names).
        self.label = "+".join(type(m).__name__ for m in modules)

    def __repr__(self) -> str:
        names = ", ".join(p.fqn for p in self.params)
        return f"ParamGroup([{names}], {self.state.name})"

    # -- observers --------------------------------------------------------------------------

    def begin(self, kind: SpanKind) -> None:
        """Tell the observers that a span of ``kind`` starts."""
        for observer in self.observers:
            observer.begin(self, kind)

    def end(self, kind: SpanKind) -> None:
        """Tell the observers that the span of ``kind`` ends."""
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

    def lazy_init(self) -> None:
        """Adopt parameters ``_apply`` replaced and create the unsharded parameter objects.

        Runs once: a second root's lazy init (a submodule ran or was unsharded alone first)
        must not free a group that is gathered right now.
        """
        if self._initialized:
            return
        self._initialized = True
        for p in self.params:
            p.sync_with_module()
            if p.local_shard.device.type == "meta":
                raise FullyShardStateError(
                    f"parameter {p.fqn!r} is still on the meta device at the first forward; "
                    "call module.to_empty(device=...) and initialise the parameters "
                    "(e.g. reset_parameters()) before running the model"
                )
            p.alloc_storage()
            p.free_storage()

    # -- unshard / reshard ------------------------------------------------------------------

    def unshard(self, async_op: bool) -> None:
        """Start gathering the full parameters (no-op unless SHARDED)."""
        if self.state is not GroupState.SHARDED:
            return
        self._transition(GroupState.UNSHARDING, "unshard()")
        self.begin("unshard")
        if not self.params:
            return
        # In place: this rank's input is its own slice of the output, so no separate input
        # buffer exists. Padding rows are left unwritten: they land in the storage's padding,
        # which no parameter view covers.
        output = allocate_buffer(
            self._allocator(self.config.all_gather_comm),
            self._total * self.info.shard_size,
            self.compute_dtype,
            self.info.device,
        )
        flat_in = output.narrow(0, self.info.shard_rank * self._total, self._total)
        flats = torch.split(flat_in, self._split_numels)
        slots = [p.all_gather_slot(f) for p, f in zip(self.params, flats, strict=True)]
        self._gathered_versions = self.sharded_versions()
        copy_in(slots, [p.local_shard for p in self.params])
        self._ag_output = output
        group = self.info.shard_group
        comm = self.comm if self.config.all_gather_comm is None else self._user_all_gather
        self._unshard_work = issue_observed(
            self,
            CollectiveCall("all_gather", flat_in, group),
            lambda: comm.all_gather(output, flat_in, group, async_op),
        )

    def wait_for_unshard(self) -> None:
        """Finish an unshard: wait for the all-gather, copy out, show the full parameters."""
        if self.state is not GroupState.UNSHARDING:
            return
        if self._unshard_work is not None:
            self._unshard_work.wait()
            self._unshard_work = None
        gathered = self._ag_output
        self._ag_output = None
        # Allocated only now, not at unshard: a prefetched group in flight holds just the
        # all-gather output.
        for p in self.params:
            p.alloc_storage()
        if gathered is not None:
            self.begin("all_gather_copy_out")
            world = self.info.shard_size
            if self._all_dim0:
                views = [p.copy_out_view() for p in self.params]
                copy_out(gathered, world, self._split_numels, [v for v in views if v is not None])
            else:
                blocks = torch.split(gathered.view(world, -1), self._split_numels, dim=1)
                for p, block in zip(self.params, blocks, strict=True):
                    p.copy_out(block)
            self.end("all_gather_copy_out")
        for p in self.params:
            unsharded = p.unsharded_param
            if unsharded is None:
                raise RuntimeError(f"{p.fqn}: no unsharded parameter after alloc (internal error)")
            # Trainable is whatever the sharded parameter says now: requires_grad_() after
            # fully_shard is followed, not the value it had when it was wrapped.
            unsharded.requires_grad_(p.sharded_param.requires_grad)
            p.register(unsharded)
        self._transition(GroupState.UNSHARDED, "wait_for_unshard()")
        self.end("unshard")

    def sharded_versions(self) -> list[tuple[int, int]]:
        """(id, version counter) of each sharded parameter: changes with every in-place write."""
        return [(id(p.sharded_param), version(p.sharded_param)) for p in self.params]

    def gathered_copy_is_stale(self, versions: list[tuple[int, int]]) -> bool:
        """Gathered, but a sharded parameter changed since (``versions``: now's, as read by
        :meth:`sharded_versions`), e.g. by an optimizer step."""
        return self.state is GroupState.UNSHARDED and self._gathered_versions != versions

    def reshard(self) -> None:
        """Free the full parameters and show the sharded DTensors again (no-op if SHARDED)."""
        if self.state is GroupState.SHARDED:
            return
        if self.state is GroupState.UNSHARDING:
            self.wait_for_unshard()
        self.begin("reshard")
        for p in self.params:
            p.free_storage()
            p.register(p.sharded_param)
        self._transition(GroupState.SHARDED, "reshard()")
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
        a partial HSDP sum pending, the parameters in it), in group order.
        """
        trainable = [p for p in self.params if p.sharded_param.requires_grad]
        mp = self.config.mp_policy
        if not self.config.requires_gradient_sync:
            for p in trainable:
                p.keep_unsharded_grad(mp.reduce_dtype_for(p.orig_dtype))
            return
        self.finish_reduce()  # a reduction still in flight from an earlier backward
        partial = self._partial_reduce
        grads = [(p, p.take_unsharded_grad()) for p in trainable]
        packed = [
            (p, g)
            for p, g in grads
            if g is not None
            or self.config.reduce_scatter_unused_params
            or (partial is not None and partial.slice_of(p) is not None)
        ]
        if not packed:
            return
        reduce_dtype = mp.reduce_dtype_for(packed[0][0].orig_dtype)
        world = self.info.shard_size
        numels = [p.padded_numel for p, _ in packed]
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        total = sum(numels)
        allocator = self._allocator(self.config.reduce_scatter_comm)
        device = self.info.device
        flat_in = allocate_buffer(allocator, world * total, reduce_dtype, device)  # (W * total,)
        columns = flat_in.view(world, total)
        with torch.no_grad():
            for (p, g), off, n in zip(packed, offsets, numels, strict=True):
                pack_grad(columns[:, off : off + n], g, p.shard_dim, p.chunk)
        params = [p for p, _ in packed]
        del grads, packed  # the unsharded gradients are in the buffer now: free them
        output = allocate_buffer(allocator, total, reduce_dtype, device)
        group = self.config.reduce_scatter_group or self.info.shard_group
        rs = self._reduce_plan(reduce_dtype).reduce_scatter
        comm = self.comm
        if self.config.reduce_scatter_comm is not None:
            comm = UserReduceScatter(self.config.reduce_scatter_comm)  # type: ignore[assignment]  # only reduce_scatter is called
        work = issue_observed(
            self,
            CollectiveCall("reduce_scatter", flat_in, group),
            lambda: comm.reduce_scatter(output, flat_in, group, rs, async_op=True),
        )
        self._pending_reduce = _PendingReduce(work, output, flat_in, params, offsets)

    def _reduce_plan(self, reduce_dtype: torch.dtype) -> ReducePlan:
        return plan_reduction(
            reduce_dtype,
            self.info.shard_size,
            self.info.replicate_size,
            factor=self.config.gradient_divide_factor,
            force_sum=self.config.force_sum_reduction_for_comms,
            device_type=self.info.device.type,
        )

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
        if pending.work is not None:
            pending.work.wait()
        output = pending.output
        plan = self._reduce_plan(output.dtype)
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
        divide_(output, plan.post_divide)
        with torch.no_grad():
            for p, off in zip(pending.params, pending.offsets, strict=True):
                p.accumulate_sharded_grad(p.local_grad_from(output[off : off + p.padded_numel]))

    def has_pending_reduce(self) -> bool:
        return self._pending_reduce is not None

    def discard_iteration_state(self) -> None:
        """After an exception: wait out collectives in flight, drop grads, free, reshard."""
        pending = self._pending_reduce
        for work in (self._unshard_work, None if pending is None else pending.work):
            if work is not None:
                # The exception that brought us here is what matters, not a second one.
                with contextlib.suppress(Exception):
                    work.wait()
        self._unshard_work = None
        self._ag_output = None
        self._pending_reduce = None
        for p in self.params:
            if p.unsharded_param is not None:
                p.unsharded_param.grad = None
        if self.state is GroupState.UNSHARDING:
            self.state = GroupState.UNSHARDED
        self.reshard()
