"""How tools watch the engine: the observer protocol, and the profiler labels built on it.

The engine tells a group's observers two kinds of things and nothing else:

- **spans**: a named piece of a group's work begins and ends (``forward`` from its first
  module's start to its last module's end, ``unshard``, ``reshard``, the hook bodies
  ``pre_forward`` / ``post_forward`` / ``pre_backward`` / ``post_backward``, ...);
- **collectives**: every all-gather, reduce-scatter and all-reduce goes through
  :meth:`Observer.collective`, which is handed the call's description and a thunk that issues
  it, so an observer can act before (check), around (label) and after (time the handle).

Tools implement :class:`Observer` and add themselves to ``ParamGroup.observers``;
``fully_shard.trace`` records a timeline, :class:`ProfilerLabels` (on by default) names every
span and collective in ``torch.profiler`` traces the way torch's FSDP2 does
(``FSDP::pre_forward (layers.0)``). No engine file imports a tool: the engine only knows this
protocol.

Example:
    >>> class CountAllGathers:
    ...     def __init__(self):
    ...         self.n = 0
    ...     def begin(self, group, kind): pass
    ...     def end(self, group, kind): pass
    ...     def collective(self, group, call, issue):
    ...         self.n += call.op == "all_gather"
    ...         return issue()
    >>> counter = CountAllGathers()
    >>> group.observers += (counter,)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from ._compat import profiler_enabled
from .collectives import Waitable

SpanKind = Literal[
    "forward",
    "backward",
    "unshard",
    "reshard",
    "pre_forward",
    "post_forward",
    "pre_backward",
    "post_backward",
    "all_gather_copy_out",
    "post_backward_reduce",
    "root_post_backward_callback",
]
CollectiveOp = Literal["all_gather", "reduce_scatter", "all_reduce"]


@dataclass(frozen=True)
class CollectiveCall:
    """One collective a group is about to issue.

    Attributes:
        op: ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``.
        input: this rank's input (the shard for an all-gather, the packed gradients for a
            reduce-scatter, the tensor for an all-reduce).
        process_group: the group it runs on.

    Example:
        >>> import torch
        >>> call = CollectiveCall("all_gather", torch.zeros(4), None)  # doctest: +SKIP
        >>> call.nbytes  # doctest: +SKIP
        16
    """

    op: CollectiveOp
    input: torch.Tensor
    process_group: dist.ProcessGroup

    @property
    def nbytes(self) -> int:
        """The bytes this rank puts into the collective."""
        return self.input.numel() * self.input.element_size()


class ObservedGroup(Protocol):
    """What an observer is told of a group: its label, and the observers it tells.

    ``ParamGroup`` is one; naming it through this protocol keeps ``observer.py`` below
    ``group.py`` (a tool that needs more of the group, such as the trace, imports it itself).

    Example:
        >>> group.label, group.observers  # doctest: +SKIP
        ('layers.0', (<fully_shard.observer.ProfilerLabels object at ...>,))
    """

    @property
    def label(self) -> str: ...

    @property
    def observers(self) -> tuple[Observer, ...]: ...


class Observer(Protocol):
    """What the engine tells a tool. Every method is called on the rank's own thread.

    Example:
        >>> group.observers += (my_observer,)  # doctest: +SKIP
    """

    def begin(self, group: ObservedGroup, kind: SpanKind) -> None:
        """A span of ``kind`` starts for ``group``."""
        ...

    def end(self, group: ObservedGroup, kind: SpanKind) -> None:
        """The span of ``kind`` ends for ``group`` (an end without a begin may come)."""
        ...

    def collective(
        self, group: ObservedGroup, call: CollectiveCall, issue: Callable[[], Waitable | None]
    ) -> Waitable | None:
        """Issue the collective by calling ``issue()`` and return its handle (or a wrapper).

        An observer may raise before calling ``issue`` (nothing has been sent yet).
        """
        ...


class ProfilerLabels:
    """Names every span and collective in ``torch.profiler`` traces, as torch's FSDP2 does.

    Labels read ``FSDP::<kind> (<group label>)``, e.g. ``FSDP::all_gather (layers.0)``, so
    TensorBoard, Perfetto and Holistic Trace Analysis views built for torch's FSDP2 find
    them. Every group has one by default; while no profiler records, a label costs one
    check (``_compat.profiler_enabled``, 0.2 µs) and no ``record_function`` (6 µs): a label
    is made only while a profiler records, which is when torch's own fast labels
    (``_RecordFunctionFast``) record too. A span that began before the profiler started is
    not labelled, as before (a ``record_function`` entered then recorded nothing either).

    Example:
        >>> with torch.profiler.profile() as prof:  # doctest: +SKIP
        ...     model(x).sum().backward()
        >>> any(e.name.startswith("FSDP::pre_forward") for e in prof.events())  # doctest: +SKIP
        True
    """

    def __init__(self) -> None:
        # Open ranges by (group, kind): begin and end come from different hooks. Public so
        # that a group can see in one truth test that there is nothing to end.
        self.open: dict[tuple[int, str], record_function] = {}

    def begin(self, group: ObservedGroup, kind: SpanKind) -> None:
        if kind in ("forward", "backward"):  # span user code: torch labels only its hooks
            return
        if self.open:
            self.end(group, kind)  # one left open by an exception
        if not profiler_enabled():  # nothing would record the label: skip its cost
            return
        rf = record_function(f"FSDP::{kind} ({group.label})")
        rf.__enter__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.open[(id(group), kind)] = rf

    def end(self, group: ObservedGroup, kind: SpanKind) -> None:
        if not self.open:
            return
        rf = self.open.pop((id(group), kind), None)
        if rf is not None:
            rf.__exit__(None, None, None)

    def collective(
        self, group: ObservedGroup, call: CollectiveCall, issue: Callable[[], Waitable | None]
    ) -> Waitable | None:
        if not profiler_enabled():
            return issue()
        with record_function(f"FSDP::{call.op} ({group.label})"):
            return issue()


class JobWideObservers:
    """Observers of every group's collectives in this process, beside each group's own.

    The one process-wide slot of the engine (STYLE.md asks for none): the collective checker
    (``fully_shard.debug``) must see every collective of a job, in order, including those
    issued from autograd's threads, which a ``ContextVar`` set by the user's thread would not
    reach. Only ``fully_shard.debug`` sets it; empty, it costs one truth test per collective.

    Example:
        >>> JOB_WIDE.observers  # nothing is checked unless debug.check_collectives is on
        ()
    """

    def __init__(self) -> None:
        self.observers: tuple[Observer, ...] = ()
        # Tools that a job switches on from its environment (``fully_shard.debug``'s
        # FULLY_SHARD_CHECK_COLLECTIVES=1) register a switch here, so that the engine, which
        # imports no tool, can let them look at every fully_shard call.
        self.switches: tuple[Callable[[], object], ...] = ()

    def switch_on_from_environment(self) -> None:
        """Run every registered switch (``fully_shard`` calls it once its checks passed)."""
        for switch in self.switches:
            switch()


JOB_WIDE = JobWideObservers()


def issue_observed(
    group: ObservedGroup, call: CollectiveCall, issue: Callable[[], Waitable | None]
) -> Waitable | None:
    """Issue ``call`` through every observer of ``group`` (and the job-wide ones, outermost)."""
    observers = group.observers
    if JOB_WIDE.observers:
        observers = JOB_WIDE.observers + observers
    run = issue
    for observer in reversed(observers):
        run = _bind(observer, group, call, run)
    return run()


def _bind(
    observer: Observer, group: ObservedGroup, call: CollectiveCall, inner: Callable[[], Any]
) -> Callable[[], Waitable | None]:
    return lambda: observer.collective(group, call, inner)
