"""Runtime: the hooks that decide *when* a group gathers, frees and reduces.

Per ``fully_shard`` call there is one :class:`FSDPState`: its groups (one per mesh the call's
parameters are sharded over; usually one) plus its place in the iteration. Every hook acts on
all of a state's groups, in order. Hooks, in the order one training step meets them:

1. forward pre-hook: the first one ever makes its module the root (lazy init: the root finds
   every state below it); then unshard the group, and pass the module's inputs that need a
   gradient through :class:`_AfterModuleBackward`, whose backward runs once autograd is done
   with every node of the module's forward.
2. forward post-hook: hook the outputs' gradients (pre-backward), reshard if the group reshards
   after forward (or if no backward can follow).
3. pre-backward (a hook on an output's gradient): unshard again; the first one in a backward
   queues the root's end-of-backward callback.
4. post-backward (the backward of ``_AfterModuleBackward``): the module's backward is over, so
   nothing needs its unsharded parameters any more, frozen ones included: reduce-scatter the
   gradients and reshard. (Not when the last *trainable* gradient arrives: a frozen weight
   beside trainable adapters is still needed for the gradient of the module's input.)
5. end of backward (root callback): finish groups whose post-backward never ran (inputs that
   need no gradient, unused modules), wait for the last reduce-scatter, end the iteration.

Activation checkpointing re-runs forwards inside backward; the hooks see ``in_backward`` and
only make sure the parameters are gathered.

Everything that lives for one iteration sits in one record, :class:`_Iteration` per state and
:class:`_RootIteration` per root, and :meth:`FSDPState.end_iteration` replaces them all: the
end of backward and ``reset_iter_state()`` go through it, so no flag can be left behind.

Prefetch: the first iteration records the order in which groups start and finish their
forward. From then on a group that starts its forward issues the next group's all-gather
asynchronously (it runs while this group computes), and a group that starts its backward does
the same for the group whose forward finished just before its own (backward runs in reverse).
A group nobody prefetched (the root, at every step) issues its own gather and then the next
group's before it waits for its own.
``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` replace the implicit
choice with explicit lists (an empty list turns prefetching off for that group). Every rank
records the same order, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch
from torch import nn

from ._compat import (
    gradient_edge_node,
    inside_backward,
    keep_out_of_graphs,
    profiler_enabled,
    queue_end_of_backward,
    will_run_in_this_backward,
)
from .bucket import Buckets, gather_bytes, gather_key, reduce_bytes, reduce_key, runs_of
from .errors import FullyShardNotImplementedError, FullyShardStateError
from .group import GroupConfig, GroupState, ParamGroup
from .observer import SpanKind
from .param import ShardedParam
from .persist import PersistentParam, all_reduce_kept_whole


class Phase(enum.Enum):
    """Where a group is in one training iteration."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"

    __hash__ = object.__hash__  # as GroupState's: the phase table is read at every hook


_PHASES: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.FORWARD, Phase.PRE_BACKWARD, Phase.POST_BACKWARD}),
    Phase.FORWARD: frozenset({Phase.IDLE}),
    Phase.PRE_BACKWARD: frozenset({Phase.POST_BACKWARD, Phase.IDLE}),
    Phase.POST_BACKWARD: frozenset({Phase.IDLE, Phase.PRE_BACKWARD}),
}


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in nested tuples, lists, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        # A list, not a generator: a generator costs a Python call per element it yields.
        return type(obj)([_map_tensors(x, fn) for x in obj])
    if isinstance(obj, dict):
        mapped = {k: _map_tensors(v, fn) for k, v in obj.items()}
        try:
            return type(obj)(mapped)
        except TypeError:  # a dict subclass without a mapping constructor
            return mapped
    if is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            setattr(obj, f.name, _map_tensors(getattr(obj, f.name), fn))
        return obj
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):  # a module's usual output: nothing to traverse
        return [obj]
    found: list[torch.Tensor] = []

    def visit(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    _map_tensors(obj, visit)
    return found


def _cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    return _map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() else t)


@contextlib.contextmanager
def _spans(groups: tuple[ParamGroup, ...], kind: SpanKind) -> Iterator[None]:
    """Every group's ``kind`` span around a block (ended in reverse, also when it raises)."""
    with contextlib.ExitStack() as stack:
        for group in groups:
            stack.enter_context(group.span(kind))
        yield


def _begin_spans(groups: tuple[ParamGroup, ...], kind: SpanKind) -> None:
    """Every group's ``kind`` span begins; if one's begin raises, those begun end (as
    :func:`_spans`)."""
    for i, group in enumerate(groups):
        try:
            group.begin(kind)
        except BaseException:
            _end_spans(groups[:i], kind)
            raise


def _end_spans(groups: tuple[ParamGroup, ...], kind: SpanKind) -> None:
    for group in reversed(groups):
        group.end(kind)


# A hook's own span (its profiler label; tools' spans) is begun and ended by the hook itself,
# with ParamGroup.begin's and end's own tests of whether anyone looks written out inline
# before the calls: a hook wrapped in a labelling function, and a begin and an end called to
# return at once, cost 3 Python calls per hook (5 hooks per group per step; bench_overhead).


