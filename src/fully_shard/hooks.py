"""Runtime: the hooks that decide *when* a group gathers, frees and reduces.

Per ``fully_shard`` call there is one :class:`FSDPState` (its group plus its place in the
iteration). Hooks, in the order one training step meets them:

1. forward pre-hook: the first one ever makes its module the root (lazy init: the root finds
   every state below it); then unshard the group.
2. forward post-hook: hook the outputs' gradients (pre-backward), reshard if the group reshards
   after forward (or if no backward can follow).
3. pre-backward (a hook on an output's gradient): unshard again; the first one in a backward
   queues the root's end-of-backward callback.
4. post-backward (a post-accumulate-grad hook on every trainable unsharded parameter): once all
   of the group's gradients are in, reduce-scatter them and reshard.
5. end of backward (root callback): finish groups whose post-backward never fired (unused
   parameters, frozen groups), wait for the last reduce-scatter, reset for the next step.

Activation checkpointing re-runs forwards inside backward; the hooks see ``in_backward`` and
only make sure the parameters are gathered.

Prefetch: the first iteration records the order in which groups start and finish their
forward. From then on a group that starts its forward issues the next group's all-gather
asynchronously (it runs while this group computes), and a group that starts its backward does
the same for the group whose forward finished just before its own (backward runs in reverse).
``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` replace the implicit
choice with explicit lists (an empty list turns prefetching off for that group). Every rank
records the same order, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._compat import inside_backward, queue_end_of_backward
from .errors import FullyShardStateError
from .group import GroupState, ParamGroup


class Phase(enum.Enum):
    """Where a group is in one training iteration."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


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
        return type(obj)(_map_tensors(x, fn) for x in obj)
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
    found: list[torch.Tensor] = []

    def visit(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    _map_tensors(obj, visit)
    return found


def _cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    return _map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() else t)


@dataclass
class RootContext:
    """Shared by all states under one root: the per-backward flags and the state list."""

    states: list[FSDPState] = field(default_factory=list)  # pre-order of the module tree
    in_backward: bool = False
    callback_queued: bool = False
    # The one group whose reduce-scatter may still be in flight (bounds gradient memory).
    reducing: ParamGroup | None = None
    # Recorded during the first forward, for implicit prefetching.
    forward_order: list[FSDPState] = field(default_factory=list)  # by forward start
    post_forward_order: list[FSDPState] = field(default_factory=list)  # by forward end
    order_recorded: bool = False
    forward_iter: int = 0  # root forwards started so far


def _assign_implicit_prefetch(ctx: RootContext) -> None:
    """After the first root forward: each group's next group in forward and in backward."""
    starts, ends = ctx.forward_order, ctx.post_forward_order
    for i, state in enumerate(starts):
        state._next_in_forward = starts[i + 1 : i + 2]
    for i, state in enumerate(ends):
        # backward runs in the reverse order of the forwards' ends
        state._next_in_backward = ends[i - 1 : i] if i > 0 else []


