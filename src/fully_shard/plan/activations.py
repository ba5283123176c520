"""Measure a model's activations: one forward and backward on a meta-device replica.

The planner needs, for every block, how many bytes its forward keeps for backward, how high
its forward and backward go above that while they run, and how many gradient bytes each
group's backward produces, in time order. It gets them by running the step itself on a
replica of the model whose parameters, buffers and inputs are ``meta`` tensors (shapes and
dtypes, no storage), under a dispatch mode that sees every tensor an op creates and a weak
reference that sees it die. Nothing real is allocated, so a model of any size measures here.

The run yields a :class:`Trace`: a list of marks (``fwd_start``, ``fwd_end``, ``bwd_start``,
``bwd_end`` per group, where the engine's hooks would fire) and spans between them (the net
change of live activation bytes, the highest point above the start, the gradient bytes each
group gained). Two traces are taken, one plain and one with every block under activation
checkpointing; the simulator takes each block's spans from the trace of its own choice, so
any mix of checkpointed blocks is composed without another run.

What counts as an activation: every storage an op creates during forward and backward that
is not a parameter's gradient (those are counted per group, for the simulator to free at
the group's post-backward), i.e. saved tensors, outputs, backward temporaries. Parameters,
buffers and the inputs are not: the simulator counts them itself.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# The private torch APIs the planner uses (a dispatch mode, fake tensors, torch's FLOP table)
# live in _compat with the others, with why and where they were run.
from .._compat import FakeTensorMode, TorchDispatchMode, flop_registry, set_grad_dtype

MarkKind = str  # "fwd_start" | "fwd_end" | "bwd_start" | "bwd_end" | "backward_end"


@dataclass(frozen=True)
class Mark:
    """A point where the engine's hooks act: ``kind`` of group ``group`` (0: the root)."""

    kind: MarkKind
    group: int


@dataclass(frozen=True)
class Span:
    """What happened between two marks.

    Attributes:
        owner: the group whose compute this is (a block's forward or backward; 0 otherwise).
        delta: net change of live activation bytes.
        peak: highest (activation + gradient) bytes above the span's start.
        grads: gradient bytes each group gained, ``((group, bytes), ...)``.
        flops: FLOPs the span's ops perform (torch's formulas; ops without one count 0).
        input_frees: bytes of blocks' forward inputs that died in the span,
            ``((block, bytes), ...)`` (each input counted for the first block it entered).
            When those bytes die depends on the block's own choice, not on the span's owner:
            a checkpointed block keeps its inputs until its backward recomputes from them,
            whether or not they need a gradient; a plain one only as long as something
            saves them.
        kept_peak: ``peak`` as if none of ``input_frees`` had died in the span.
    """

    owner: int
    delta: int
    peak: int
    grads: tuple[tuple[int, int], ...]
    flops: int
    input_frees: tuple[tuple[int, int], ...] = ()
    kept_peak: int = 0


Item = Mark | Span


@dataclass(frozen=True)
class Trace:
    """One forward and backward of the replica, as marks and spans in time order.

    Attributes:
        items: the marks and spans.
        outputs_need_grad: per group, whether its forward output needed a gradient (else the
            engine reshards it after forward and never gathers it in backward).
        inputs_need_grad: per group, whether any of its forward inputs needed one (else its
            post-backward waits for the end of the backward pass).
        params_with_grad: indices (into the planner's parameter list) that received one.
        input_bytes: bytes of the example inputs, and of any tensor from outside the replica
            that an op reached (the targets a loss function closes over, a tensor a module
            keeps as a plain attribute), at its own size: what a training loop holds through
            its step.
    """

    items: tuple[Item, ...]
    outputs_need_grad: tuple[bool, ...]
    inputs_need_grad: tuple[bool, ...]
    params_with_grad: frozenset[int]
    input_bytes: int


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
    elif hasattr(obj, "to_tuple"):  # a Hugging Face ModelOutput
        yield from _tensors(obj.to_tuple())


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


