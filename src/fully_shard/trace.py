"""``fully_shard.trace``: an opt-in timeline of every group's work, as a Chrome/Perfetto trace.

While a :class:`Recorder` is attached, each group reports, with a start and an end time:

| event | from .. to | ``nbytes`` |
| --- | --- | --- |
| ``forward`` | the group's first module starts .. its last ends | 0 |
| ``backward`` | the first gradient of an output .. grads reduced | 0 |
| ``unshard`` | storage allocated, all-gather issued .. copied out | unsharded bytes gained |
| ``reshard`` | the start .. the end of freeing the storage | unsharded bytes freed |
| ``all_gather`` | issued .. completed (the work's future is done) | this rank's input |
| ``reduce_scatter`` | issued .. completed (or waited for, see ``collective``) | this rank's input |
| ``all_reduce`` | issued .. completed (HSDP only) | the tensor |

It also samples the unsharded parameter bytes alive on the rank (the padded storage, in the
compute dtype, of every group) when an unshard or a reshard ends: the memory timeline. (The
storage is allocated when the all-gather is waited for, so a prefetched group in flight counts
only from then on.)

Nothing is recorded, and nothing is allocated, while no recorder is attached: a recorder is one
of the groups' observers (``fully_shard.observer``) only inside its ``with`` block, and it
times the collectives the engine issues through it.

Example:
    On every rank:

    >>> from fully_shard import trace
    >>> with trace.record(model) as rec:  # doctest: +SKIP
    ...     model(tokens).sum().backward()
    >>> recordings = trace.gather(rec)  # a collective: rank 0 gets every rank's  # doctest: +SKIP
    >>> if recordings:  # rank 0  # doctest: +SKIP
    ...     trace.write_chrome_trace("trace.json", recordings)  # open in ui.perfetto.dev
    ...     trace.plot_memory("memory.png", recordings)  # needs matplotlib

Times are wall-clock nanoseconds (a monotonic clock anchored to ``time.time_ns()`` once per
recorder), so ranks on one host line up to within microseconds; across hosts they are as
good as the hosts' clock synchronisation.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from .collectives import Waitable
from .errors import FullyShardStateError, FullyShardValueError
from .group import ParamGroup
from .hooks import FSDPState, group_labels
from .observer import CollectiveCall, ObservedGroup, SpanKind

Kind = Literal[
    "forward", "backward", "unshard", "reshard", "all_gather", "reduce_scatter", "all_reduce"
]

# Which track of a rank each kind is drawn on; the order is the order of the tracks.
_TRACKS: dict[str, str] = {
    "forward": "compute",
    "backward": "compute",
    "unshard": "unshard / reshard",
    "reshard": "unshard / reshard",
    "all_gather": "collectives",
    "reduce_scatter": "collectives",
    "all_reduce": "collectives",
}
_TRACK_ORDER = ("compute", "unshard / reshard", "collectives")

ROOT_LABEL = "root"

# The engine's spans this recorder keeps (the hook-body spans are for the profiler).
_SPANS: dict[str, Kind] = {
    "forward": "forward",
    "backward": "backward",
    "unshard": "unshard",
    "reshard": "reshard",
}


@dataclass(frozen=True)
class TraceEvent:
    """One span of one group's work on one rank.

    Attributes:
        kind: what happened (``"forward"``, ``"all_gather"``, ... ; see the module docstring).
        group: the group's label: the qualified name of its module (``"layers.0"``), ``"root"``
            for the root module, names joined with ``+`` for a list group.
        start_ns: wall-clock start in nanoseconds.
        end_ns: wall-clock end in nanoseconds.
        nbytes: bytes moved or allocated (see the module docstring), 0 for compute.

    Example:
        >>> e = TraceEvent("all_gather", "layers.0", 1_000, 4_000, nbytes=4096)
        >>> e.duration_ns
        3000
    """

    kind: Kind
    group: str
    start_ns: int
    end_ns: int
    nbytes: int = 0

    @property
    def duration_ns(self) -> int:
        """``end_ns - start_ns``."""
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class MemorySample:
    """The unsharded parameter bytes alive on a rank at one instant.

    Example:
        >>> MemorySample(time_ns=5_000, unsharded_bytes=1024).unsharded_bytes
        1024
    """

    time_ns: int
    unsharded_bytes: int


@dataclass(frozen=True)
class Recording:
    """What one rank's :class:`Recorder` saw: plain data, picklable, mergeable across ranks.

    Attributes:
        rank: the global rank that recorded it.
        groups: the labels of the recorded groups, in module (pre-)order.
        events: every :class:`TraceEvent`, ordered by start time.
        memory: the memory timeline, in time order.
        replica_bytes: the unsharded bytes of every group at once: what a rank would hold
            without sharding (the padded storage, in the compute dtype), parameters kept
            whole (``param_persistence_threshold``) included.

    Example:
        >>> rec = Recording(0, ("root",), (), (), replica_bytes=0)
        >>> rec.events_of("forward")
        []
    """

    rank: int
    groups: tuple[str, ...]
    events: tuple[TraceEvent, ...]
    memory: tuple[MemorySample, ...]
    replica_bytes: int

    def events_of(self, kind: Kind, group: str | None = None) -> list[TraceEvent]:
        """The events of one kind (and, if given, one group), in time order."""
        return [e for e in self.events if e.kind == kind and (group is None or e.group == group)]

    def peak_unsharded_bytes(self) -> int:
        """The most unsharded parameter bytes alive at any sample (0 if none), the parameters
        kept whole included: they are alive at every sample."""
        return max((m.unsharded_bytes for m in self.memory), default=0)


def _unsharded_nbytes(group: ParamGroup) -> list[int]:
    # The padded storage (W * c rows), in the compute dtype: what alloc_storage allocates.
    # The policy's answer, not ShardedParam.compute_dtype, which is set at the first gather
    # and would count a recorder made before the first forward in the original dtype.
    return [
        p.padded_full_size.numel() * p.mp_policy.compute_dtype(p.orig_dtype).itemsize
        for p in group.params
    ]


def _kept_nbytes(group: ParamGroup) -> int:
    # Parameters kept whole are held unsharded at every moment; counted in the compute dtype
    # (under a param_dtype the module computes with a cast copy), as sharded ones are.
    return sum(
        pp.local.numel() * pp.mp_policy.compute_dtype(pp.local.dtype).itemsize
        for pp in group.persistent
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _TimedWait:
    """A work handle that calls ``on_done`` once, after its first ``wait()`` returns."""

    def __init__(self, inner: Waitable, on_done: Callable[[], None]) -> None:
        self.inner = inner
        self.on_done: Callable[[], None] | None = on_done

    def wait(self) -> Any:
        result = self.inner.wait()
        if self.on_done is not None:
            self.on_done()
            self.on_done = None
        return result


@dataclass
class _Attached:
    group: ParamGroup
    label: str
    param_nbytes: list[int]
    kept_nbytes: int = 0


class Recorder:
    """Records every group under ``module`` while attached (``with`` block); see :func:`record`.

    It is an observer of every group (``fully_shard.observer.Observer``): the engine calls
    :meth:`begin`, :meth:`end` and :meth:`collective`; :meth:`recording` returns what was seen.

    Example:
        >>> with Recorder(model) as rec:  # doctest: +SKIP
        ...     model(x).sum().backward()
        >>> len(rec.recording().events_of("forward"))  # doctest: +SKIP
        5
    """

    def __init__(self, module: nn.Module, rank: int | None = None) -> None:
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self._attached: dict[int, _Attached] = {}  # id(group) -> what we changed on it
        for base, state in _states(module):
            for group, label in zip(state.groups, group_labels(base, state.groups), strict=True):
                if id(group) not in self._attached:
                    self._attached[id(group)] = _Attached(
                        group, label, _unsharded_nbytes(group), _kept_nbytes(group)
                    )
        if not self._attached:
            raise FullyShardValueError(
                f"trace.record() found no fully_shard group in {type(module).__name__}: "
                "call fully_shard on the model (each block, then the root) before recording"
            )
        # perf_counter is monotonic and fine-grained; the offset makes it wall-clock-based so
        # that the ranks' timelines can be merged.
        self._offset = time.time_ns() - time.perf_counter_ns()
        self._open: dict[tuple[int, str], int] = {}
        self.events: list[TraceEvent] = []
        self.memory: list[MemorySample] = []
        self.active = False

    # -- attaching --------------------------------------------------------------------------

    def __enter__(self) -> Recorder:
        for a in self._attached.values():
            if any(isinstance(o, Recorder) for o in a.group.observers):
                raise FullyShardStateError(
                    f"group {a.label!r} is already being recorded: trace.record() blocks on "
                    "one model cannot nest; use one recorder for the whole model"
                )
        for a in self._attached.values():
            a.group.observers = (*a.group.observers, self)
        self.active = True
        self._sample()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._sample()
        for a in self._attached.values():
            a.group.observers = tuple(o for o in a.group.observers if o is not self)
        self._open.clear()
        self.active = False

    # -- called by the engine ------------------------------------------------------------------

    def now(self) -> int:
        """Wall-clock nanoseconds on this recorder's clock."""
        return time.perf_counter_ns() + self._offset

    def begin(self, group: ObservedGroup, kind: SpanKind) -> None:
        """A span of ``kind`` starts for ``group`` (called by the engine)."""
        if kind in _SPANS:
            self._open[(id(group), kind)] = self.now()

    def end(self, group: ObservedGroup, kind: SpanKind) -> None:
        """The open span of ``kind`` ends for ``group``; one never begun is ignored."""
        if kind not in _SPANS:
            return
        start = self._open.pop((id(group), kind), None)
        attached = self._attached.get(id(group))
        if start is None or attached is None:
            return
        nbytes = sum(attached.param_nbytes) if kind in ("unshard", "reshard") else 0
        self.events.append(TraceEvent(_SPANS[kind], attached.label, start, self.now(), nbytes))
        if kind in ("unshard", "reshard"):
            self._sample()

    def collective(
        self, group: ObservedGroup, call: CollectiveCall, issue: Callable[[], Waitable | None]
    ) -> Waitable | None:
        """Issue and time one of ``group``'s collectives (called by the engine)."""
        attached = self._attached.get(id(group))
        if attached is None:
            return issue()
        start = self.now()
        work = issue()
        return self._timed(call.op, attached.label, start, call.nbytes, work)

    def _timed(
        self, kind: Kind, label: str, start: int, nbytes: int, work: Waitable | None
    ) -> Waitable | None:
        """Record a collective issued at ``start``; returns the handle to give the engine.

        A synchronous one (``work is None``) is done now. A ``torch.distributed.Work`` ends
        when its future completes (a callback; ``work`` is returned as it is). Any other
        handle (e.g. gloo's all-gather, W broadcasts waited as one) ends when it has
        been waited for: it comes back wrapped so that its ``wait()`` records the end.
        """

        def done(*_: object) -> None:
            # For a future: runs on the backend's thread when the collective completes.
            self.events.append(TraceEvent(kind, label, start, self.now(), nbytes))

        if work is None:
            done()
            return None
        get_future = getattr(work, "get_future", None)
        if get_future is not None:
            try:
                future: torch.futures.Future[Any] = get_future()
            except RuntimeError:  # a backend whose Work has no future: time the wait instead
                pass
            else:
                future.add_done_callback(done)
                return work
        return _TimedWait(work, done)

    def _sample(self) -> None:
        alive = 0
        for a in self._attached.values():
            alive += a.kept_nbytes
            for p, nbytes in zip(a.group.params, a.param_nbytes, strict=True):
                if p.storage_allocated():
                    alive += nbytes
        self.memory.append(MemorySample(self.now(), alive))

    # -- results -------------------------------------------------------------------------------

    def recording(self) -> Recording:
        """A snapshot of everything recorded so far, as plain data.

        Example:
            >>> rec.recording().groups  # doctest: +SKIP
            ('root', 'layers.0', 'layers.1')
        """
        return Recording(
            rank=self.rank,
            groups=tuple(a.label for a in self._attached.values()),
            events=tuple(sorted(self.events, key=lambda e: (e.start_ns, -e.end_ns))),
            memory=tuple(sorted(self.memory, key=lambda m: m.time_ns)),
            replica_bytes=sum(sum(a.param_nbytes) + a.kept_nbytes for a in self._attached.values()),
        )


