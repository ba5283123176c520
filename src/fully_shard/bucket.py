"""Buckets: runs of consecutive groups whose collectives are merged into one.

Every group issues its own all-gather and reduce-scatter; a model of many small groups pays
each one's launch latency. With ``FSDPModule.set_bucket_cap_mb(mb)`` the root merges the
collectives of consecutive groups whose descriptions agree (same process groups, wire dtype,
reduce dtype and :class:`~fully_shard.collectives.ReducePlan`; no custom collective, offload,
int8 gather or ``reshard_after_forward=n``) into runs whose flat buffer stays within ``mb``
MiB. A bucket's layout is the concatenation of its groups' (:mod:`fully_shard.description`)::

    groups (forward order)      A          B        C
    all-gather buffer      (W, a + b + c): row r = [A's rank-r shard | B's | C's]
    reduce-scatter input   (W, a' + b' + c'), the gradients packed as each group packs them

Each group keeps its own state machine, hooks and options; only the collective is shared:

- **Gathers**, by runs in forward order (and, for the groups that gather again in backward,
  in backward order): the first group of a run that unshards issues one all-gather for itself
  and every later group of the run that will run in this pass and is still SHARDED. Those
  are then UNSHARDING with a pending gather whose work is the bucket's: each one's
  ``wait_for_unshard`` waits for it (once) and copies out its own columns. A forward run
  whose groups all keep their parameters (``reshard_after_forward=False``) holds them
  together until backward anyway: the first of them to wait copies every member's columns
  out at once (:class:`~fully_shard.group.SharedCopy`), one copy instead of one per group.
- **Reductions**, by runs in backward order: a group whose backward is done parks its
  gradients with the bucket; when the run's last group has parked, one reduce-scatter (and,
  for HSDP, one all-reduce) carries them all, and finishing it from any member adds every
  member's slice into its sharded gradients. A member whose backward never came in this
  pass (its module did not run) adds nothing: the end of backward issues what was parked
  (:meth:`Buckets.flush`), as each group would have reduced alone.

Memory is the price: a bucket's gathered parameters are alive together, and its groups'
unsharded gradients wait for its reduce-scatter. The buckets are planned from the order the
first iteration recorded (the first iteration runs unbucketed, as it runs unprefetched) and
planned again when a cap, a config or a description changes.

Example:
    >>> model.set_bucket_cap_mb(25)  # doctest: +SKIP
    >>> model(x).sum().backward()  # the first step records the order
    >>> model._fsdp_state.root.buckets  # doctest: +SKIP
    Buckets(forward gathers [3, 2], backward gathers [2, 2], reductions [3, 2])
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ._compat import profiler_enabled, set_grad_enabled
from .collectives import Waitable, comm_key, divide_
from .description import GroupDescription, offsets
from .group import GroupState, ParamGroup, SharedCopy, SharedReduce, accumulate_grads
from .observer import JOB_WIDE, CollectiveCall, issue_observed
from .packing import ProcessGroupAllocator, allocate_buffer, copy_in, pack_grads
from .param import ShardedParam

MIB = 1024 * 1024  # DDP's bucket_cap_mb unit
T = TypeVar("T")  # what runs_of cuts: groups here, the planner's group indices in plan/

Packed = list[tuple[int, torch.Tensor | None]]
"""A group's gradients to reduce: (parameter index in the group, unsharded gradient)."""


def cap_bytes(bucket_cap_mb: float | None) -> int | None:
    """The cap in bytes of ``set_bucket_cap_mb``'s value (``None`` or 0: no buckets).

    Example:
        >>> cap_bytes(25), cap_bytes(0), cap_bytes(None)
        (26214400, None, None)
    """
    if not bucket_cap_mb:
        return None
    return int(bucket_cap_mb * MIB)


def _allocator(group: ParamGroup) -> Any:
    """As :meth:`ParamGroup._allocator` without a custom collective (buckets have none)."""
    if group.config.allocate_from_process_group:
        return ProcessGroupAllocator(group.info.shard_group)
    return None


def _offloaded(group: ParamGroup) -> bool:
    return group.config.offload_policy.shard_device(group.info.device) != group.info.device


def _comm_key(group: ParamGroup) -> Hashable:
    """Groups with the default collectives agree (:func:`~fully_shard.collectives.comm_key`)."""
    return comm_key(group.comm)