class FSDPState:
    """The runtime of one ``fully_shard`` call: its group, its phase, its hooks.

    Example:
        >>> state = model._fsdp_state  # doctest: +SKIP
        >>> state.is_root, state.phase  # doctest: +SKIP
        (True, <Phase.IDLE: 'idle'>)
    """

    def __init__(
        self,
        group: ParamGroup,
        modules: tuple[nn.Module, ...],
        original_params: dict[int, weakref.ref[nn.Parameter]],
    ) -> None:
        self.group = group
        self.modules = modules
        # The parameters as they were before sharding: a tie to one of them from outside this
        # group would silently untie, so later fully_shard calls refuse it. Keyed by id, held
        # weakly (a WeakSet would compare tensors with ==).
        self.original_params = original_params
        self.phase = Phase.IDLE
        self.root: RootContext | None = None
        self.is_root = False
        self.is_last_backward = True
        self._forward_depth = 0  # forwards of this group's modules in flight (nesting)
        self._modules_to_run: set[int] = set()  # modules of the group yet to run this forward
        self._outputs_hooked = 0  # outputs given a pre-backward hook in this forward
        self._ran_forward = False  # since the last end of backward
        self._grads_ready = 0
        self._grads_expected = sum(1 for p in group.params if p.requires_grad)
        self._grad_hooks: list[RemovableHandle] = []
        self._module_hooks: list[RemovableHandle] = []
        # (id, version) of each sharded parameter when this group's forward began: an in-place
        # change before its backward (optimizer.step(), load_state_dict) would pair the forward's
        # activations with new parameter values, so the backward refuses it.
        self._forward_versions: list[tuple[int, int]] | None = None
        # Explicit prefetch targets (None: the recorded order decides).
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        self._prefetched = False  # gathered ahead of use by another group's hook
        # The implicit prefetch targets, read off the recorded order once it is complete.
        self._next_in_forward: list[FSDPState] = []
        self._next_in_backward: list[FSDPState] = []
        self._forward_iter = -1  # the root forward in which this group's forward last ran

    def __repr__(self) -> str:
        return f"FSDPState(root={self.is_root}, {self.phase.name}, {self.group!r})"

    # -- installation and lazy init ----------------------------------------------------------

    def install(self) -> None:
        """Register the forward hooks on every module of the group."""
        for module in self.modules:
            self._module_hooks.append(
                module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            )
            self._module_hooks.append(
                module.register_forward_hook(self.post_forward, with_kwargs=True)
            )

    @property
    def reshard_after_forward(self) -> bool:
        flag = self.group.config.reshard_after_forward
        return (not self.is_root) if flag is None else flag

    def lazy_init(self) -> None:
        """Make this state the root of every state below its modules (first forward/unshard)."""
        ctx = RootContext()
        seen: set[int] = set()
        for top in self.modules:
            for module in top.modules():
                state = getattr(module, "_fsdp_state", None)
                if isinstance(state, FSDPState) and id(state) not in seen:
                    seen.add(id(state))
                    ctx.states.append(state)
        if self not in ctx.states:
            ctx.states.insert(0, self)
        for state in ctx.states:
            state.root = ctx
            state.is_root = state is self
            state._next_in_forward, state._next_in_backward = [], []  # the new root records
            state._init_group()

    def _init_group(self) -> None:
        self.group.lazy_init()
        if self._grad_hooks:
            return
        for p in self.group.params:
            if p.requires_grad and p.unsharded_param is not None:
                # torch's stubs leave this hook API unannotated
                register = p.unsharded_param.register_post_accumulate_grad_hook
                self._grad_hooks.append(register(self._on_grad_ready))  # type: ignore[no-untyped-call]

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
                f"({self.group!r}); call reset_iter_state() on the root module to recover"
            )
        self.phase = new

    # -- forward -------------------------------------------------------------------------------

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ctx = self.ensure_initialized()
        if ctx.in_backward and not inside_backward():
            raise FullyShardStateError(
                f"forward of {type(module).__name__} came while the previous backward had not "
                "finished (it raised, e.g. a second backward through a freed graph); call "
                "reset_iter_state() on the root module before the next forward"
            )
        if ctx.in_backward:  # recomputation under activation checkpointing
            self.group.unshard(async_op=False)
            self.group.wait_for_unshard()
            return args, kwargs
        if self._forward_depth == 0 and not self._modules_to_run:
            # The group's forward starts with the first of its modules and ends when every
            # module has run (a list group is gathered once, not once per module).
            self._modules_to_run = {id(m) for m in self.modules}
            self._outputs_hooked = 0
            self._set_phase(Phase.FORWARD, f"forward of {type(module).__name__}")
            if self.group.recorder is not None:
                self.group.recorder.begin(self.group, "forward")
            self._ran_forward = True
            self._forward_versions = self.group.sharded_versions()
            if self.group.gathered_copy_is_stale(self._forward_versions):
                # Gathered before an optimizer step (explicit unshard, reshard_after_backward=
                # False): every rank stepped, so every rank gathers again.
                self.group.reshard()
            self._prefetched = False
            if self.is_root:
                ctx.forward_iter += 1
            self._forward_iter = ctx.forward_iter
            if not ctx.order_recorded and self not in ctx.forward_order:
                ctx.forward_order.append(self)
            self.group.unshard(async_op=False)  # a no-op if prefetched: already in flight
            self.group.wait_for_unshard()
            self._prefetch(self._forward_targets(), backward=False)
        self._forward_depth += 1
        input_dtype = self.group.config.mp_policy.forward_input_dtype()
        if input_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), input_dtype)
        return args, kwargs

    def post_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        ctx = self.root
        if ctx is None or ctx.in_backward:
            return output
        self._forward_depth -= 1
        self._modules_to_run.discard(id(module))
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._pre_backward)  # type: ignore[no-untyped-call]
                    self._outputs_hooked += 1
        if self._forward_depth == 0 and not self._modules_to_run:
            # Without an output that needs grad no backward will come to free the parameters.
            if self.reshard_after_forward or self._outputs_hooked == 0:
                self.group.reshard_after_forward(backward_follows=self._outputs_hooked > 0)
            self._set_phase(Phase.IDLE, f"end of forward of {type(module).__name__}")
            if not ctx.order_recorded and self not in ctx.post_forward_order:
                ctx.post_forward_order.append(self)
            if self.is_root:
                if not ctx.order_recorded:
                    _assign_implicit_prefetch(ctx)
                    ctx.order_recorded = True
                self._release_unused_prefetches(ctx)
            if self.group.recorder is not None:
                self.group.recorder.end(self.group, "forward")
        out_dtype = self.group.config.mp_policy.output_dtype
        if out_dtype is not None:
            output = _cast_floating(output, out_dtype)
        return output

    # -- backward ------------------------------------------------------------------------------

    def _ensure_end_of_backward_callback(self) -> RootContext:
        ctx = self.ensure_initialized()
        if not ctx.callback_queued:
            root = next(s for s in ctx.states if s.is_root)
            queue_end_of_backward(root._end_of_backward)
            ctx.callback_queued = True
            ctx.in_backward = True
        return ctx

    def _check_unchanged_since_forward(self) -> None:
        before = self._forward_versions
        if before is None:
            return
        for p, was, now in zip(
            self.group.params, before, self.group.sharded_versions(), strict=True
        ):
            if was != now:
                raise FullyShardStateError(
                    f"backward came for parameter {p.fqn!r}, which was changed in place "
                    "(optimizer.step(), load_state_dict(), ...) after its forward; the "
                    "gradient would mix old activations with new values. Step the optimizer "
                    "after backward; call reset_iter_state() on the root module to recover"
                )

    def _pre_backward(self, grad: torch.Tensor) -> None:
        self._ensure_end_of_backward_callback()
        if self.phase is not Phase.PRE_BACKWARD:
            self._check_unchanged_since_forward()
            self._set_phase(Phase.PRE_BACKWARD, "backward (gradient of an output)")
            self._prefetched = False
            if self.group.recorder is not None:
                self.group.recorder.begin(self.group, "backward")
            self.group.unshard(async_op=False)
            self.group.wait_for_unshard()
            self._prefetch(self._backward_targets(), backward=True)

    # -- prefetch ------------------------------------------------------------------------------

    def _forward_targets(self) -> list[FSDPState]:
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        return self._next_in_forward

    def _backward_targets(self) -> list[FSDPState]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        return self._next_in_backward

    def _prefetch(self, targets: list[FSDPState], *, backward: bool) -> None:
        """Issue the all-gathers of ``targets`` without waiting; their own hooks wait."""
        for target in targets:
            if target is self or target.group.state is not GroupState.SHARDED:
                continue
            # Only a group that will still run in this pass: in forward, one whose forward has
            # not run in this root forward; in backward, one that ran forward and has not
            # started its backward.
            if target.phase is not Phase.IDLE:
                continue
            if backward and not target._ran_forward:
                continue
            ctx = target.root
            if not backward and ctx is not None and target._forward_iter == ctx.forward_iter:
                continue
            target.group.unshard(async_op=True)
            target._prefetched = True

    def _release_unused_prefetches(self, ctx: RootContext) -> None:
        # A prefetched group whose forward did not run this time (control flow changed).
        for state in ctx.states:
            if state._prefetched and state._forward_iter != ctx.forward_iter:
                state.group.reshard()
                state._prefetched = False

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._ensure_end_of_backward_callback()
        self._grads_ready += 1
        if self._grads_ready == self._grads_expected:
            self._post_backward()

    def _post_backward(self) -> None:
        ctx = self.ensure_initialized()
        self._set_phase(Phase.POST_BACKWARD, "post-backward (all gradients of a group ready)")
        self._grads_ready = 0
        if self.group.config.requires_gradient_sync:
            # At most one group's reduce-scatter in flight: its buffers are full-size grads.
            if ctx.reducing is not None and ctx.reducing is not self.group:
                ctx.reducing.finish_reduce()
            self.group.reduce_grads()
            ctx.reducing = self.group if self.group.has_pending_reduce() else None
        else:
            self.group.reduce_grads()
        if self.group.config.reshard_after_backward:
            self.group.reshard()
        if self.group.recorder is not None:
            self.group.recorder.end(self.group, "backward")

    def _end_of_backward(self) -> None:
        """Root only: runs once after autograd finished the whole backward pass."""
        ctx = self.ensure_initialized()
        for state in reversed(ctx.states):
            if state.phase is Phase.PRE_BACKWARD or (
                state._ran_forward and state.phase is not Phase.POST_BACKWARD
            ):
                state._post_backward()
        if self.is_last_backward:
            for state in ctx.states:
                state.group.finish_reduce()
            ctx.reducing = None
        for state in ctx.states:
            if state.group.config.reshard_after_backward:
                state.group.reshard()
            state._set_phase(Phase.IDLE, "end of backward")
            state._prefetched = False
            state._ran_forward = False
            state._grads_ready = 0
            state._forward_versions = None
        ctx.in_backward = False
        ctx.callback_queued = False

    # -- recovery ------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget a failed iteration: nothing stays gathered, no flag stays armed."""
        states = self.root.states if self.root is not None else [self]
        for state in states:
            state.group.discard_iteration_state()
            state.phase = Phase.IDLE
            state._forward_depth = 0
            state._modules_to_run = set()
            state._ran_forward = False
            state._prefetched = False
            state._grads_ready = 0
            state._forward_versions = None
        if self.root is not None:
            self.root.in_backward = False
            self.root.callback_queued = False
            self.root.reducing = None