def _states(module: nn.Module) -> Iterator[tuple[str, FSDPState]]:
    """Every ``fully_shard`` state under ``module`` with its label, in module pre-order."""
    names: dict[int, str] = {}
    for name, m in module.named_modules():
        names.setdefault(id(m), name or ROOT_LABEL)
    for m in module.modules():
        state = getattr(m, "_fsdp_state", None)
        if isinstance(state, FSDPState):
            yield "+".join(names.get(id(x), type(x).__name__) for x in state.modules), state


def record(module: nn.Module) -> Recorder:
    """Record every group of ``module`` (a ``fully_shard``-ed model) inside a ``with`` block.

    Call it on every rank, around the steps you want to see. Each rank records its own events;
    :func:`gather` brings them to one rank.

    Example:
        >>> with record(model) as rec:  # doctest: +SKIP
        ...     model(x).sum().backward()
        >>> rec.recording().events_of("all_gather")[0].nbytes  # doctest: +SKIP
        4096
    """
    return Recorder(module)


def gather(recorder: Recorder | Recording, dst: int = 0) -> list[Recording]:
    """Collect every rank's recording on rank ``dst`` (a collective: call it on every rank).

    Returns the recordings ordered by rank on ``dst`` and ``[]`` on the other ranks; without an
    initialised process group (one process) it returns ``[recording]``.

    Example:
        >>> recordings = gather(rec)  # doctest: +SKIP
        >>> [r.rank for r in recordings]  # doctest: +SKIP
        [0, 1]
    """
    mine = recorder.recording() if isinstance(recorder, Recorder) else recorder
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    is_dst = dist.get_rank() == dst
    out: list[Any] | None = [None] * dist.get_world_size() if is_dst else None
    dist.gather_object(mine, out, dst=dst)
    if out is None:
        return []
    return sorted((r for r in out if isinstance(r, Recording)), key=lambda r: r.rank)