def gather_key(group: ParamGroup) -> Hashable | None:
    """What must agree for two groups to share an all-gather; ``None``: never shared (one
    shard rank, a source that decides its own inputs: int8, a tensor subclass; a custom
    all-gather, offload, ``reshard_after_forward=n``)."""
    d, c = group.description, group.config
    if (
        d.world < 2
        or d.wire_dtype is None
        or c.post_forward is not None
        or c.all_gather_comm is not None
        or _offloaded(group)
    ):
        return None
    comm = _comm_key(group)
    return (id(d.shard_group), d.wire_dtype, d.device, c.allocate_from_process_group, comm)


def reduce_key(group: ParamGroup) -> Hashable | None:
    """What must agree for two groups to share a reduce-scatter (and the HSDP all-reduce);
    ``None``: never shared (one shard rank, a custom reduce-scatter, an all-reduce hook,
    offload, partial HSDP sums)."""
    d, c = group.description, group.config
    if (
        d.world < 2
        or c.reduce_scatter_comm is not None
        or c.all_reduce_hook is not None
        or (d.replicate_group is not None and not c.requires_all_reduce)
        or _offloaded(group)
    ):
        return None
    return (
        id(d.reduce_group),
        id(d.replicate_group),
        d.reduce_dtype,
        d.reduction,
        d.device,
        d.sync,
        c.allocate_from_process_group,
        _comm_key(group),
    )


def gather_bytes(d: GroupDescription) -> int:
    """The group's share of a bucket's all-gather buffer: ``W * gather_total`` wire elements."""
    itemsize = 0 if d.wire_dtype is None else d.wire_dtype.itemsize
    return d.world * d.gather_total * itemsize


def reduce_bytes(d: GroupDescription) -> int:
    """The group's share of a bucket's reduce-scatter input (every parameter packed)."""
    return d.world * sum(s.padded_numel for s in d.slots) * d.reduce_dtype.itemsize


def runs_of(
    groups: Sequence[T],
    key: Callable[[T], Hashable | None],
    nbytes: Callable[[T], int],
    cap: Callable[[T], int | None],
) -> list[tuple[T, ...]]:
    """Cut ``groups`` (in the order their collectives come) into runs: consecutive groups
    with the same key and cap, while the run's buffer stays within the cap (a group larger
    than the cap is a run of its own). Groups without a key or a cap are runs of one.

    Example:
        >>> [len(r) for r in runs_of(groups, gather_key, size, cap)]  # doctest: +SKIP
        [3, 3, 1]
    """
    runs: list[tuple[T, ...]] = []
    run: list[T] = []
    run_key: Hashable | None = None
    used = 0
    for group in groups:
        limit = cap(group)
        k = None if limit is None else (key(group), limit)
        size = nbytes(group)
        fits = limit is not None and used + size <= limit
        if run and fits and k is not None and k[0] is not None and k == run_key:
            run.append(group)
            used += size
            continue
        if run:
            runs.append(tuple(run))
        run, run_key, used = [group], k, size
    if run:
        runs.append(tuple(run))
    return runs


