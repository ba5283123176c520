"""Replay one training step of the engine, byte by byte, for one rank and one configuration.

The engine's memory follows from a few rules (``hooks.py``, ``group.py``, ``param.py``),
which :func:`simulate` walks through in the order a step meets them, on a ledger of live bytes
per category. The activations between the engine's hook points come from a measured
:class:`~fully_shard.plan.activations.Trace`; everything else is counted here:

==========================  ============================================================
sharded parameters          ``local_rows * rest`` per parameter (``ShardLayout``), always
gather buffer               ``W * sum(padded shard)`` in the all-gather dtype, from the
                            group's unshard (or prefetch) to its copy-out
unsharded parameters        ``W * chunk * rest`` per parameter (the padded storage) in the
                            compute dtype, from copy-out to reshard
post-forward piece          ``reshard_after_forward=n``: this rank's ``torch.chunk`` rows over n,
                            from the end of forward to the backward gather's copy-out
unsharded gradients         measured in the trace, from the group's backward to its
                            post-backward (packed, then freed)
reduce-scatter buffers      ``W * total`` in + ``total`` out (reduce dtype), from the
                            post-backward until the next group's post-backward finishes it
sharded gradients           the ``total`` output itself (``.grad`` views it when the reduce
                            dtype is the parameter dtype) or a copy, until ``zero_grad``
optimizer state             per trainable parameter, from the first step on
optimizer temporaries       AdamW's ``sqrt`` and divide on a shard, and the previous
                            shard's result (one parameter at a time, in order); with the
                            foreach kernels (accelerator) a ``sqrt`` of every shard at once
kept-whole parameters       ``param_persistence_threshold`` (``ParamInfo.kept``): the whole
                            tensor on every rank, with its optimizer state, and (mixed
                            precision) its compute-dtype copy, made at the first unshard
                            and kept; never gathered. Its gradient (measured, reduce dtype)
                            is the pending sum from its group's post-backward to the end
                            of backward, where one flat buffer of all of them is
                            all-reduced (before the reduce-scatters in flight finish); the
                            ``.grad`` views the buffer in the parameter's dtype, else is a
                            copy out of it
==========================  ============================================================

With ``set_bucket_cap_mb`` (``Choice.bucket_cap_mb``), runs of groups share collectives
(:mod:`fully_shard.plan.buckets` cuts them as the engine does), and two lifetimes change:

==========================  ============================================================
bucket gather buffer        ``W * sum(padded shard)`` of every member gathered with the
                            first one that unshards (the run's later groups still to run
                            in this pass): one buffer, issued by that group's unshard (or
                            prefetch), until the last of them has copied out its columns
bucket reduction            each member's unsharded gradients parked from its
                            post-backward until the run's last member's; then one
                            ``W * total`` input (every member's packed gradients) and
                            ``total`` output, finished by the next post-backward; what
                            the end of backward finds parked goes out then
==========================  ============================================================

One shard rank (W=1) is the engine's fast path: a plain parameter in its own dtype on the
device uses its shard's storage (no gather buffer, no unsharded storage), and the
reduce-scatter's input buffer is its result (no ``total`` output).

Prefetching is the engine's implicit one: a group starting its forward issues the next
group's gather (before waiting for its own when nobody prefetched it, as the root at every
step); a group starting its backward, the group whose forward ended before its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..layout import split_rows
from .activations import Mark, Span, Trace
from .buckets import bucket_runs

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer",
    "gathered",
    "reduce buffers",
    "activations",
    "unsharded gradients",
    "inputs and buffers",
)


@dataclass(frozen=True)
class ParamInfo:
    """One parameter as the planner sees it (no tensor)."""

    shape: tuple[int, ...]
    orig_itemsize: int
    compute_itemsize: int
    reduce_itemsize: int
    wire_bytes_per_row: int | None  # int8 gathers: bytes per padded shard (None: plain)
    trainable: bool
    group: int
    # The dtypes' names: two groups share a bucket only where these agree (bucket keys).
    compute_dtype: str = ""
    reduce_dtype: str = ""
    # Kept whole on every rank (param_persistence_threshold): never gathered or
    # reduce-scattered; its gradient waits for the end of backward's all-reduce.
    kept: bool = False

    def rows_rest(self) -> tuple[int, int]:
        if not self.shape:
            return 1, 1
        return self.shape[0], math.prod(self.shape[1:])


@dataclass(frozen=True)
class Model:
    """What the simulator needs of a model: parameters by group, measured traces."""

    params: tuple[ParamInfo, ...]
    n_groups: int  # root + blocks
    plain: Trace
    checkpointed: Trace | None
    buffer_bytes: int
    # optimizer state bytes of one parameter from its local shard's (numel, itemsize)
    optimizer_state: Callable[[int, int], int]
    adam_temporaries: bool


@dataclass(frozen=True)
class Choice:
    """One configuration: per group (0: the root) its ``reshard_after_forward`` and
    checkpointing, whether sharded state is offloaded to the host, and the root's
    ``set_bucket_cap_mb`` (``None``: no buckets)."""

    reshard: tuple[bool | int, ...]
    checkpoint: tuple[bool, ...]
    offload: bool
    bucket_cap_mb: float | None = None


@dataclass(frozen=True)
class Outcome:
    """The result of one replay.

    Attributes:
        peak: device bytes at the highest point.
        host_peak: host bytes at their highest point with offload (0 without).
        where: the phase and group of the device peak.
        breakdown: bytes per category at the device peak, in ``CATEGORIES`` order.
    """

    peak: int
    host_peak: int
    where: str
    breakdown: tuple[int, ...]


@dataclass
class _Ledger:
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    peak: int = -1
    where: str = ""
    breakdown: tuple[int, ...] = ()
    phase: str = ""
    host: int = 0
    host_peak: int = 0

    def total(self) -> int:
        return sum(self.bytes.values())

    def check(self, extra: int = 0, extra_kind: str = "activations") -> None:
        total = self.total() + extra
        if total > self.peak:
            self.peak, self.where = total, self.phase
            snap = dict(self.bytes)
            snap[extra_kind] += extra
            self.breakdown = tuple(snap[c] for c in CATEGORIES)

    def add(self, kind: str, n: int) -> None:
        self.bytes[kind] += n
        if n > 0:
            self.check()

    def add_host(self, n: int) -> None:
        self.host += n
        self.host_peak = max(self.host_peak, self.host)


def adam_temporaries(shards: Sequence[tuple[int, int]], foreach: bool) -> int:
    """Peak bytes of ``torch.optim.AdamW``'s temporaries in its step.

    ``shards``: ``(dtype key, local bytes)`` of each parameter with a gradient, in order. The
    per-parameter loop (torch's default on CPU) makes a ``sqrt`` and a division the size of
    each shard while the previous parameter's result is still bound; the foreach kernels
    (its default on CUDA) make one ``sqrt`` per shard of a dtype at once, the previous
    dtype's list still bound.

    Example:
        >>> adam_temporaries([(4, 100), (4, 300), (4, 50)], foreach=False)
        700
        >>> adam_temporaries([(4, 100), (4, 300), (4, 50)], foreach=True)
        450
    """
    if foreach:
        by_dtype: dict[int, int] = {}
        for key, n in shards:
            by_dtype[key] = by_dtype.get(key, 0) + n
        sizes, factor = list(by_dtype.values()), 1
    else:
        sizes, factor = [n for _, n in shards], 2
    pairs = zip([0, *sizes], sizes, strict=False)
    return max((prev + factor * n for prev, n in pairs), default=0)


def _layout(p: ParamInfo, world: int, rank: int) -> tuple[int, int, int]:
    """(chunk, local_rows, rest) of ``p`` split over ``world`` ranks (``ShardLayout``); a
    kept-whole parameter holds every row on every rank."""
    d0, rest = p.rows_rest()
    if p.kept:
        return d0, d0, rest
    split = split_rows(d0, world, rank)
    return split.chunk, split.rows, rest


@dataclass
class _SharedGather:
    """A bucket's all-gather output: one buffer for its members, alive until the last of them
    has copied out (each member's part is a view of it)."""

    nbytes: int
    waiting: set[int]


@dataclass
class _Group:
    params: list[int]
    state: str = "sharded"  # sharded | unsharding | unsharded
    phase: str = "idle"  # idle | forward | pre_backward | post_backward
    ran_forward: bool = False
    gather: int = 0  # gather buffer bytes in flight
    piece: int = 0  # post-forward piece bytes
    pieces: int = 0  # n while this rank holds post-forward pieces of an n-rank split, else 0
    unsharded: int = 0
    shared: _SharedGather | None = None  # the bucket gather it waits for, if any


def simulate(
    model: Model,
    choice: Choice,
    world: int,
    rank: int,
    labels: Sequence[str],
    device_is_host: bool,
) -> Outcome:
    """Replay one step (after the first) on rank ``rank`` of ``world``; see the module doc."""
    params = model.params
    ng = model.n_groups
    lay = [_layout(p, world, rank) for p in params]
    offload = choice.offload and not device_is_host
    with_grad = model.plain.params_with_grad
    led = _Ledger()
    groups = [_Group([i for i, p in enumerate(params) if p.group == g]) for g in range(ng)]
    runs = bucket_runs(params, model.plain, choice, world, offload)
    parked: dict[tuple[int, ...], dict[int, list[int]]] = {}  # reduce run -> member -> packed
    in_backward = [False]  # the engine's ctx.it.in_backward: from the first pre-backward on

    def local_bytes(i: int) -> int:
        _, local, rest = lay[i]
        return local * rest * params[i].orig_itemsize

    def padded(i: int) -> int:
        chunk, _, rest = lay[i]
        return chunk * rest

    def whole(i: int) -> bool:
        # storage.WholeShard: one shard rank, plain, in its own dtype, on the device: forward
        # uses the shard's storage, nothing is gathered or held besides it. A kept-whole
        # parameter is never gathered either (its compute copy is counted once, up front).
        p = params[i]
        if p.kept:
            return True
        plain = p.wire_bytes_per_row is None
        return world == 1 and plain and p.compute_itemsize == p.orig_itemsize and not offload

    def unsharded_bytes(g: int) -> int:
        return sum(
            world * padded(i) * params[i].compute_itemsize for i in groups[g].params if not whole(i)
        )

    def gather_bytes(g: int) -> int:
        total = 0
        for i in groups[g].params:
            if whole(i):
                continue
            wire = params[i].wire_bytes_per_row
            total += padded(i) * params[i].compute_itemsize if wire is None else wire
        return world * total

    def piece_bytes(g: int, n: int) -> int:
        """This rank's post-forward pieces: ``torch.chunk`` rows over its group of n."""
        return sum(
            _layout(params[i], n, rank % n)[1] * lay[i][2] * params[i].compute_itemsize
            for i in groups[g].params
            if not params[i].kept
        )

    def piece_gather_bytes(g: int, n: int) -> int:
        """Backward's all-gather of the pieces within the n ranks: n padded pieces each."""
        return sum(
            n * _layout(params[i], n, 0)[0] * lay[i][2] * params[i].compute_itemsize
            for i in groups[g].params
            if not params[i].kept
        )

    # Persistent: shards, optimizer state, inputs and buffers. Kept-whole parameters stay on
    # the device under offload (persist.py: local lives on the compute device), with their
    # state, and their compute-dtype copy lives from the first step's unshard on.
    kept = [i for i, p in enumerate(params) if p.kept]
    shards = sum(local_bytes(i) for i in range(len(params)) if i not in kept)
    opt = sum(
        model.optimizer_state(lay[i][1] * lay[i][2], params[i].orig_itemsize)
        for i in with_grad
        if i not in kept
    )
    if offload:
        led.add_host(shards + opt)
    else:
        led.add("parameters", shards)
        led.add("optimizer", opt)
    kept_opt = sum(
        model.optimizer_state(lay[i][1] * lay[i][2], params[i].orig_itemsize)
        for i in with_grad
        if i in kept
    )
    casts = sum(
        padded(i) * params[i].compute_itemsize
        for i in kept
        if params[i].compute_itemsize != params[i].orig_itemsize
    )
    led.add("parameters", sum(local_bytes(i) for i in kept) + casts)
    led.add("optimizer", kept_opt)
    led.add("inputs and buffers", model.plain.input_bytes + model.buffer_bytes)

    # (g, in, out, aliased grad, copied grads, host grads): what each pending reduce holds
    reducing: list[tuple[int, int, int, int, int, int]] = []
    grads_live = [0] * ng
    pending: list[int] = []  # kept-whole parameters whose gradient awaits the all-reduce
    forward_order: list[int] = []
    post_forward_order: list[int] = []
    for item in model.plain.items:
        if isinstance(item, Mark) and item.kind == "fwd_start" and item.group not in forward_order:
            forward_order.append(item.group)
        if (
            isinstance(item, Mark)
            and item.kind == "fwd_end"
            and item.group not in post_forward_order
        ):
            post_forward_order.append(item.group)

    def reshard_flag(g: int) -> bool | int:
        return choice.reshard[g]

    def claim(g: int, backward: bool) -> bool:
        # The rules of the engine's prefetch (a group that still runs in this pass).
        grp = groups[g]
        ran = grp.ran_forward
        return grp.state == "sharded" and grp.phase == "idle" and (ran if backward else not ran)

    def unshard_bucket(g: int) -> bool:
        """Buckets.unshard: one all-gather for ``g`` and its run's later groups yet to run."""
        backward = in_backward[0]
        run = runs.of("backward" if backward else "forward", g)
        if run is None:
            return False
        members = [g] + [m for m in run[run.index(g) + 1 :] if claim(m, backward)]
        if len(members) == 1:
            return False
        shared = _SharedGather(sum(gather_bytes(m) for m in members), set(members))
        led.add("gathered", shared.nbytes)
        for m in members:
            groups[m].state, groups[m].shared = "unsharding", shared
        return True

    def unshard(g: int) -> None:
        grp = groups[g]
        if grp.state != "sharded" or not grp.params or unshard_bucket(g):
            return
        grp.gather = piece_gather_bytes(g, grp.pieces) if grp.pieces else gather_bytes(g)
        led.add("gathered", grp.gather)
        grp.state = "unsharding"

    def wait(g: int) -> None:
        grp = groups[g]
        if grp.state == "sharded" and not grp.params:
            grp.state = "unsharded"
        if grp.state != "unsharding":
            return
        grp.unsharded = unsharded_bytes(g)
        led.add("gathered", grp.unsharded)  # copy-out: buffer and storage both live
        led.add("gathered", -grp.gather - grp.piece)
        shared, grp.shared = grp.shared, None
        if shared is not None:
            shared.waiting.discard(g)
            if not shared.waiting:  # the last view of the bucket's buffer is gone
                led.add("gathered", -shared.nbytes)
        grp.gather, grp.piece, grp.pieces = 0, 0, 0
        grp.state = "unsharded"

    def reshard(g: int) -> None:
        grp = groups[g]
        if grp.state == "sharded":
            led.add("gathered", -grp.piece)
            grp.piece, grp.pieces = 0, 0
            return
        if grp.state == "unsharding":
            wait(g)
        led.add("gathered", -grp.unsharded)
        grp.unsharded = 0
        grp.state = "sharded"

    def unshard_now(g: int) -> None:
        unshard(g)
        wait(g)

    def prefetch(targets: list[int], backward: bool) -> None:
        for t in targets:
            grp = groups[t]
            if grp.state != "sharded" or not grp.params or grp.phase != "idle":
                continue
            if backward and not grp.ran_forward:
                continue
            if not backward and grp.ran_forward:
                continue
            unshard(t)

    def next_forward(g: int) -> list[int]:
        i = forward_order.index(g)
        return forward_order[i + 1 : i + 2]

    def next_backward(g: int) -> list[int]:
        i = post_forward_order.index(g)
        return post_forward_order[i - 1 : i] if i > 0 else []

    def finish_reduce(entry: tuple[int, int, int, int, int, int]) -> None:
        _, flat_in, out, aliased, copied, grad_host = entry
        # Cast or moved gradients are copied out of the result while both buffers live; the
        # buffers go, but for the result the aliasing .grad keeps (no new bytes: a move).
        led.add("gradients", copied)
        if offload:
            led.add_host(grad_host)
        led.add("reduce buffers", -flat_in - out)
        led.add("gradients", aliased)

    def send(members: Sequence[int], packed: list[int]) -> None:
        """Pack ``members``' gradients (``packed``: their parameters with one, in order) into
        one reduce-scatter: one group's, or a bucket's."""
        if not packed:
            return
        red = params[packed[0]].reduce_itemsize
        total = sum(padded(i) for i in packed)
        # One shard rank: no reduce-scatter, its input buffer is the result (group.py).
        flat_in, out = world * total * red, (0 if world == 1 else total * red)
        led.add("reduce buffers", flat_in)
        # Packing frees every unsharded gradient before the reduce-scatter output exists.
        for m in members:
            led.add("unsharded gradients", -grads_live[m])
            grads_live[m] = 0
        led.add("reduce buffers", out)
        # The sharded .grad is a view of the result when no cast or move is needed: it stays.
        result = flat_in if world == 1 else out
        alias = [i for i in packed if params[i].orig_itemsize == red and not offload]
        copies = [i for i in packed if i not in alias]
        copied = 0 if offload else sum(map(local_bytes, copies))
        grad_host = sum(map(local_bytes, packed)) if offload else 0
        reducing.append((members[-1], flat_in, out, result if alias else 0, copied, grad_host))

    def issue(run: tuple[int, ...]) -> None:
        """bucket._issue: one reduce-scatter for what the run's members parked, in run order."""
        kept = parked.pop(run, {})
        members = [m for m in run if m in kept]
        send(members, [i for m in members for i in kept[m]])

    def keep_grads(g: int) -> None:
        """group._keep_persistent_grads: the gradients become the pending sums (the same
        tensors: they are in the reduce dtype already), out of the group's packing."""
        mine = [i for i in groups[g].params if params[i].kept and i in with_grad]
        grads_live[g] -= sum(padded(i) * params[i].reduce_itemsize for i in mine)
        pending.extend(mine)

    def all_reduce_kept() -> None:
        """persist.all_reduce_kept_whole: one flat buffer of every pending sum, the sums
        alive until it returns; ``.grad`` views the buffer or is a copy out of it."""
        if not pending:
            return
        held = sum(padded(i) * params[i].reduce_itemsize for i in pending)
        led.add("reduce buffers", held)
        copies = [i for i in pending if params[i].orig_itemsize != params[i].reduce_itemsize]
        led.add("gradients", sum(map(local_bytes, copies)))
        led.add("unsharded gradients", -held)
        led.add("reduce buffers", -held)
        if len(copies) < len(pending):  # a view of the buffer keeps all of it
            led.add("gradients", held)
        pending.clear()

    def reduce_grads(g: int) -> None:
        keep_grads(g)
        packed = [i for i in groups[g].params if i in with_grad and not params[i].kept]
        run = runs.of("reduce", g)
        if run is None:
            send([g], packed)
            return
        # Buckets.park: the unsharded gradients wait until the run's last group is done.
        kept = parked.setdefault(run, {})
        kept[g] = packed
        if len(kept) == len(run):
            issue(run)

    def post_backward(g: int) -> None:
        grp = groups[g]
        grp.phase = "post_backward"
        led.phase = f"post-backward of {labels[g]}"
        while reducing:
            finish_reduce(reducing.pop(0))
        reduce_grads(g)
        reshard(g)

    def checkpointed(g: int) -> bool:
        return bool(g) and choice.checkpoint[g] and model.checkpointed is not None

    def span_of(item: Span, k: int) -> tuple[Span, int, int]:
        """The span's items from the trace of its owner's choice, and its (delta, peak) with
        each block's inputs dying as in the trace of that block's choice."""
        other = model.checkpointed.items[k] if model.checkpointed is not None else item
        if not isinstance(other, Span):
            return item, item.delta, item.peak
        own = checkpointed(item.owner)
        span, alt = (other, item) if own else (item, other)
        moved = dict(span.input_frees)  # block -> bytes this span frees that it should not
        for g, n in alt.input_frees:
            moved[g] = moved.get(g, 0) - n
        moved = {g: n for g, n in moved.items() if n and checkpointed(g) != own}
        delta = span.delta + sum(moved.values())
        # Frees taken back: the span's own peak, as if its inputs' frees had not happened (a
        # bound); frees added: the span's peak stands (a bound too).
        kept = any(n > 0 for n in moved.values())
        return span, delta, span.kept_peak if kept else span.peak

    for k, item in enumerate(model.plain.items):
        if isinstance(item, Span):
            span, delta, peak = span_of(item, k)
            led.check(peak)
            led.add("activations", delta)
            for g, n in span.grads:
                grads_live[g] += n
                led.add("unsharded gradients", n)
            continue
        g, kind = item.group, item.kind
        grp = groups[g]
        if kind == "fwd_start":
            led.phase = f"forward of {labels[g]}"
            grp.phase, grp.ran_forward = "forward", True
            if grp.state == "sharded":  # nobody prefetched it: the next gather goes out first
                unshard(g)
                prefetch(next_forward(g), backward=False)
                wait(g)
            else:
                unshard_now(g)
                prefetch(next_forward(g), backward=False)
        elif kind == "fwd_end":
            grp.phase = "idle"
            flag = reshard_flag(g)
            needs_grad = model.plain.outputs_need_grad[g]
            if flag is True or not needs_grad:
                reshard(g)
            elif isinstance(flag, int) and not isinstance(flag, bool) and grp.state == "unsharded":
                grp.piece, grp.pieces = piece_bytes(g, flag), flag
                led.add("gathered", grp.piece)
                led.add("gathered", -grp.unsharded)
                grp.unsharded, grp.state = 0, "sharded"
            led.phase = f"after forward of {labels[g]}"
        elif kind == "loss":
            led.phase = "loss"
        elif kind == "bwd_start":
            in_backward[0] = True
            if grp.phase != "pre_backward":
                led.phase = f"backward of {labels[g]}"
                grp.phase = "pre_backward"
                unshard_now(g)
                prefetch(next_backward(g), backward=True)
        elif kind == "bwd_end":
            if grp.phase == "pre_backward":
                post_backward(g)
        elif kind == "backward_end":
            led.phase = "end of backward"
            for s in reversed(range(ng)):
                st = groups[s]
                if st.phase == "pre_backward" or (st.ran_forward and st.phase != "post_backward"):
                    post_backward(s)
            for run in list(parked):  # Buckets.flush: runs whose last group did not come
                issue(run)
            all_reduce_kept()
            while reducing:
                finish_reduce(reducing.pop(0))
            for s in range(ng):
                reshard(s)
    # Optimizer step: shards, gradients and state are all there, and AdamW's temporaries.
    led.phase = "optimizer step"
    temp = 0
    if model.adam_temporaries:
        stepped = [(params[i].orig_itemsize, local_bytes(i)) for i in sorted(with_grad)]
        # torch's default: the foreach kernels where the parameters live on an accelerator
        temp = adam_temporaries(stepped, foreach=not device_is_host and not offload)
    if offload:
        led.add_host(temp)
        led.add_host(-temp)
    else:
        led.check(temp, "optimizer")
    return Outcome(led.peak, led.host_peak, led.where, led.breakdown)
