"""``fully_shard.debug``: catch ranks that diverge at the first collective, instead of hanging.

A sharded job usually dies of divergence, not of a crash: one rank skips a block, has another
set of frozen parameters, or leaves a step after an exception, and every other rank waits in
an all-gather until the process-group timeout (30 minutes by default) — or two different
collectives of equal size pair up and the job computes garbage. While the checker is on,
before each collective of ``fully_shard`` every rank publishes a *fingerprint* of the call
(its number on that process group, the op, the group's module name, shape and dtype) on a
side channel and compares it with the other ranks' of that process group. On a mismatch, or
when a rank does not arrive within the timeout, it raises :class:`FullyShardDesyncError`
before anything is sent, naming what each rank did.

Turn it on around code with :func:`check_collectives`, or for a whole job with the
environment variable ``FULLY_SHARD_CHECK_COLLECTIVES=1`` (timeout in seconds from
``FULLY_SHARD_CHECK_TIMEOUT``, default 60), read when ``fully_shard`` is first called.

The side channel is a ``torch.distributed.TCPStore`` hosted by global rank 0, never the data
path: its address travels once over the default process group, when checking is switched on
(so every rank must switch it on, as with any collective). Each check costs a few store round
trips per collective (docs/performance.md has the number); off, it costs nothing.

Example:
    >>> from fully_shard import FullyShardDesyncError, debug
    >>> with debug.check_collectives(timeout=30):  # doctest: +SKIP
    ...     loss = model(x).sum()
    ...     loss.backward()
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, cast

import torch.distributed as dist

# Public (documented) classes that torch re-exports without listing them for type checkers.
from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]

from .errors import FullyShardDesyncError, FullyShardStateError, FullyShardValueError
from .observer import JOB_WIDE, CollectiveCall, ObservedGroup, SpanKind

if TYPE_CHECKING:
    from .collectives import Waitable

ENV_ON = "FULLY_SHARD_CHECK_COLLECTIVES"
ENV_TIMEOUT = "FULLY_SHARD_CHECK_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
_PREFIX = "fully_shard/check"


@dataclass(frozen=True)
class Fingerprint:
    """What one rank is about to issue: compared across the ranks of the process group.

    Example:
        >>> Fingerprint(3, "all_gather", "layers.1", [1024], "torch.float32").describe()
        "#3 all_gather of 'layers.1' (shape [1024], torch.float32)"
    """

    seq: int
    op: str
    group: str
    shape: list[int]
    dtype: str

    def describe(self) -> str:
        return f"#{self.seq} {self.op} of {self.group!r} (shape {self.shape}, {self.dtype})"

    def same_call(self, other: Fingerprint) -> bool:
        return (self.op, self.group, self.shape, self.dtype) == (
            other.op,
            other.group,
            other.shape,
            other.dtype,
        )


def _seconds(timeout: float | datetime.timedelta) -> float:
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise FullyShardValueError(
            f"check_collectives(timeout=...) takes seconds (a number) or a datetime.timedelta, "
            f"got {timeout!r}"
        )
    if not seconds > 0:
        raise FullyShardValueError(
            f"check_collectives(timeout={timeout!r}): the timeout must be positive, e.g. 30"
        )
    return float(seconds)


def _side_channel(timeout_s: float) -> Store:
    """A store every rank reaches: rank 0 hosts it, its address goes over the default group."""
    if not dist.is_available() or not dist.is_initialized():
        raise FullyShardStateError(
            "fully_shard.debug.check_collectives needs torch.distributed to be initialised "
            "(init_process_group) on every rank before it is switched on"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    address: list[object] = [None]
    store: TCPStore | None = None
    if dist.get_rank() == 0:
        store = TCPStore(host, 0, None, True, timeout=timeout, wait_for_workers=False)
        address = [(host, store.port)]
    dist.broadcast_object_list(address, src=0)
    if store is None:
        host0, port = cast(tuple[str, int], address[0])  # the (host, port) pair sent above
        store = TCPStore(host0, port, None, False, timeout=timeout)
    return store


class CollectiveChecker:
    """The observer that compares fingerprints before every collective (see module doc).

    Example:
        >>> checker = CollectiveChecker(timeout_s=30.0)  # doctest: +SKIP  (all ranks)
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._store = _side_channel(timeout_s)
        self._rank = dist.get_rank()
        self._seq: dict[str, int] = {}  # per process group (its ranks, as a key)

    def begin(self, group: ObservedGroup, kind: SpanKind) -> None:
        pass

    def end(self, group: ObservedGroup, kind: SpanKind) -> None:
        pass

    def collective(
        self, group: ObservedGroup, call: CollectiveCall, issue: Callable[[], Waitable | None]
    ) -> Waitable | None:
        self.check(group.label, call)
        return issue()

    def check(self, label: str, call: CollectiveCall) -> None:
        """Publish this rank's fingerprint and compare; raise on a mismatch or a no-show."""
        ranks = dist.get_process_group_ranks(call.process_group)
        pg = ",".join(map(str, ranks))
        seq = self._seq.get(pg, 0) + 1
        self._seq[pg] = seq
        mine = Fingerprint(seq, call.op, label, list(call.input.shape), str(call.input.dtype))
        text = json.dumps(asdict(mine))
        store, me = self._store, self._rank
        store.set(f"{_PREFIX}/{pg}/{seq}/{me}", text)
        store.set(f"{_PREFIX}/{pg}/last/{me}", text)
        if seq > 2:  # everyone has read it: they all passed call seq - 1 to be past seq - 2
            store.delete_key(f"{_PREFIX}/{pg}/{seq - 2}/{me}")
        others = [r for r in ranks if r != me]
        keys = {r: f"{_PREFIX}/{pg}/{seq}/{r}" for r in others}
        # A timeout raises; who is missing is read below.
        with contextlib.suppress(RuntimeError):
            store.wait(list(keys.values()), datetime.timedelta(seconds=self.timeout_s))
        seen: dict[int, str] = {}
        diverged = False
        for r, key in keys.items():
            if store.check([key]):
                theirs = Fingerprint(**json.loads(store.get(key)))
                seen[r] = theirs.describe()
                diverged |= not theirs.same_call(mine)
            else:
                diverged = True
                seen[r] = f"did not arrive within {self.timeout_s:g} s" + self._last(pg, r)
        if diverged:
            listing = "; ".join(f"rank {r}: {what}" for r, what in seen.items())
            raise FullyShardDesyncError(
                f"rank {me}: collectives diverged on process group ranks {ranks} at call "
                f"#{seq}: this rank issues {mine.describe()}; {listing}. Nothing was sent. "
                "Look for control flow that differs between ranks (a skipped module, a "
                "different frozen set, an exception one rank caught, a different number of "
                "micro-batches); call reset_iter_state() on the root to use the model again"
            )

    def close(self) -> None:
        """Leave the side channel; rank 0, which hosts it, waits (up to the timeout) for all."""
        store, world = self._store, dist.get_world_size()
        store.set(f"{_PREFIX}/closed/{self._rank}", "1")
        if self._rank == 0:
            keys = [f"{_PREFIX}/closed/{r}" for r in range(world)]
            # A rank that never closes (it died) must not keep this one here for good.
            with contextlib.suppress(RuntimeError):
                store.wait(keys, datetime.timedelta(seconds=self.timeout_s))

    def _last(self, pg: str, rank: int) -> str:
        key = f"{_PREFIX}/{pg}/last/{rank}"
        if not self._store.check([key]):
            return " (no call of it seen yet)"
        last = Fingerprint(**json.loads(self._store.get(key)))
        return f" (its last call: {last.describe()})"