class _Once:
    """A bucket's collective, shared by its groups' pending gathers: waited at most once."""

    def __init__(self, work: Waitable | None) -> None:
        self._work = work

    def wait(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            work.wait()


@dataclass
class _ReduceRun:
    """One reduce bucket and the gradients its groups parked in this backward."""

    members: tuple[ParamGroup, ...]
    parked: dict[ParamGroup, Packed] = field(default_factory=dict)


@dataclass
class _BucketReduce:
    """A bucket's reduce-scatter in flight, until one member finishes it for all."""

    work: _Once
    output: torch.Tensor  # (total,) this rank's reduced chunk of every member, in the bucket
    input: torch.Tensor  # (W * total,) kept alive until the collective is done
    desc: GroupDescription  # the first member's (the reduction and groups all agree)
    issuer: ParamGroup  # whose observers saw the collective
    members: list[tuple[ParamGroup, list[ShardedParam], list[int]]]  # params, their starts
    shared: SharedReduce | None = None

    def finish(self) -> None:
        shared, self.shared = self.shared, None
        if shared is None:  # finished already, from another member
            return
        for group, _, _ in self.members:
            group.release_reduce(shared)
        self.work.wait()
        output, plan, rg = self.output, self.desc.reduction, self.desc.replicate_group
        if rg is not None:  # HSDP: one all-reduce for the bucket, over the replicas
            comm = self.issuer.comm
            issue_observed(
                self.issuer,
                CollectiveCall("all_reduce", output, rg),
                lambda: comm.all_reduce(output, rg, plan.all_reduce, async_op=False),
            )
        divide_(output, plan.post_divide)
        base = int(output.storage_offset())  # eager: a plain int
        accumulate_grads(  # every member's rows, in one pass
            (p, p.local_grad_from(output, base + off))
            for _, params, starts in self.members
            for p, off in zip(params, starts, strict=True)
        )


class Buckets:
    """The buckets of one root: runs of its groups for forward gathers, backward gathers and
    reductions, and the gradients parked for a reduction not yet issued.

    ``in_backward()`` says which gather runs apply; ``claim(group, backward)`` says whether a
    later group of a run will still run in this pass (forward: its forward has not run yet;
    backward: it ran forward and its backward has not started) and marks it gathered ahead
    (so that an unused one is freed as an unused prefetch is).

    Example:
        >>> buckets = model._fsdp_state.root.buckets  # doctest: +SKIP
        >>> buckets.sizes()  # doctest: +SKIP
        {'forward': [3, 2], 'backward': [2, 2], 'reduce': [3, 2]}
    """

    def __init__(
        self,
        forward: list[tuple[ParamGroup, ...]],
        backward: list[tuple[ParamGroup, ...]],
        reduce: list[tuple[ParamGroup, ...]],
        *,
        in_backward: Callable[[], bool],
        claim: Callable[[ParamGroup, bool], bool],
    ) -> None:
        self.forward = forward
        self.backward = backward
        self.reduce = [_ReduceRun(r) for r in reduce]
        self._in_backward = in_backward
        self._claim = claim
        self._forward_of = {g: r for r in forward if len(r) > 1 for g in r}
        self._backward_of = {g: r for r in backward if len(r) > 1 for g in r}
        self._reduce_of = {g: r for r in self.reduce if len(r.members) > 1 for g in r.members}

    def members(self) -> set[ParamGroup]:
        """Every group some bucket of several groups holds (the others run as before)."""
        return set(self._forward_of) | set(self._backward_of) | set(self._reduce_of)

    def sizes(self) -> dict[str, list[int]]:
        """Groups per bucket, in issue order: what one step's collectives come to."""
        return {
            "forward": [len(r) for r in self.forward],
            "backward": [len(r) for r in self.backward],
            "reduce": [len(r.members) for r in self.reduce],
        }

    def __repr__(self) -> str:
        s = self.sizes()
        return (
            f"Buckets(forward gathers {s['forward']}, backward gathers {s['backward']}, "
            f"reductions {s['reduce']})"
        )

    # -- gathers ------------------------------------------------------------------------------

    def unshard(self, group: ParamGroup, async_op: bool) -> bool:
        """``group`` (SHARDED) is to be gathered: gather it with the rest of its run."""
        backward = self._in_backward()
        run = (self._backward_of if backward else self._forward_of).get(group)
        if run is None:
            return False
        later = run[run.index(group) + 1 :]
        members = [group] + [
            g for g in later if g.state is GroupState.SHARDED and self._claim(g, backward)
        ]
        if len(members) == 1:
            return False
        # Groups that keep their parameters after forward hold them together until backward
        # anyway: their columns are copied out at once (SharedCopy).
        kept = not backward and all(g.config.reshard_after_forward is False for g in members)
        _gather(members, async_op, kept)
        return True

    # -- reductions ---------------------------------------------------------------------------

    def park(self, group: ParamGroup, packed: Packed) -> bool:
        """``group``'s backward is done: keep its gradients until its run's last group's."""
        run = self._reduce_of.get(group)
        if run is None:
            return False
        if group in run.parked:  # a second backward before the run was issued: issue it
            _issue(run)
        shared = group.shares_reduction()
        run.parked[group] = packed if shared else []
        if len(run.parked) == len(run.members):
            _issue(run)
        return shared

    def flush(self) -> None:
        """The end of backward: issue every run that has parked gradients (a member whose
        backward did not come adds nothing, as it would have sent nothing alone)."""
        for run in self.reduce:
            if run.parked:
                _issue(run)

    def discard(self) -> None:
        """After an exception: drop the parked gradients (the groups' own state is reset)."""
        for run in self.reduce:
            run.parked = {}


def _unwatched(group: ParamGroup) -> bool:
    """Nobody to tell of a collective issued for ``group``: it goes straight to the comm (as
    ``ParamGroup``'s own do; the profiler labels would issue it as it is)."""
    return group.observers is group.unwatched and not (JOB_WIDE.observers or profiler_enabled())


def _gather(members: list[ParamGroup], async_op: bool, kept: bool) -> None:
    """One all-gather for ``members``: each one's plain shards at its offset in every row;
    ``kept``: they stay gathered until backward, so the first to wait copies all out."""
    descs = [m.description for m in members]
    first = descs[0]
    world, total = first.world, sum(d.gather_total for d in descs)
    wire = first.wire_dtype
    if wire is None:
        raise RuntimeError(f"bucket of {members[0].label!r}: no plain gather (internal error)")
    grad_was = torch.is_grad_enabled()
    set_grad_enabled(False)  # data, never part of a graph (as in ParamGroup.unshard)
    try:
        inputs = [m.start_shared_gather() for m in members]
        output = allocate_buffer(_allocator(members[0]), world * total, wire, first.device)
        rows = output.view(world, total)  # (W, total): row r is rank r's input
        mine = rows[first.rank]
        if all(sent.whole is not None for sent in inputs):
            # Every member's shards fill their slots: the whole bucket's copy-in is one cat.
            torch.cat([t for sent in inputs for t in sent.whole or ()], out=mine)
        else:
            start = 0
            for d, sent in zip(descs, inputs, strict=True):
                slot = mine.narrow(0, start, d.gather_total)
                if sent.whole is not None:
                    torch.cat(sent.whole, out=slot)  # copy_in's own shortcut
                else:
                    copy_in(slot, sent.flat)
                start += d.gather_total
    finally:
        set_grad_enabled(grad_was)
    comm, group = members[0].comm, first.shard_group
    if _unwatched(members[0]):
        work = _Once(comm.all_gather(output, mine, group, async_op))
    else:
        work = _Once(
            issue_observed(
                members[0],
                CollectiveCall("all_gather", mine, group),
                lambda: comm.all_gather(output, mine, group, async_op),
            )
        )
    if kept and all(sent.plain for sent in inputs):
        sizes = [n for d in descs for n in d.gather_sizes]
        shared = SharedCopy(rows, members, sizes, [d.gather_total for d in descs])
        for m, sent in zip(members, inputs, strict=True):
            m.adopt_gather(work, None, sent, shared)
        return
    start = 0
    for m, d, sent in zip(members, descs, inputs, strict=True):
        m.adopt_gather(work, rows.narrow(1, start, d.gather_total), sent)
        start += d.gather_total


def _pack(
    parked: list[tuple[ParamGroup, Packed]], world: int, desc: GroupDescription, allocator: Any
) -> tuple[torch.Tensor, list[tuple[ParamGroup, list[ShardedParam], list[int]]], int]:
    """The bucket's reduce-scatter input ``(W * total,)``: each member's gradients packed as
    it packs them alone, members side by side in every rank's row; and where each lands."""
    layout = []
    total = 0
    for group, packed in parked:
        starts, n = offsets(group.description.slots, [i for i, _ in packed])
        layout.append((group, packed, [total + s for s in starts]))
        total += n
    flat_in = allocate_buffer(allocator, world * total, desc.reduce_dtype, desc.device)
    columns = flat_in.view(world, total)
    grad_was = torch.is_grad_enabled()
    set_grad_enabled(False)  # a create_graph backward's gradients: copied, not recorded
    try:
        items = []
        for group, packed, starts in layout:
            slots = group.description.slots
            for (i, g), off in zip(packed, starts, strict=True):
                s = slots[i]
                items.append((off, s.padded_numel, g, s.dim, s.chunk))
        pack_grads(columns, items)
    finally:
        set_grad_enabled(grad_was)
    members = [(g, [g.params[i] for i, _ in packed], starts) for g, packed, starts in layout]
    return flat_in, members, total


def _issue(run: _ReduceRun) -> None:
    """One reduce-scatter for the gradients ``run``'s members parked (in run order)."""
    parked = [(g, run.parked[g]) for g in run.members if run.parked.get(g)]
    run.parked = {}
    if not parked:
        return
    issuer = parked[-1][0]
    desc = parked[0][0].description
    allocator = _allocator(issuer)
    flat_in, members, total = _pack(parked, desc.world, desc, allocator)
    # The unsharded gradients are in the buffer now: free them before the output exists.
    del parked
    output = allocate_buffer(allocator, total, desc.reduce_dtype, desc.device)
    comm, group, rs = issuer.comm, desc.reduce_group, desc.reduction.reduce_scatter
    if _unwatched(issuer):
        work = comm.reduce_scatter(output, flat_in, group, rs, async_op=True)
    else:
        work = issue_observed(
            issuer,
            CollectiveCall("reduce_scatter", flat_in, group),
            lambda: comm.reduce_scatter(output, flat_in, group, rs, async_op=True),
        )
    pending = _BucketReduce(_Once(work), output, flat_in, desc, issuer, members)
    shared = SharedReduce(pending.work, pending.finish)
    pending.shared = shared
    for group_, _, _ in members:
        group_.adopt_reduce(shared)