class _Boundary(torch.autograd.Function):
    """Identity on a block's inputs whose backward says the block's backward is over.

    The engine's ``_AfterModuleBackward`` does the same, so the mark lands where its
    post-backward runs.
    """

    @staticmethod
    def forward(ctx: Any, done: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.done = done
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.done()
        return (None, *grads)


@dataclass
class _Recorder:
    """Live bytes by kind, and the span being built."""

    group_of_param: dict[int, tuple[int, int]]  # id(param) -> (group, index)
    live_act: int = 0
    live_grad: int = 0
    static: set[int] = field(default_factory=set)  # storage ids never counted
    # storage id -> [weakref, bytes, "act" | "grad"]
    tracked: dict[int, list[Any]] = field(default_factory=dict)
    items: list[Item] = field(default_factory=list)
    owner: int = 0
    act_start: int = 0
    level_start: int = 0  # act + grad at the span's start
    peak: int = 0
    flops: int = 0
    grads: dict[int, int] = field(default_factory=dict)
    with_grad: set[int] = field(default_factory=set)
    input_of: dict[int, int] = field(default_factory=dict)  # storage id -> first block it entered
    input_frees: dict[int, int] = field(default_factory=dict)  # block -> bytes died in the span
    kept_peak: int = 0
    captured: dict[int, int] = field(default_factory=dict)  # storage id -> bytes reached

    def level(self) -> int:
        return self.live_act + self.live_grad

    def close_span(self) -> None:
        delta = self.live_act - self.act_start
        # Always a span, empty or not: traces of one model align item by item.
        grads = tuple(sorted(self.grads.items()))
        frees = tuple(sorted(self.input_frees.items()))
        kept = max(self.peak, self.kept_peak)
        self.items.append(Span(self.owner, delta, self.peak, grads, self.flops, frees, kept))
        self.act_start, self.level_start = self.live_act, self.level()
        self.peak, self.flops, self.grads = 0, 0, {}
        self.input_frees, self.kept_peak = {}, 0

    def mark(self, kind: MarkKind, group: int, owner: int) -> None:
        self.close_span()
        self.items.append(Mark(kind, group))
        self.owner = owner

    def sample(self) -> None:
        above = self.level() - self.level_start
        self.peak = max(self.peak, above)
        self.kept_peak = max(self.kept_peak, above + sum(self.input_frees.values()))

    def reached(self, t: torch.Tensor) -> None:
        """``t`` goes into an op: one no op made and the planner did not place (a real tensor
        the loss function closes over, such as its targets) is held through the step."""
        key = id(t.untyped_storage())
        if key not in self.static and key not in self.tracked:
            self.captured[key] = max(self.captured.get(key, 0), t.numel() * t.element_size())

    def entered(self, block: int, t: torch.Tensor) -> None:
        """``t`` is a forward input of ``block``: note its storage, if an op made it."""
        key = id(t.untyped_storage())
        if key in self.tracked and self.tracked[key][2] == "act":
            self.input_of.setdefault(key, block)

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self.static or key in self.tracked:
            return
        nbytes = st.nbytes()
        self.tracked[key] = [weakref.ref(st, functools.partial(self._died, key)), nbytes, "act"]
        self.live_act += nbytes

    def _died(self, key: int, _ref: object) -> None:
        entry = self.tracked.pop(key, None)
        if entry is None:
            return
        if entry[2] == "grad":
            self.live_grad -= entry[1]
        else:
            self.live_act -= entry[1]
        block = self.input_of.pop(key, None)
        if block is not None:
            self.input_frees[block] = self.input_frees.get(block, 0) + entry[1]

    def grad_arrived(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            return
        group, index = self.group_of_param[id(p)]
        self.with_grad.add(index)
        self.track(grad)
        entry = self.tracked.get(id(grad.untyped_storage()))
        if entry is not None and entry[2] == "act":
            entry[2] = "grad"
            self.live_act -= entry[1]
            self.live_grad += entry[1]
            self.grads[group] = self.grads.get(group, 0) + entry[1]


class _Watch(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Tracks every storage an op returns; samples the live bytes after each op."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        self.rec = rec

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for t in _tensors((args, kwargs)):
            self.rec.reached(t)
        out = func(*args, **(kwargs or {}))
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            self.rec.flops += int(counter(*args, **(kwargs or {}), out_val=out))
        for t in _tensors(out):
            self.rec.track(t)
        self.rec.sample()
        return out


def fake_mode() -> FakeTensorMode:
    """The mode the replica's tensors live in (no storage; the device is kept)."""
    # Real tensors a loss function closes over (targets) are taken in as fakes.
    return FakeTensorMode(allow_non_fake_inputs=True)


DEVICE = "cpu"  # the fake device: its kernels decide what autograd saves


def fake_replica(
    model: nn.Module,
    dtype_of: Callable[[torch.dtype], torch.dtype],
    mode: FakeTensorMode,
    grad_dtype_of: Callable[[torch.dtype], torch.dtype] | None = None,
) -> tuple[nn.Module, dict[int, nn.Parameter]]:
    """A deep copy of ``model`` whose parameters and buffers are fake tensors of ``mode``.

    Parameters get the dtype ``dtype_of`` gives for theirs (the compute dtype), and their
    gradients the one ``grad_dtype_of`` gives (the reduce dtype: the engine's unsharded
    gradients are made in it), buffers keep theirs; ``requires_grad`` and parameter sharing
    (tied weights) are kept. Returns the replica and ``{id(original): replica parameter}``.
    """
    memo: dict[int, Any] = {}
    mapping: dict[int, nn.Parameter] = {}
    with mode:
        for p in model.parameters():
            q = nn.Parameter(
                torch.empty(p.shape, dtype=dtype_of(p.dtype), device=DEVICE),
                requires_grad=p.requires_grad,
            )
            if grad_dtype_of is not None and grad_dtype_of(p.dtype) != q.dtype:
                set_grad_dtype(q, grad_dtype_of(p.dtype))
            memo[id(p)] = q
            mapping[id(p)] = q
        for b in model.buffers():
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=DEVICE)
    replica = copy.deepcopy(model, memo)
    return replica, mapping


def to_fake(obj: Any, mode: FakeTensorMode) -> Any:
    """Every tensor in ``obj`` (args, kwargs) as an empty fake tensor of its shape and dtype."""

    def conv(t: torch.Tensor) -> torch.Tensor:
        with mode:
            m = torch.empty(t.shape, dtype=t.dtype, device=DEVICE)
        return m.requires_grad_(t.requires_grad) if t.is_floating_point() else m

    return _map(obj, conv)


def run_trace(
    replica: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    mode: FakeTensorMode,
    input_dtype: torch.dtype | None,
    blocks: Sequence[nn.Module],
    params: Sequence[nn.Parameter],
    owner_of_param: Sequence[int],
    checkpointed: bool,
) -> Trace:
    """One forward (``loss_fn`` on the output) and backward of ``replica`` on meta tensors.

    ``blocks`` are the replica's blocks (groups 1..N; the root is group 0), ``params`` the
    replica's parameters with ``owner_of_param`` their group. ``checkpointed`` runs every
    block under non-reentrant activation checkpointing, as :class:`CheckpointedBlock` does.
    ``input_dtype``: every group casts its floating-point inputs to it before its forward
    (``MixedPrecisionPolicy.cast_forward_inputs``), as the engine's pre-forward hook does.
    """
    group_of_param = {id(p): (owner_of_param[i], i) for i, p in enumerate(params)}
    rec = _Recorder(group_of_param)
    for p in params:
        # Gradients left by an earlier trace of the replica: every step starts without
        # (``zero_grad(set_to_none=True)``), and they are no tensor of this trace.
        p.grad = None
    n = len(blocks) + 1
    outputs_need_grad = [False] * n
    inputs_need_grad = [False] * n
    started_bwd = [False] * n
    handles: list[Any] = []
    patched: list[nn.Module] = []

    for t in [*params, *replica.buffers(), *_tensors((args, kwargs))]:
        rec.static.add(id(t.untyped_storage()))
    input_bytes = sum(t.untyped_storage().nbytes() for t in _tensors((args, kwargs)))

    def on_bwd_start(g: int, _grad: torch.Tensor) -> None:
        if not started_bwd[g]:
            started_bwd[g] = True
            rec.mark("bwd_start", g, g)

    def pre(g: int, module: nn.Module, a: Any, kw: Any) -> Any:
        rec.mark("fwd_start", g, g)
        if input_dtype is not None:
            dtype = input_dtype
            a, kw = _map((a, kw), lambda t: t.to(dtype) if t.is_floating_point() else t)
        needing = [t for t in _tensors((a, kw)) if t.requires_grad]
        inputs_need_grad[g] = bool(needing) or inputs_need_grad[g]
        if g:
            for t in _tensors((a, kw)):
                rec.entered(g, t)
        if not needing or not torch.is_grad_enabled():
            return (a, kw)
        passed = _Boundary.apply(lambda: rec.mark("bwd_end", g, 0), *needing)  # type: ignore[no-untyped-call]  # torch leaves it untyped
        swap = {id(t): o for t, o in zip(needing, passed, strict=True)}
        return _map((a, kw), lambda t: swap.get(id(t), t))

    def post(g: int, module: nn.Module, a: Any, kw: Any, out: Any) -> None:
        rec.mark("fwd_end", g, 0)
        for t in _tensors(out):
            if t.requires_grad:
                outputs_need_grad[g] = True
                t.register_hook(functools.partial(on_bwd_start, g))  # type: ignore[no-untyped-call]  # torch leaves it untyped

    try:
        for g, module in enumerate([replica, *blocks]):
            handles.append(
                module.register_forward_pre_hook(functools.partial(pre, g), with_kwargs=True)
            )
            handles.append(
                module.register_forward_hook(functools.partial(post, g), with_kwargs=True)
            )
        if checkpointed:
            for block in blocks:
                inner = block.forward

                def run(*a: Any, _inner: Callable[..., Any] = inner, **kw: Any) -> Any:
                    # preserve_rng_state: meta tensors have no RNG to stash; the memory
                    # of a stashed CPU RNG state (a few KiB) is left out.
                    return checkpoint(
                        _inner, *a, use_reentrant=False, preserve_rng_state=False, **kw
                    )

                block.forward = run
                patched.append(block)
        for p in params:
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(rec.grad_arrived))  # type: ignore[no-untyped-call]  # torch leaves it untyped
        with mode, _Watch(rec):
            loss = loss_fn(replica(*args, **kwargs))
            rec.mark("loss", 0, 0)
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            del loss
            rec.mark("backward_end", 0, 0)
        rec.close_span()
    finally:
        for h in handles:
            h.remove()
        for block in patched:
            del block.forward
    return Trace(
        tuple(rec.items),
        tuple(outputs_need_grad),
        tuple(inputs_need_grad),
        frozenset(rec.with_grad),
        input_bytes + sum(rec.captured.values()),
    )