@contextmanager
def check_collectives(timeout: float | datetime.timedelta = DEFAULT_TIMEOUT_S) -> Iterator[None]:
    """Check every ``fully_shard`` collective of this process against the other ranks.

        Enter it on every rank (switching on is itself a collective on the default group). Inside,
        a rank whose next collective differs from another rank's, or that waits more than
        ``timeout`` for a rank that never comes, raises :class:`FullyShardDesyncError` (before the
        collective is sent). Training that does not diverge is bit-identical with checking on.

        Example:
            >>> import contextlib
    import datetime
            >>> with check_collectives(timeout=datetime.timedelta(seconds=30)):  # doctest: +SKIP
            ...     model(x).sum().backward()
    """
    if any(isinstance(o, CollectiveChecker) for o in JOB_WIDE.observers):
        raise FullyShardStateError(
            "check_collectives() is already on in this process (nested, or turned on by "
            f"{ENV_ON}=1); use one"
        )
    checker = CollectiveChecker(_seconds(timeout))
    JOB_WIDE.observers = (*JOB_WIDE.observers, checker)
    try:
        yield
    finally:
        JOB_WIDE.observers = tuple(o for o in JOB_WIDE.observers if o is not checker)
        checker.close()


def check_from_environment() -> bool:
    """Switch checking on for the whole job if ``FULLY_SHARD_CHECK_COLLECTIVES=1``.

    Called by ``fully_shard`` on every rank (through the job-wide observer slot, where this
    module registers it); the first call with the variable set switches
    it on, later ones find it on. Returns whether checking is on.

    Example:
        >>> import os
        >>> os.environ.get("FULLY_SHARD_CHECK_COLLECTIVES") is None or check_from_environment()
        True
    """
    if os.environ.get(ENV_ON, "0") in ("", "0"):
        return False
    if any(isinstance(o, CollectiveChecker) for o in JOB_WIDE.observers):
        return True
    raw = os.environ.get(ENV_TIMEOUT, str(DEFAULT_TIMEOUT_S))
    try:
        timeout = float(raw)
    except ValueError:
        raise FullyShardValueError(
            f"{ENV_TIMEOUT}={raw!r} is not a number of seconds; set e.g. {ENV_TIMEOUT}=30"
        ) from None
    checker = CollectiveChecker(_seconds(timeout))
    JOB_WIDE.observers = (*JOB_WIDE.observers, checker)
    return True


# The tool's one act at import (``import fully_shard`` imports it): it offers its switch to the
# engine's job-wide slot, which ``fully_shard()`` runs, so the environment variable works with
# no import of this tool in the engine. Registered once, also if the module is reloaded.
if not any(getattr(s, "__qualname__", None) == "check_from_environment" for s in JOB_WIDE.switches):
    JOB_WIDE.switches = (*JOB_WIDE.switches, check_from_environment)
