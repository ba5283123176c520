"""``ParamGroup``: the parameters of one ``fully_shard`` call, gathered and reduced together.

A group is the unit of communication: one all-gather brings all its parameters, one
reduce-scatter sends all its gradients. It is always in exactly one :class:`GroupState`; every
change goes through :meth:`ParamGroup._transition`, which checks the table below.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ._compat import version
from .collectives import Comm, Waitable, copy_in, copy_out, pack_for_reduce_scatter
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
    """

    reshard_after_forward: bool | None = None
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload_policy: OffloadPolicy = field(default_factory=OffloadPolicy)


@dataclass
class _PendingReduce:
    work: Waitable | None
    output: torch.Tensor  # (total,) this rank's summed chunk, in the reduce dtype
    input: torch.Tensor  # (W * total,) kept alive until the collective is done
    params: list[ShardedParam]
    offsets: list[int]


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
        output = torch.empty(
            self._total * self.info.shard_size, dtype=self.compute_dtype, device=self.info.device
        )
        flat_in = output.narrow(0, self.info.shard_rank * self._total, self._total)
        flats = torch.split(flat_in, self._split_numels)
        slots = [p.all_gather_slot(f) for p, f in zip(self.params, flats, strict=True)]
        self._gathered_versions = self.sharded_versions()
        copy_in(slots, [p.local_shard for p in self.params])
        self._ag_output = output
        group = self.info.shard_group
        self._unshard_work = issue_observed(
            self,
            CollectiveCall("all_gather", flat_in, group),
            lambda: self.comm.all_gather(output, flat_in, group, async_op),
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

    def reduce_grads(self) -> None:
        """Issue the reduce-scatter of this backward's gradients, or keep them if sync is off."""
        trainable = [p for p in self.params if p.sharded_param.requires_grad]
        mp = self.config.mp_policy
        if not self.config.requires_gradient_sync:
            for p in trainable:
                p.keep_unsharded_grad(mp.reduce_dtype_for(p.orig_dtype))
            return
        self.finish_reduce()  # a reduction still in flight from an earlier backward
        grads = [(p, p.take_unsharded_grad()) for p in trainable]
        with_grad = [(p, g) for p, g in grads if g is not None]
        if not with_grad:
            return
        reduce_dtype = mp.reduce_dtype_for(with_grad[0][0].orig_dtype)
        world = self.info.shard_size
        views = [p.reduce_scatter_view(g, reduce_dtype) for p, g in with_grad]
        flat_in = pack_for_reduce_scatter(views, world)  # (W * total,)
        numels = [p.padded_numel for p, _ in with_grad]
        output = torch.empty(sum(numels), dtype=reduce_dtype, device=flat_in.device)
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        group = self.info.shard_group
        work = issue_observed(
            self,
            CollectiveCall("reduce_scatter", flat_in, group),
            lambda: self.comm.reduce_scatter(output, flat_in, group, async_op=True),
        )
        self._pending_reduce = _PendingReduce(
            work, output, flat_in, [p for p, _ in with_grad], offsets
        )

    def finish_reduce(self) -> None:
        """Wait for the in-flight reduce-scatter and add the results into the sharded grads."""
        pending = self._pending_reduce
        if pending is None:
            return
        self._pending_reduce = None
        if pending.work is not None:
            pending.work.wait()
        output = pending.output
        replicate_group = self.info.replicate_group
        if replicate_group is not None:
            rg = replicate_group
            issue_observed(
                self,
                CollectiveCall("all_reduce", output, rg),
                lambda: self.comm.all_reduce(output, rg, async_op=False),
            )
        output.div_(self.info.dp_size)  # SUM over all data-parallel ranks -> mean, like DDP
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