# -- Chrome / Perfetto trace ------------------------------------------------------------------


def _lanes(events: Sequence[TraceEvent]) -> list[int]:
    """A lane per event such that events in one lane are disjoint or strictly nested.

    Chrome's "complete" events on one thread must nest; prefetching and the asynchronous
    reduce-scatter overlap spans that do not, so an overlapping one goes to the next lane.
    ``events`` must be sorted by ``(start, -end)``.
    """
    stacks: list[list[int]] = []  # per lane: the end times of the spans still open
    out: list[int] = []
    for e in events:
        for i, stack in enumerate(stacks):
            while stack and stack[-1] <= e.start_ns:
                stack.pop()
            if not stack or e.end_ns <= stack[-1]:
                stack.append(e.end_ns)
                out.append(i)
                break
        else:
            stacks.append([e.end_ns])
            out.append(len(stacks) - 1)
    return out


def chrome_trace(recordings: Sequence[Recording]) -> dict[str, Any]:
    """Merge ranks' recordings into one Chrome trace (``{"traceEvents": [...]}``).

    Each rank is a process (``pid`` = rank, named ``rank r``) with three kinds of track
    (threads): ``compute`` (forward, backward), ``unshard / reshard`` and ``collectives``; a
    track splits into numbered lanes where spans overlap without nesting. Each span is a
    complete event (``"ph": "X"``, microseconds from the earliest event of any rank) named
    ``"<kind> <group>"``, with ``group`` and ``bytes`` in ``args``; the memory timeline is a
    counter (``"ph": "C"``) named ``unsharded parameters``.

    Example:
        >>> trace = chrome_trace([Recording(0, ("root",), (), (), 0)])
        >>> meta = [e.get("args") for e in trace["traceEvents"] if e.get("ph") == "M"]
        >>> print(meta[0].get("name"))
        rank 0
    """
    starts = [e.start_ns for r in recordings for e in r.events]
    starts += [m.time_ns for r in recordings for m in r.memory]
    t0 = min(starts, default=0)

    def us(ns: int) -> float:
        return round((ns - t0) / 1e3, 3)

    out: list[dict[str, Any]] = []
    for rec in recordings:
        pid = rec.rank
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}})
        out.append(
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}
        )
        tids: dict[tuple[str, int], int] = {}
        by_track: dict[str, list[TraceEvent]] = {t: [] for t in _TRACK_ORDER}
        for e in rec.events:
            by_track[_TRACKS[e.kind]].append(e)
        for track in _TRACK_ORDER:
            events = sorted(by_track[track], key=lambda e: (e.start_ns, -e.end_ns))
            for e, lane in zip(events, _lanes(events), strict=True):
                if (track, lane) not in tids:
                    tid = len(tids)
                    tids[(track, lane)] = tid
                    name = track if lane == 0 else f"{track} ({lane + 1})"
                    meta = {"pid": pid, "tid": tid, "ph": "M"}
                    out.append({"name": "thread_name", **meta, "args": {"name": name}})
                    out.append({"name": "thread_sort_index", **meta, "args": {"sort_index": tid}})
                out.append(
                    {
                        "name": f"{e.kind} {e.group}",
                        "cat": e.kind,
                        "ph": "X",
                        "pid": pid,
                        "tid": tids[(track, lane)],
                        "ts": us(e.start_ns),
                        "dur": round(e.duration_ns / 1e3, 3),
                        "args": {"group": e.group, "bytes": e.nbytes},
                    }
                )
        for m in rec.memory:
            out.append(
                {
                    "name": "unsharded parameters",
                    "ph": "C",
                    "pid": pid,
                    "ts": us(m.time_ns),
                    "args": {"bytes": m.unsharded_bytes},
                }
            )
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "fully_shard.trace", "ranks": [r.rank for r in recordings]},
    }


