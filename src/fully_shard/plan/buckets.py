"""The buckets ``set_bucket_cap_mb`` makes, as the planner sees them (no engine object).

The engine (:mod:`fully_shard.bucket`, planned by ``hooks._plan_buckets``) cuts three orders
of groups into runs: the forward order (gathers), the order backward starts the groups that
gather again there (reshard after forward), and the order backward finishes them (the
reverse forward order, the root last: reductions). Two neighbours share a run when their
collectives can be one (the same keys) and the run's buffer stays within the cap. The cut
itself is the engine's :func:`fully_shard.bucket.runs_of`; the keys and sizes are read here
from what the planner knows of each group (:class:`~fully_shard.plan.schedule.ParamInfo`),
where the engine reads them from each group's description:

=================  =========================================================================
gather key         the wire dtype (the compute dtype, ``uint8`` when a group mixes several);
                   none (a run of one) with one shard rank, offload, an int8 parameter, or
                   ``reshard_after_forward=n`` (a post-forward group)
gather bytes       ``W * sum(padded shard * compute itemsize)``: the group's part of the
                   all-gather output
reduce key         the group's reduce dtype (its first trainable parameter's); none with one
                   shard rank or offload
reduce bytes       ``W * sum(padded shard) * reduce itemsize`` over every parameter, frozen
                   ones too (the engine's ``reduce_bytes``)
=================  =========================================================================

Example:
    >>> runs = bucket_runs(model, choice, world=2, offload=False)  # doctest: +SKIP
    >>> runs.sizes()  # doctest: +SKIP
    {'forward': [3, 2], 'backward': [2, 2], 'reduce': [3, 2]}
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..bucket import cap_bytes, runs_of
from ..layout import split_rows
from .activations import Mark, Trace

if TYPE_CHECKING:
    from .schedule import Choice, ParamInfo

Runs = tuple[tuple[int, ...], ...]
"""Group indices (0: the root) cut into runs, in the order their collectives come."""


@dataclass(frozen=True)
class BucketRuns:
    """The runs of one configuration: forward gathers, backward gathers, reductions.

    ``of(kind, g)`` is ``g``'s run of several groups (``None``: ``g`` runs alone).

    Example:
        >>> runs.of("reduce", 3)  # doctest: +SKIP
        (3, 2, 1)
    """

    forward: Runs = ()
    backward: Runs = ()
    reduce: Runs = ()

    def of(self, kind: str, g: int) -> tuple[int, ...] | None:
        runs: Runs = getattr(self, kind)
        return next((r for r in runs if len(r) > 1 and g in r), None)

    def sizes(self) -> dict[str, list[int]]:
        """Groups per run, in issue order: what ``Buckets.sizes()`` says of the engine's."""
        return {
            "forward": [len(r) for r in self.forward],
            "backward": [len(r) for r in self.backward],
            "reduce": [len(r) for r in self.reduce],
        }

    def merges(self) -> bool:
        """Whether any run holds several groups (else the cap changes nothing)."""
        return any(len(r) > 1 for r in (*self.forward, *self.backward, *self.reduce))


def _orders(trace: Trace) -> tuple[list[int], list[int]]:
    """Groups by forward start and by forward end (the engine's recorded orders)."""
    starts: list[int] = []
    ends: list[int] = []
    for item in trace.items:
        if isinstance(item, Mark) and item.kind == "fwd_start" and item.group not in starts:
            starts.append(item.group)
        if isinstance(item, Mark) and item.kind == "fwd_end" and item.group not in ends:
            ends.append(item.group)
    return starts, ends


def _cut(
    order: Sequence[int],
    key: Callable[[int], Hashable | None],
    nbytes: Callable[[int], int],
    cap: int,
) -> Runs:
    # The engine's own cut (generic over what it cuts: here the planner's group indices).
    return tuple(runs_of(order, key, nbytes, lambda _: cap))


def bucket_runs(
    params: Sequence[ParamInfo], trace: Trace, choice: Choice, world: int, offload: bool
) -> BucketRuns:
    """The runs the engine cuts for ``choice`` (``choice.bucket_cap_mb``) on ``world`` shard
    ranks; no runs without a cap. See the module doc for the keys and sizes.

    Example:
        >>> bucket_runs(params, trace, choice, 2, False).sizes()  # doctest: +SKIP
        {'forward': [2, 3], 'backward': [1, 1, 1, 1], 'reduce': [3, 2]}
    """
    cap = cap_bytes(choice.bucket_cap_mb)
    if cap is None:
        return BucketRuns()
    members: dict[int, list[ParamInfo]] = {}
    for p in params:
        if not p.kept:  # kept whole: in no collective a bucket merges
            members.setdefault(p.group, []).append(p)

    def padded(p: ParamInfo) -> int:
        d0, rest = p.rows_rest()
        return split_rows(d0, world).chunk * rest

    def gather_key(g: int) -> Hashable | None:
        flag = choice.reshard[g]
        quantized = any(p.wire_bytes_per_row is not None for p in members[g])
        if world < 2 or offload or quantized or not isinstance(flag, bool):
            return None
        wires = {(p.compute_dtype, p.compute_itemsize) for p in members[g]}
        return wires.pop() if len(wires) == 1 else ("uint8", 1)

    def gather_nbytes(g: int) -> int:
        return world * sum(padded(p) * p.compute_itemsize for p in members[g])

    def reduce_first(g: int) -> ParamInfo:
        return next((p for p in members[g] if p.trainable), members[g][0])

    def reduce_key(g: int) -> Hashable | None:
        if world < 2 or offload:
            return None
        first = reduce_first(g)
        return (first.reduce_dtype, first.reduce_itemsize)

    def reduce_nbytes(g: int) -> int:
        return world * sum(map(padded, members[g])) * reduce_first(g).reduce_itemsize

    starts, ends = _orders(trace)
    forward = [g for g in starts if g in members]
    # Backward starts the groups in the reverse order their forwards ended; of those, the
    # ones that resharded after forward gather again (unshard_in_backward is the default).
    again = [g for g in reversed(ends) if g in members and choice.reshard[g] is not False]
    return BucketRuns(
        _cut(forward, gather_key, gather_nbytes, cap),
        _cut(again, gather_key, gather_nbytes, cap),
        _cut(forward[::-1], reduce_key, reduce_nbytes, cap),
    )