class _AfterModuleBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once the module's backward is done.

    The node is created before any of the module's ops, so autograd runs it after every node
    of the module's forward that leads to these inputs (and AccumulateGrad nodes run as soon
    as they are ready): then no gradient computation needs the module's parameters.
    """

    @staticmethod
    def forward(ctx: Any, state: FSDPState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.state._module_backward_done(ctx)  # ctx is this node (the outputs' grad_fn)
        return (None, *grads)


@dataclass
class _RootIteration:
    """What one iteration (forward + backward) sets on the root context."""

    forward_running: bool = False  # between the root's forward pre- and post-hook
    in_backward: bool = False
    callback_queued: bool = False
    # The groups (of one state) whose reduce-scatters may still be in flight (bounds
    # gradient memory).
    reducing: tuple[ParamGroup, ...] = ()


@dataclass
class RootContext:
    """Shared by all states under one root: the state list, the recorded order, root flags."""

    states: list[FSDPState] = field(default_factory=list)  # pre-order of the module tree
    it: _RootIteration = field(default_factory=_RootIteration)
    # Whether the end of backward waits for the last reduce-scatter (set_is_last_backward on
    # any module of the tree sets it, as in torch).
    is_last_backward: bool = True
    # Recorded during the first forward, for implicit prefetching.
    forward_order: list[FSDPState] = field(default_factory=list)  # by forward start
    post_forward_order: list[FSDPState] = field(default_factory=list)  # by forward end
    order_recorded: bool = False
    forward_iter: int = 0  # root forwards started so far
    # The graph path's record of the root forward being traced (graph.GraphRun), else None.
    graph_run: Any = None
    # set_manual_backward_finalization: the end of a backward leaves the groups it did not
    # finish (gathered, gradients on the unsharded parameters) and the reductions in flight
    # to FSDPModule.finalize_backward, called once per step.
    manual_finalization: bool = False
    # finalize_backward(async_op=True) not yet waited for: what finishes it (the next root
    # forward calls it if the caller did not).
    pending_finalization: Callable[[], None] | None = None
    # set_bucket_cap_mb (fully_shard.bucket): the buckets planned from the recorded order, or
    # None; planned again when a cap, a config or a description changed since (signature).
    buckets: Buckets | None = None
    buckets_dirty: bool = True
    bucket_signature: list[Any] = field(default_factory=list)
    # Whether any group keeps parameters whole (param_persistence_threshold), read at the end
    # of every backward: which parameters those are is fixed when fully_shard builds them.
    kept_whole: bool = False

    @property
    def in_backward(self) -> bool:
        return self.it.in_backward


@dataclass
class _Iteration:
    """What one iteration sets on one state; a new one replaces it at the end of backward."""

    forward_depth: int = 0  # forwards of this group's modules in flight (nesting)
    modules_to_run: set[int] = field(default_factory=set)  # modules yet to run this forward
    outputs_hooked: int = 0  # outputs given a pre-backward hook in this forward
    ran_forward: bool = False
    prefetched: bool = False  # gathered ahead of use by another group's hook
    # The _AfterModuleBackward nodes of this group's forwards whose backward has not run, held
    # weakly: a forward whose graph is dropped without a backward must not keep it alive.
    pending_nodes: list[weakref.ref[Any]] = field(default_factory=list)
    backward_end_unseen: bool = False  # a forward of the group had no input needing grad


def _assign_implicit_prefetch(ctx: RootContext) -> None:
    """After the first root forward: each group's next group in forward and in backward."""
    starts, ends = ctx.forward_order, ctx.post_forward_order
    for i, state in enumerate(starts):
        state._next_in_forward = starts[i + 1 : i + 2]
    for i, state in enumerate(ends):
        # backward runs in the reverse order of the forwards' ends
        state._next_in_backward = ends[i - 1 : i] if i > 0 else []


def _refresh_buckets(ctx: RootContext) -> None:
    """Plan the root's buckets again if a cap, a config or a description changed since they
    were planned (``set_*``, ``model.to()``); the recorded order is needed first."""
    if not ctx.order_recorded:
        return
    states = ctx.states
    signature: list[Any] = [s.bucket_cap for s in states]
    signature += [x for s in states for g in s.groups for x in (g.config, g.description)]
    # list == list: items compared by identity first, so an unchanged step costs no Python
    if not ctx.buckets_dirty and ctx.bucket_signature == signature:
        return
    ctx.bucket_signature, ctx.buckets_dirty = signature, False
    for state in states:
        for group in state.groups:
            group.bucket = None
    ctx.buckets = _plan_buckets(ctx) if any(s.bucket_cap for s in states) else None
    if ctx.buckets is not None:
        for group in ctx.buckets.members():
            group.bucket = ctx.buckets