def write_chrome_trace(path: str | Path, recordings: Sequence[Recording]) -> Path:
    """Write :func:`chrome_trace` as JSON to ``path``; open it in ui.perfetto.dev.

    Example:
        >>> write_chrome_trace("trace.json", gather(rec))  # doctest: +SKIP
        PosixPath('trace.json')
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(recordings)))
    return path


# -- memory timeline plot ---------------------------------------------------------------------


def _unit(max_bytes: int) -> tuple[str, float]:
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if max_bytes >= 1 << shift:
            return unit, float(1 << shift)
    return "KiB", 1024.0


def plot_memory(
    path: str | Path, recordings: Sequence[Recording], title: str | None = None
) -> Path:
    """Plot the unsharded parameter bytes alive over time, one line per rank, as a PNG.

    A dashed line marks what an unsharded replica would hold (``replica_bytes``); the shaded
    spans are rank 0's root forward and backward. Needs matplotlib (``pip install matplotlib``, or
    ``pip install -e '.[plot]'`` in a clone of this repository).

    Raises:
        ModuleNotFoundError: matplotlib is not installed; the message says how to install it.

    Example:
        >>> plot_memory("memory.png", gather(rec))  # doctest: +SKIP
        PosixPath('memory.png')
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ModuleNotFoundError(
            "fully_shard.trace.plot_memory needs matplotlib: pip install matplotlib "
            "(or, in a clone of the fully_shard repository, pip install -e '.[plot]')",
            name="matplotlib",
        ) from err
    if not recordings:
        raise FullyShardValueError("plot_memory() got no recordings (gather returns [] off dst)")
    t0 = min((m.time_ns for r in recordings for m in r.memory), default=0)
    peak = max(max(r.replica_bytes, r.peak_unsharded_bytes()) for r in recordings)
    unit, div = _unit(peak)

    fig = Figure(figsize=(10, 3.6), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    first = recordings[0]
    phases: tuple[tuple[Kind, str], ...] = (("forward", "tab:blue"), ("backward", "tab:orange"))
    for kind, color in phases:
        for i, e in enumerate(first.events_of(kind, ROOT_LABEL)):
            ax.axvspan(
                (e.start_ns - t0) / 1e6,
                (e.end_ns - t0) / 1e6,
                color=color,
                alpha=0.08,
                label=f"{kind} (rank {first.rank})" if i == 0 else None,
            )
    for rec in recordings:
        xs = [(m.time_ns - t0) / 1e6 for m in rec.memory]
        ys = [m.unsharded_bytes / div for m in rec.memory]
        ax.step(xs, ys, where="post", label=f"rank {rec.rank}")
    ax.axhline(
        first.replica_bytes / div,
        color="gray",
        linestyle="--",
        label="every group unsharded (a replica)",
    )
    ax.set_xlabel("time (ms)")
    ax.set_ylabel(f"unsharded parameters ({unit})")
    ax.set_title(title or "unsharded parameter bytes alive")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