def _plan_buckets(ctx: RootContext) -> Buckets | None:
    """Runs of the groups in forward order, in the order backward starts them (those that
    gather again there) and in the order backward finishes them, for reductions
    (fully_shard.bucket). A module's backward starts in the reverse order of the forwards'
    ends and finishes in the reverse order of their starts: the root, whose forward holds
    every other, starts backward first and finishes it last."""
    owner = {g: s for s in ctx.states for g in s.groups}
    forward = [g for s in ctx.forward_order for g in s.groups if g.params]
    starts = [g for s in reversed(ctx.post_forward_order) for g in s.groups if g.params]
    again = [g for g in starts if owner[g].reshard_after_forward and g.config.unshard_in_backward]
    ends = forward[::-1]

    def cap(group: ParamGroup) -> int | None:
        return owner[group].bucket_cap

    def claim(group: ParamGroup, backward: bool) -> bool:
        # The rules of _prefetch: only a group that will still run in this pass.
        state = owner[group]
        if state.phase is not Phase.IDLE:
            return False
        if backward:
            wanted = state.it.ran_forward and state.config.unshard_in_backward
        else:
            wanted = not (ctx.it.forward_running and state._forward_iter == ctx.forward_iter)
        state.it.prefetched |= wanted  # freed like a prefetch if its forward does not come
        return wanted

    buckets = Buckets(
        runs_of(forward, gather_key, lambda g: gather_bytes(g.description), cap),
        runs_of(again, gather_key, lambda g: gather_bytes(g.description), cap),
        runs_of(ends, reduce_key, lambda g: reduce_bytes(g.description), cap),
        in_backward=lambda: ctx.it.in_backward,
        claim=claim,
    )
    return buckets if buckets.members() else None


def group_labels(base: str, groups: tuple[ParamGroup, ...]) -> list[str]:
    """The label of each of one state's groups: ``base`` (its modules' names) for a single
    group; with several (per-parameter meshes), ``base@<shard dim name>`` for each but the
    first, made unique with ``#i`` where two meshes name their shard dim alike.

    Example:
        >>> group_labels("layers.0", (dense, experts))  # doctest: +SKIP
        ['layers.0', 'layers.0@ep']
    """
    labels = [base]
    for i, group in enumerate(groups[1:], start=1):
        names = group.info.mesh.mesh_dim_names
        dim = names[group.info.shard_mesh_dim] if names else f"mesh{i}"
        label = f"{base}@{dim}"
        labels.append(label if label not in labels else f"{label}#{i}")
    return labels


class FSDPState:
    """The runtime of one ``fully_shard`` call: its groups, its phase, its hooks.

    Example:
        >>> state = model._fsdp_state  # doctest: +SKIP
        >>> state.is_root, state.phase, len(state.groups)  # doctest: +SKIP
        (True, <Phase.IDLE: 'idle'>, 1)
    """

    def __init__(
        self,
        groups: tuple[ParamGroup, ...],
        modules: tuple[nn.Module, ...],
    ) -> None:
        if not groups:
            raise RuntimeError("a fully_shard state needs at least one group (internal error)")
        # One group per mesh the call's parameters are sharded over (per-parameter meshes
        # through shard_placement_fn); the call's own mesh first.
        self.groups = groups
        self.several = len(groups) > 1  # the hot paths take one group without a loop
        self.modules = modules
        # What a root forward waits to see run before the group's forward ends.
        self._module_ids = frozenset(id(m) for m in modules)
        self.phase = Phase.IDLE
        self.root: RootContext | None = None
        self.is_root = False
        # set_is_last_backward before the lazy init: the root context takes the root's value.
        self.is_last_backward_preset = True
        # set_manual_backward_finalization before the lazy init: likewise.
        self.manual_finalization_preset = False
        # A forward of the group ran since its gradients were last reduced: what
        # finalize_backward must still reduce (kept across backward passes, not per iteration).
        self.unfinalized = False
        self.it = _Iteration()
        self._module_hooks: list[Any] = []
        # id(module) -> the ids of the forward pre-hook and forward hook installed on it:
        # while they are its only hooks, FSDPModule.__call__ calls them itself.
        self.hook_ids: dict[int, tuple[int, int]] = {}
        # Explicit prefetch targets (None: the recorded order decides).
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        # The implicit prefetch targets, read off the recorded order once it is complete.
        self._next_in_forward: list[FSDPState] = []
        self._next_in_backward: list[FSDPState] = []
        self._forward_iter = -1  # the root forward in which this group's forward last ran
        # set_bucket_cap_mb: the largest bucket (bytes) this state's groups may join, or None.
        self.bucket_cap: int | None = None

    def __repr__(self) -> str:
        groups = ", ".join(repr(g) for g in self.groups)
        return f"FSDPState(root={self.is_root}, {self.phase.name}, {groups})"

    @property
    def group(self) -> ParamGroup:
        """The state's only group; with several (per-parameter meshes) use :attr:`groups`."""
        if len(self.groups) != 1:
            raise FullyShardStateError(
                f"this fully_shard state has {len(self.groups)} groups (parameters on "
                "several meshes); iterate state.groups instead of reading state.group "
                "(internal error)"
            )
        return self.groups[0]

    @property
    def params(self) -> list[ShardedParam]:
        """Every sharded parameter of the state, group by group."""
        return [p for group in self.groups for p in group.params]

    @property
    def persistent(self) -> list[PersistentParam]:
        """Every parameter the state keeps whole (``param_persistence_threshold``)."""
        return [p for group in self.groups for p in group.persistent]

    def sharded_versions(self) -> tuple[tuple[int, ...], ...]:
        """:meth:`ParamGroup.sharded_versions` of every group."""
        return tuple([group.sharded_versions() for group in self.groups])

    @property
    def config(self) -> GroupConfig:
        """The options the state's groups share (``set_*`` changes them all alike)."""
        return self.groups[0].config

    # -- installation and lazy init ----------------------------------------------------------

    def install(self) -> None:
        """Register the forward hooks on every module of the group, kept out of dynamo's graphs.

        The hooks gather into storage they resize and swap the module's parameters; dynamo
        must not trace that (fake tensors of freed storage, ``resize_`` of graph inputs).
        Kept out of the graph (:func:`~fully_shard._compat.keep_out_of_graphs`: a graph
        break at their call, run by Python even inside a ``torch.compile``d region), every
        compile order works: ``block.compile()`` and ``torch.compile(block)`` before or after
        sharding (fullgraph too: dynamo runs a disabled module hook outside the frame),
        ``torch.compile(model)``; the compiled code sees the gathered, plain parameters.
        torch's FSDP2 keeps its hooks out the same way (tests/test_compile.py compares).
        """
        pre_forward = keep_out_of_graphs(self.pre_forward)
        post_forward = keep_out_of_graphs(self.post_forward)
        for module in self.modules:
            pre = module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
            post = module.register_forward_hook(post_forward, with_kwargs=True)
            self._module_hooks += [pre, post]
            self.hook_ids[id(module)] = (pre.id, post.id)

    @property
    def reshard_after_forward(self) -> bool:
        flag = self.config.reshard_after_forward
        return (not self.is_root) if flag is None else flag

    def lazy_init(self) -> None:
        """Make this state the root of every state below its modules (first forward/unshard)."""
        ctx = RootContext(
            is_last_backward=self.is_last_backward_preset,
            manual_finalization=self.manual_finalization_preset,
        )
        seen: set[int] = set()
        names: dict[int, str] = {}
        for top in self.modules:
            for name, module in top.named_modules():
                names.setdefault(id(module), name)
                state = getattr(module, "_fsdp_state", None)
                if isinstance(state, FSDPState) and id(state) not in seen:
                    seen.add(id(state))
                    ctx.states.append(state)
        if self not in ctx.states:
            ctx.states.insert(0, self)
        ctx.kept_whole = any(g.persistent for state in ctx.states for g in state.groups)
        for state in ctx.states:
            state.root = ctx
            state.is_root = state is self
            state._next_in_forward, state._next_in_backward = [], []  # the new root records
            # Qualified names under the root ("root" for the root module itself), as in trace.
            base = "+".join(names.get(id(m)) or "root" for m in state.modules)
            module_names = tuple(names.get(id(m), "") for m in state.modules)
            for group, label in zip(state.groups, group_labels(base, state.groups), strict=True):
                group.label = label
                group.lazy_init(module_names)

    def ensure_initialized(self) -> RootContext:
        if self.root is None:
            self.lazy_init()
        if self.root is None:
            raise FullyShardStateError("lazy init did not set a root (internal error)")
        return self.root

    def _set_phase(self, new: Phase, call: str) -> None:
        if new is self.phase:
            return
        if new not in _PHASES[self.phase]:
            raise FullyShardStateError(
                f"{call} came in phase {self.phase.name}, which cannot move to {new.name} "
                f"({', '.join(repr(g) for g in self.groups)}); call reset_iter_state() on the "
                "root module to recover"
            )
        self.phase = new

    # -- forward -------------------------------------------------------------------------------

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The forward pre-hook, inside the groups' ``pre_forward`` span."""
        groups = self.groups
        group = groups[0]
        if (
            self.several
            or group.observers is not group.unwatched
            or group.labels.open
            or profiler_enabled()
        ):
            _begin_spans(groups, "pre_forward")
        try:
            ctx = self.root
            if ctx is None:
                ctx = self.ensure_initialized()
            if ctx.it.in_backward:
                return self._forward_in_backward(module, args, kwargs)
            it = self.it
            if it.forward_depth == 0:
                if self.is_root:
                    ctx.it.forward_running = True
                    if ctx.buckets is not None or ctx.buckets_dirty:
                        _refresh_buckets(ctx)
                    if ctx.pending_finalization is not None:  # finalize_backward(async_op=True)
                        ctx.pending_finalization()
                if not it.modules_to_run:
                    self._start_forward(ctx, module)
            it.forward_depth += 1
            input_dtype = group.description.input_dtype
            if input_dtype is not None:
                args, kwargs = _cast_floating((args, kwargs), input_dtype)
            if torch.is_grad_enabled():
                args, kwargs = self._hook_module_backward(args, kwargs)
            return args, kwargs
        finally:
            if self.several or group.observers is not group.unwatched or group.labels.open:
                _end_spans(groups, "pre_forward")

    def _forward_in_backward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A forward while the root's backward runs: a recomputation under activation
        checkpointing, or a forward after a backward that raised before its end."""
        if not inside_backward():
            raise FullyShardStateError(
                f"forward of {type(module).__name__} came while the previous backward had not "
                "finished (it raised, e.g. a second backward through a freed graph); call "
                "reset_iter_state() on the root module before the next forward"
            )
        if self.config.unshard_in_backward:  # as torch: off skips this gather too
            self._unshard_now()
        return self._cast_inputs(args, kwargs)  # recomputed exactly as it was computed

    def _start_forward(self, ctx: RootContext, module: nn.Module) -> None:
        """The group's forward starts with the first of its modules and ends when every module
        has run (a list group is gathered once, not once per module). Outside the root's
        forward (a head called per loss chunk) a module runs on its own."""
        it = self.it
        it.modules_to_run = set(self._module_ids) if ctx.it.forward_running else {id(module)}
        it.outputs_hooked = 0
        if self.phase is not Phase.FORWARD and Phase.FORWARD not in _PHASES[self.phase]:
            self._set_phase(Phase.FORWARD, f"forward of {type(module).__name__}")  # raises
        self.phase = Phase.FORWARD
        groups = self.groups
        for group in groups:
            if group.observers is not group.unwatched or group.labels.open or profiler_enabled():
                group.begin("forward")
        it.ran_forward = True
        self.unfinalized = True
        for group in groups:
            # Only a group still gathered can hold a stale copy: read no versions else.
            if group.state is GroupState.UNSHARDED and group.gathered_copy_is_stale():
                # Gathered before an optimizer step (explicit unshard,
                # reshard_after_backward=False): every rank stepped, so every rank
                # gathers again.
                group.reshard()
        it.prefetched = False
        if self.is_root:
            ctx.forward_iter += 1
        self._forward_iter = ctx.forward_iter
        if not ctx.order_recorded and self not in ctx.forward_order:
            ctx.forward_order.append(self)
        targets = self.forward_prefetch
        if targets is None:
            targets = self._next_in_forward
        if self.several:
            unprefetched = all(g.state is GroupState.SHARDED for g in groups)
        else:
            unprefetched = groups[0].state is GroupState.SHARDED
        if unprefetched:
            # Nobody prefetched this group (the root's, every step): its all-gather and the
            # next group's both go out before the first wait, so the next one travels while
            # this one is copied out.
            for group in groups:
                group.unshard(async_op=True)
            if targets:
                self._prefetch(targets, backward=False)
            for group in groups:
                if group.state is GroupState.UNSHARDING:
                    group.wait_for_unshard()
        else:
            self._unshard_now()  # waits only for groups already in flight if prefetched
            if targets:
                self._prefetch(targets, backward=False)

    def _cast_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        input_dtype = self.config.mp_policy.forward_input_dtype()  # traced: the policy, not the
        if input_dtype is None:  # description, is what the graph path guards on
            return args, kwargs
        return _cast_floating((args, kwargs), input_dtype)  # type: ignore[no-any-return]

    def _cast_output(self, output: Any) -> Any:
        out_dtype = self.groups[0].config.mp_policy.output_dtype
        return output if out_dtype is None else _cast_floating(output, out_dtype)

    def _hook_module_backward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
            # The usual call, one tensor: no traversal, no swap table.
            if not args[0].requires_grad:
                self.it.backward_end_unseen = True  # see below
                return args, kwargs
            one: tuple[torch.Tensor] = _AfterModuleBackward.apply(self, args[0])  # type: ignore[no-untyped-call]
            self.it.pending_nodes.append(weakref.ref(one[0].grad_fn))
            return one, kwargs
        # Tensors passed by position only need no traversal.
        plain = not kwargs and not [a for a in args if not isinstance(a, torch.Tensor)]
        needing_grad = [t for t in (args if plain else _tensors((args, kwargs))) if t.requires_grad]
        if not needing_grad:
            # No node can tell when this call's backward is over (its inputs need no
            # gradient): the root's end of backward finishes the group.
            self.it.backward_end_unseen = True
            return args, kwargs
        passed = _AfterModuleBackward.apply(self, *needing_grad)  # type: ignore[no-untyped-call]
        swap = {id(t): out for t, out in zip(needing_grad, passed, strict=True)}
        self.it.pending_nodes.append(weakref.ref(passed[0].grad_fn))
        if plain:
            return tuple([swap.get(id(a), a) for a in args]), kwargs
        return _map_tensors((args, kwargs), lambda t: swap.get(id(t), t))  # type: ignore[no-any-return]

    def post_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """The forward hook, inside the groups' ``post_forward`` span."""
        groups = self.groups
        group = groups[0]
        if (
            self.several
            or group.observers is not group.unwatched
            or group.labels.open
            or profiler_enabled()
        ):
            _begin_spans(groups, "post_forward")
        try:
            ctx = self.root
            if ctx is None:
                return output
            if ctx.it.in_backward:  # recomputation under activation checkpointing: as forward
                return self._cast_output(output)
            it = self.it
            it.forward_depth -= 1
            it.modules_to_run.discard(id(module))
            if torch.is_grad_enabled():
                versions = self.sharded_versions() if self.several else group.sharded_versions()
                hook = functools.partial(self._pre_backward, versions)
                for t in [output] if isinstance(output, torch.Tensor) else _tensors(output):
                    if t.requires_grad:
                        node = t.grad_fn
                        if node is None:  # a leaf passed through
                            t.register_hook(hook)  # type: ignore[no-untyped-call]
                        else:
                            # The node's pre-hook runs when the gradient of its outputs (this
                            # one's too) is ready, as a tensor hook would, and is a C call
                            # where Tensor.register_hook builds a handle in Python.
                            node.register_prehook(hook)
                        it.outputs_hooked += 1
            if it.forward_depth == 0:
                if not it.modules_to_run:
                    self._end_forward(ctx)
                if self.is_root:
                    self._end_root_forward(ctx)
            out_dtype = group.config.mp_policy.output_dtype
            return output if out_dtype is None else _cast_floating(output, out_dtype)
        finally:
            if self.several or group.observers is not group.unwatched or group.labels.open:
                _end_spans(groups, "post_forward")

    def _end_root_forward(self, ctx: RootContext) -> None:
        # Groups whose forward started in this root forward but skipped a module (a list
        # group whose head is called per loss chunk afterwards) end their forward here.
        for state in ctx.states:
            if state.phase is Phase.FORWARD and state.it.forward_depth == 0:
                state.it.modules_to_run = set()
                state._end_forward(ctx)
        ctx.it.forward_running = False
        if not ctx.order_recorded:
            _assign_implicit_prefetch(ctx)
            ctx.order_recorded = True
            _refresh_buckets(ctx)
        self._release_unused_prefetches(ctx)

    def _end_forward(self, ctx: RootContext) -> None:
        # Without an output that needs grad no backward will come to free the parameters.
        backward_follows = self.it.outputs_hooked > 0
        flag = self.groups[0].config.reshard_after_forward
        if ((not self.is_root) if flag is None else flag) or not backward_follows:
            for group in self.groups:
                if group.config.post_forward is None:  # its reshard_after_forward's first case
                    group.reshard()
                else:
                    group.reshard_after_forward(backward_follows=backward_follows)
        if self.phase is not Phase.IDLE and Phase.IDLE not in _PHASES[self.phase]:
            self._set_phase(Phase.IDLE, "end of forward")  # raises
        self.phase = Phase.IDLE
        if not ctx.order_recorded and self not in ctx.post_forward_order:
            ctx.post_forward_order.append(self)
        for group in reversed(self.groups):
            if group.observers is not group.unwatched or group.labels.open:
                group.end("forward")

    def _unshard_now(self) -> None:
        """Gather every group and wait (nothing for groups already gathered).

        With several groups every all-gather is issued before the first wait, so they overlap.
        """
        several = self.several
        for group in self.groups:
            if group.state is GroupState.SHARDED:
                group.unshard(async_op=several)
        for group in self.groups:
            if group.state is GroupState.UNSHARDING:
                group.wait_for_unshard()

    # -- backward ------------------------------------------------------------------------------

    def _ensure_end_of_backward_callback(self) -> RootContext:
        ctx = self.ensure_initialized()
        if not ctx.it.callback_queued:
            root = next(s for s in ctx.states if s.is_root)
            queue_end_of_backward(root._end_of_backward)
            ctx.it.callback_queued = True
            ctx.it.in_backward = True
        return ctx

    def _check_unchanged_since_forward(self, before: Any) -> None:
        # ``before``: the sharded versions when the forward whose output this is ended. An
        # in-place change since (optimizer.step(), load_state_dict) would pair that forward's
        # activations with new parameter values.
        befores = before if self.several else (before,)
        for group, was in zip(self.groups, befores, strict=True):
            now = group.sharded_versions()
            if now != was:
                # (the first of the counts: shards replaced, every parameter changed)
                name = next(
                    (
                        p.fqn
                        for p, v, w in zip(group.params, now[1:], was[1:], strict=True)
                        if v != w or now[0] != was[0]
                    ),
                    group.label,
                )
                raise FullyShardStateError(
                    f"backward came for parameter {name!r}, which was changed in place "
                    "(optimizer.step(), load_state_dict(), ...) after its forward; the "
                    "gradient would mix old activations with new values. Step the optimizer "
                    "after backward; call reset_iter_state() on the root module to recover"
                )

    def _pre_backward(self, forward_versions: Any, grad: Any) -> None:
        now = self.sharded_versions() if self.several else self.groups[0].sharded_versions()
        if now != forward_versions:
            self._check_unchanged_since_forward(forward_versions)  # names the parameter
        ctx = self.root
        if ctx is None or not ctx.it.callback_queued:
            self._ensure_end_of_backward_callback()
        if self.phase is not Phase.PRE_BACKWARD:
            self._start_backward()

    def _start_backward(self) -> None:
        """The group's backward starts, inside its ``pre_backward`` span."""
        groups = self.groups
        group = groups[0]
        if (
            self.several
            or group.observers is not group.unwatched
            or group.labels.open
            or profiler_enabled()
        ):
            _begin_spans(groups, "pre_backward")
        try:
            if Phase.PRE_BACKWARD not in _PHASES[self.phase]:
                self._set_phase(Phase.PRE_BACKWARD, "backward (gradient of an output)")  # raises
            self.phase = Phase.PRE_BACKWARD
            self.it.prefetched = False
            for g in groups:
                if g.observers is not g.unwatched or g.labels.open or profiler_enabled():
                    g.begin("backward")
            if group.config.unshard_in_backward:
                if self.several:
                    self._unshard_now()
                else:  # _unshard_now for one group, inline (once per group per backward)
                    if group.state is GroupState.SHARDED:
                        group.unshard(async_op=False)
                    if group.state is GroupState.UNSHARDING:
                        group.wait_for_unshard()
            targets = self.backward_prefetch
            if targets is None:
                targets = self._next_in_backward
            if targets:
                self._prefetch(targets, backward=True)
        finally:
            if self.several or group.observers is not group.unwatched or group.labels.open:
                _end_spans(groups, "pre_backward")

    # -- prefetch ------------------------------------------------------------------------------

    def _prefetch(self, targets: list[FSDPState], *, backward: bool) -> None:
        """Issue the all-gathers of ``targets`` without waiting; their own hooks wait."""
        for target in targets:
            if target is self or target.phase is not Phase.IDLE:
                continue
            if target.several:
                sharded = [g for g in target.groups if g.state is GroupState.SHARDED]
                if not sharded:
                    continue
            elif target.groups[0].state is GroupState.SHARDED:
                sharded = list(target.groups)
            else:
                continue
            # Only a group that will still run in this pass: in forward, one whose forward has
            # not run in this root forward; in backward, one that ran forward and has not
            # started its backward.
            if backward and not (
                target.it.ran_forward and target.groups[0].config.unshard_in_backward
            ):
                continue
            ctx = target.root
            if not backward and ctx is not None and target._forward_iter == ctx.forward_iter:
                continue
            for group in sharded:
                group.unshard(async_op=True)
            target.it.prefetched = True

    def _release_unused_prefetches(self, ctx: RootContext) -> None:
        # A prefetched group whose forward did not run this time (control flow changed).
        for state in ctx.states:
            if state.it.prefetched and state._forward_iter != ctx.forward_iter:
                for group in state.groups:
                    group.reshard()
                state.it.prefetched = False

    def _module_backward_done(self, node: object) -> None:
        """A module call's backward is over (``_AfterModuleBackward``): post-backward unless
        another call of this group still runs its backward in this pass."""
        it = self.it
        pending = it.pending_nodes
        if len(pending) == 1 and pending[0]() is node:  # the usual: one call, this one
            it.pending_nodes = []
            others: list[Any] = []
        else:
            alive = [(ref, ref()) for ref in pending]
            it.pending_nodes = [ref for ref, n in alive if n is not None and n is not node]
            others = [n for _, n in alive if n is not None and n is not node]
        if it.backward_end_unseen or self.phase is not Phase.PRE_BACKWARD:
            return
        # Calls whose backward comes in a later pass (F1 F2 B1 B2) do not hold the group.
        if others and any(will_run_in_this_backward(n) for n in others):
            return
        if not self.groups[0].config.requires_gradient_sync:
            self._check_weight_part_can_follow()
        self._post_backward()

    def _check_weight_part_can_follow(self) -> None:
        """Refuse a backward split into input and weight parts that would lose the weights'.

        A zero-bubble pipeline schedule runs each microbatch's backward as an input part
        (``autograd.grad`` to the stage inputs, gradient sync off) and later a weight part,
        for the parameters the stage listed *before* the input part. A group that resharded
        after forward showed its sharded DTensors then, which no gradient reaches: the weight
        gradients would be dropped without a sound. With the parameters kept gathered from
        forward to backward the stage lists the ones autograd uses, and both parts are exact.
        """
        if self.config.requires_gradient_sync or not self.reshard_after_forward:
            return
        trainable = [
            p.unsharded_param
            for p in self.params
            if p.requires_grad and p.unsharded_param is not None
        ]
        if not trainable or any(
            will_run_in_this_backward(gradient_edge_node(t)) for t in trainable
        ):
            return
        raise FullyShardNotImplementedError(
            f"group {self.groups[0].label!r}: this backward pass computes input gradients "
            "only (the input part of a zero-bubble pipeline schedule: "
            "ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) while "
            "the group resharded its parameters after forward, so the weight part would miss "
            "them and their gradients would be lost. Keep the stage's parameters gathered "
            "from forward to backward: fully_shard(..., reshard_after_forward=False) on the "
            "stage's modules (torchtitan's default under pipeline parallelism)"
        )

    def _post_backward(self) -> None:
        """The group's backward is done: reduce, reshard; inside its ``post_backward`` span."""
        groups = self.groups
        group = groups[0]
        if (
            self.several
            or group.observers is not group.unwatched
            or group.labels.open
            or profiler_enabled()
        ):
            _begin_spans(groups, "post_backward")
        try:
            ctx = self.root
            if ctx is None:
                ctx = self.ensure_initialized()
            phase = self.phase
            if phase is not Phase.POST_BACKWARD and Phase.POST_BACKWARD not in _PHASES[phase]:
                self._set_phase(Phase.POST_BACKWARD, "post-backward (the group's backward is done)")
            self.phase = Phase.POST_BACKWARD
            if group.config.requires_gradient_sync:
                # At most one state's reduce-scatters in flight: their buffers are full-size
                # grads.
                for reducing in ctx.it.reducing:
                    if reducing not in groups:
                        reducing.finish_reduce()
                if (
                    self.several
                    or group.observers is not group.unwatched
                    or group.labels.open
                    or profiler_enabled()
                ):
                    self._reduce_grads()  # inside its spans
                else:
                    group.reduce_grads()  # no span to open: _reduce_grads' one call
                if self.several:
                    ctx.it.reducing = tuple(g for g in groups if g.has_pending_reduce())
                else:
                    ctx.it.reducing = groups if group.has_pending_reduce() else ()
                self.unfinalized = False
            else:
                for g in groups:
                    g.reduce_grads()
            for g in groups:
                if g.config.reshard_after_backward:
                    g.reshard()
            for g in reversed(groups):
                if g.observers is not g.unwatched or g.labels.open:
                    g.end("backward")
        finally:
            if self.several or group.observers is not group.unwatched or group.labels.open:
                _end_spans(groups, "post_backward")

    def _reduce_grads(self) -> None:
        """Every group's reduction, inside its ``post_backward_reduce`` span."""
        groups = self.groups
        group = groups[0]
        if (
            self.several
            or group.observers is not group.unwatched
            or group.labels.open
            or profiler_enabled()
        ):
            _begin_spans(groups, "post_backward_reduce")
        try:
            for g in groups:
                g.reduce_grads()
        finally:
            if self.several or group.observers is not group.unwatched or group.labels.open:
                _end_spans(groups, "post_backward_reduce")

    def _end_of_backward(self) -> None:
        """Root only: runs once after autograd finished the whole backward pass.

        Under manual finalization it finishes nothing: a group whose backward did not end
        (its inputs need no gradient, or a later backward call continues it) stays gathered
        with its gradients on the unsharded parameters, reductions stay in flight, and
        :meth:`finalize_backward` does the rest once per step.
        """
        ctx = self.ensure_initialized()
        if ctx.manual_finalization:
            self.end_iteration(keep_reducing=True)
            return
        with _spans(self.groups, "root_post_backward_callback"):
            for state in reversed(ctx.states):
                if state.phase is Phase.PRE_BACKWARD or (
                    state.it.ran_forward and state.phase is not Phase.POST_BACKWARD
                ):
                    state._post_backward()
            self._finish_reductions(ctx, wait=ctx.is_last_backward)

    def _finish_reductions(self, ctx: RootContext, *, wait: bool) -> None:
        """Wait for the reductions in flight (``wait``), reshard, start the next iteration."""
        if ctx.buckets is not None:
            ctx.buckets.flush()  # buckets whose last group's backward did not come
        if ctx.kept_whole:  # every kept-whole gradient of the model: one all-reduce per step
            all_reduce_kept_whole([g for state in ctx.states for g in state.groups])
        if wait:
            for state in ctx.states:
                for group in state.groups:
                    group.finish_reduce()
            ctx.it.reducing = ()
        for state in ctx.states:
            for group in state.groups:
                if group.config.reshard_after_backward:
                    group.reshard()
        self.end_iteration(keep_reducing=not wait)

    # -- manual backward finalization (torch 2.15) ---------------------------------------------

    def finalize_backward(self, *, async_op: bool) -> Callable[[], None] | None:
        """What the end of a backward does, for every group a backward left unfinished since
        the last call, with the options of now: reduce (if gradient sync is on) the
        gradients kept or left on the unsharded parameters, reshard (if resharding after
        backward), then wait for the reductions. ``async_op``: return the wait instead of
        running it (the next root forward runs it if nobody did).
        """
        ctx = self.ensure_initialized()
        if not ctx.manual_finalization:
            raise FullyShardStateError(
                "finalize_backward() needs manual backward finalization: call "
                "set_manual_backward_finalization(True) before the forward (the end of each "
                "backward already finalizes otherwise)"
            )
        if ctx.it.in_backward or ctx.it.forward_running:
            raise FullyShardStateError(
                "finalize_backward() was called during a forward or backward; call it after "
                "the step's last backward has returned"
            )
        if ctx.pending_finalization is not None:
            ctx.pending_finalization()  # an earlier asynchronous one, not waited for
        root = next(s for s in ctx.states if s.is_root)
        with _spans(root.groups, "root_post_backward_callback"):
            for state in reversed(ctx.states):
                if state.unfinalized:
                    state._post_backward()
            if not async_op:
                root._finish_reductions(ctx, wait=True)
                return None

        def wait() -> None:
            if ctx.pending_finalization is wait:
                ctx.pending_finalization = None
                root._finish_reductions(ctx, wait=True)

        ctx.pending_finalization = wait
        return wait

    # -- reductions on request (pipelining) ----------------------------------------------------

    def reduce_on_request(self) -> None:
        """Reduce the gradients this state's groups kept since their last reduction, now.

        For callers that run backward passes with gradient sync off and reduce once at the end
        (torch's pipelining, after its last microbatch): the post-backward of a backward that
        has already finished, with the options of now. A no-op for a group with nothing kept.
        """
        ctx = self.ensure_initialized()
        if ctx.it.in_backward:
            raise FullyShardStateError(
                "a reduction was requested during backward; request it once the backward "
                "passes (all microbatches) are done"
            )
        self._post_backward()

    def finish_on_request(self) -> None:
        """After :meth:`reduce_on_request` on every state: wait for the reductions (if this is
        the last backward), reshard, and start the next iteration, as the end of a backward."""
        ctx = self.ensure_initialized()
        root = next(s for s in ctx.states if s.is_root)
        root._finish_reductions(ctx, wait=ctx.is_last_backward)

    # -- the end of an iteration ---------------------------------------------------------------

    def end_iteration(self, *, keep_reducing: bool = False) -> None:
        """Every state of this root starts the next iteration afresh (phase idle, no flag).

        ``keep_reducing``: a reduce-scatter left in flight on purpose (``is_last_backward``
        False) stays the one the next backward finishes first.
        """
        ctx = self.root
        states = ctx.states if ctx is not None else [self]
        for state in states:
            state.phase = Phase.IDLE
            state.it = _Iteration()
        if ctx is not None:
            reducing = ctx.it.reducing if keep_reducing else ()
            ctx.it = _RootIteration(reducing=reducing)

    def reset(self) -> None:
        """Forget a failed iteration: nothing stays gathered, no flag stays armed."""
        ctx = self.root
        states = ctx.states if ctx is not None else [self]
        for state in states:
            for group in state.groups:
                group.discard_iteration_state()
        if ctx is not None and ctx.buckets is not None:
            ctx.buckets.discard()
        if ctx is not None and not ctx.order_recorded:
            # A first forward that raised half-way recorded part of the order, and the ranks
            # may have raised at different places: record it again, whole, next time.
            ctx.forward_order, ctx.post_forward_order = [], []
        self.end_iteration()
