"""Communication: the ``Comm`` interface, reductions, and byte accounting.

Every collective the engine issues goes through a ``Comm``: a three-method object whose
default, :class:`TorchComm`, calls ``torch.distributed``. Tests and benchmarks wrap it in a
:class:`CountingComm` to count bytes and check dtypes without patching ``torch.distributed``.
What the collectives move is one flat buffer per group, laid out by :mod:`fully_shard.packing`.

Gradient collectives take a :class:`Reduction`: the reduce op and the divide factors are
arguments of the call, so a backend can divide where it is cheapest and safest (NCCL's
``AVG`` / ``PREMUL_SUM``; gloo: a sum, then one division of this rank's chunk) instead of the
engine summing and dividing afterwards, which overflows fp16 at large worlds.
:func:`plan_reduction` chooses them as torch's FSDP2 does.

:class:`AllGather` and :class:`ReduceScatter` are the call protocols of a user's own
collectives (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``), the same
as torch's: ``allocate(size, *, dtype, device)`` for the buffers, ``__call__`` to issue.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist


class Waitable(Protocol):
    """What an async collective returns (a ``dist.Work``, or a wrapper around one)."""

    def wait(self) -> Any: ...


ReduceOpName = Literal["sum", "avg", "premul_sum"]


@dataclass(frozen=True)
class Reduction:
    """How a gradient collective reduces: divide before, reduce with ``op``, divide after.

    Attributes:
        op: ``"sum"``; ``"avg"`` (the sum divided by the group's size); or ``"premul_sum"``
            (every input multiplied by ``1 / factor`` as it is summed: NCCL's ``PREMUL_SUM``;
            a backend without it sums, then divides the result by ``factor``).
        factor: the divisor of ``"premul_sum"`` (``None`` for the other ops).
        pre_divide: divide the input by this before the collective (fp16: part of the
            division goes before the sum so that it cannot overflow).
        post_divide: divide the result by this once the collective is done.

    Example:
        >>> from fully_shard.collectives import Reduction
        >>> Reduction("avg").divisor(group_size=4)
        4.0
        >>> Reduction("sum", pre_divide=2.0, post_divide=2.0).divisor(group_size=4)
        4.0
    """

    op: ReduceOpName = "sum"
    factor: float | None = None
    pre_divide: float | None = None
    post_divide: float | None = None

    def __post_init__(self) -> None:
        if self.op not in ("sum", "avg", "premul_sum"):
            raise ValueError(f"Reduction.op must be 'sum', 'avg' or 'premul_sum', got {self.op!r}")
        if (self.op == "premul_sum") != (self.factor is not None):
            raise ValueError("Reduction.factor is set exactly when op is 'premul_sum'")

    def divisor(self, group_size: int) -> float:
        """What the whole reduction divides the sum by (all divisions together)."""
        total = 1.0
        for part in (self.pre_divide, self.post_divide, self.factor):
            if part is not None:
                total *= part
        return total * group_size if self.op == "avg" else total

    def torch_op(self) -> dist.ReduceOp:
        """The ``torch.distributed`` op (what a user's ``ReduceScatter`` is handed)."""
        if self.factor is not None:
            return dist.ReduceOp.PREMUL_SUM(1 / self.factor)
        # RedOpType values convert to ReduceOp wherever torch takes one.
        return dist.ReduceOp(dist.ReduceOp.AVG if self.op == "avg" else dist.ReduceOp.SUM)


SUM = Reduction()


@dataclass(frozen=True)
class ReducePlan:
    """The reductions of one group's gradients: reduce-scatter, HSDP all-reduce, last divide.

    ``post_divide`` is applied once the chain is done (after the user's all-reduce hook, which
    sees the reduced gradient before it, as in torch's FSDP2).

    Example:
        >>> import torch
        >>> from fully_shard.collectives import plan_reduction
        >>> plan_reduction(torch.float32, shard_size=4, replicate_size=1)
        ReducePlan(reduce_scatter=Reduction(op='avg', ...), ...)  # doctest: +SKIP
    """

    reduce_scatter: Reduction
    all_reduce: Reduction
    post_divide: float | None


def plan_reduction(
    reduce_dtype: torch.dtype,
    shard_size: int,
    replicate_size: int,
    *,
    factor: float | None = None,
    force_sum: bool = False,
    device_type: str = "cpu",
) -> ReducePlan:
    """Choose the ops and divide factors that average (or divide by ``factor``) gradients.

    The same choices as torch's FSDP2 (2.13), so that numbers match it bit for bit:

    - fp32 / bf16 and sums allowed: ``AVG`` on both collectives; with a custom ``factor``,
      ``AVG`` when it equals the shard size, else ``PREMUL_SUM(1 / factor)`` on the
      reduce-scatter and a plain sum on the all-reduce. No separate division.
    - fp16 (or float64), or ``force_sum`` (NCCL's zero-copy collectives need SUM; MTIA has
      nothing else): sums only; for fp16 the division is split into a power of two before
      the sum and the rest after, so neither the inputs nor the sum overflow; otherwise all
      of it after.

    ``factor`` defaults to the data-parallel size (shard size x replicate size).
    """
    sum_only = force_sum or device_type == "mtia"
    dp_size = shard_size * replicate_size
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    if not overflow_risk and not sum_only:
        if factor is None:
            # NCCL's AVG is wrong on one rank; nothing to divide there anyway.
            op: ReduceOpName = "sum" if dp_size == 1 else "avg"
            return ReducePlan(Reduction(op), Reduction(op), None)
        if factor == shard_size:
            return ReducePlan(Reduction("avg"), SUM, None)
        return ReducePlan(Reduction("premul_sum", factor=float(factor)), SUM, None)
    total = float(dp_size if factor is None else factor)
    if not overflow_risk:
        # Dividing after the sum touches W times fewer elements than dividing before.
        return ReducePlan(SUM, SUM, total)
    # The smallest power of two that no longer divides the factor or whose square reaches
    # it: about sqrt(factor) before the sum, the rest after.
    pre = 1.0
    while total % pre == 0 and pre * pre < total:
        pre *= 2
    return ReducePlan(Reduction("sum", pre_divide=pre), SUM, total / pre)


def divide_(tensor: torch.Tensor, divisor: float | None) -> None:
    """``tensor /= divisor`` in place, skipped when there is nothing to divide by."""
    if divisor is not None and divisor != 1:
        tensor.div_(divisor)


class Comm(Protocol):
    """The collectives the engine needs. Each returns a waitable work handle when ``async_op``.

    Example:
        >>> from fully_shard import CountingComm, TorchComm
        >>> comm = CountingComm(TorchComm())
        >>> model.set_comm(comm)  # doctest: +SKIP
    """

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
    ) -> Waitable | None:
        """Gather every rank's ``input`` into ``output`` (W times larger), rank by rank."""
        ...

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        reduction: Reduction,
        async_op: bool,
    ) -> Waitable | None:
        """Reduce ``input`` (W times larger) over ranks; rank r keeps the r-th chunk in ``output``.

        ``reduction`` says the op and the divisions; ``output`` holds the final values once
        the call (or the returned handle's ``wait()``) returns. ``input`` is the engine's own
        scratch buffer, dropped once the work is done: an implementation may overwrite it
        (``TorchComm`` does, on gloo).
        """
        ...

    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup,
        reduction: Reduction,
        async_op: bool,
    ) -> Waitable | None:
        """Reduce ``tensor`` over the ranks of ``group`` in place, as ``reduction`` says."""
        ...


class _AllWorks:
    """Several works waited as one (the W broadcasts of a gloo all-gather)."""

    def __init__(self, works: list[dist.Work | None]) -> None:
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            if work is not None:
                work.wait()
        self._works = []
        return True


class _ChunkOnWait:
    """An in-place all-reduce that finishes as a reduce-scatter: ``wait()`` copies our chunk
    and divides it (the chunk: W times fewer elements than the buffer)."""

    def __init__(
        self,
        work: dist.Work | None,
        output: torch.Tensor,
        summed: torch.Tensor,
        rank: int,
        divisor: float | None,
    ) -> None:
        self._work = work
        self._output = output
        self._summed = summed  # (W * n,) the all-reduced buffer; rank r's chunk is r-th
        self._rank = rank
        self._divisor = divisor

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
        n = self._output.numel()
        mine = self._summed.narrow(0, self._rank * n, n)
        if self._divisor is None:
            self._output.copy_(mine)
        else:  # one pass over the chunk, not a copy and then a division (same bits)
            torch.div(mine, self._divisor, out=self._output)
        self._divisor = None
        return True


class _AddOnWait:
    """A two-rank reduce-scatter as one exchange: each rank has sent the half of its buffer
    that the other owns and receives the other's copy of its own half; ``wait()`` adds its own
    half and divides."""

    def __init__(
        self,
        works: list[dist.Work],
        output: torch.Tensor,
        mine: torch.Tensor,
        divisor: float | None,
    ) -> None:
        self._works = works  # they hold the sent half and the output until they finish
        self._output = output
        self._mine: torch.Tensor | None = mine
        self._divisor = divisor

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        self._works = []
        if self._mine is not None:
            # The other rank's value plus ours: the sum gloo's all-reduce makes of two
            # values, bit for bit (one addition, which commutes).
            self._output.add_(self._mine)
            if self._divisor is not None:
                divide_(self._output, self._divisor)
            self._mine = None
        return True


class _DivideOnWait:
    """A collective whose result still needs a division once it is done."""

    def __init__(self, work: Waitable | None, tensor: torch.Tensor, divisor: float | None) -> None:
        self._work = work
        self._tensor = tensor
        self._divisor = divisor

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
        divide_(self._tensor, self._divisor)
        self._divisor = None
        return True


def _after_sum(reduction: Reduction, group_size: int) -> float | None:
    """What to divide by after a plain sum to get ``reduction``'s result (gloo's way).

    gloo's own ``AVG`` is exactly this (a sum, then a division by the group size: checked
    bit for bit on torch 2.13), and gloo has no ``PREMUL_SUM``.
    """
    divisor = 1.0 if reduction.post_divide is None else reduction.post_divide
    if reduction.op == "avg":
        divisor *= group_size
    elif reduction.factor is not None:
        divisor *= reduction.factor
    return None if divisor == 1 else divisor


# The tag of our two-rank exchanges, so that they never match a user's own send / recv on the
# same group (gloo matches point-to-point messages by peer and tag; its collectives use slots
# of their own). Any fixed value works: both ranks issue the exchanges in the same order.
EXCHANGE_TAG = 0x46534852


def _exchange_halves(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, divisor: float | None
) -> _AddOnWait:
    """Start a reduce-scatter over two ranks: send the other rank its half, receive ours.

    The process group's own ``send`` / ``recv`` with the peer's rank in ``group``: what
    ``dist.isend`` / ``dist.irecv`` end in, without their 20 Python calls of argument
    handling (the caller passes plain, non-complex tensors of a group this rank is in).
    """
    n, rank = output.numel(), group.rank()
    works = [
        group.send([input.narrow(0, (1 - rank) * n, n)], 1 - rank, EXCHANGE_TAG),
        group.recv([output], 1 - rank, EXCHANGE_TAG),
    ]
    return _AddOnWait(works, output, input.narrow(0, rank * n, n), divisor)


def _broadcast_slices(output: torch.Tensor, n: int, group: dist.ProcessGroup) -> _AllWorks:
    """Each rank r of ``group`` broadcasts slice r (``n`` elements) of ``output``, async.

    The process group's own ``broadcast`` with the root's rank in ``group``: what
    ``dist.broadcast`` ends in, without its 15 Python calls of argument handling and logging
    (the caller passes a plain, non-complex tensor of a group this rank is in).
    """
    works: list[dist.Work | None] = []
    for r in range(group.size()):
        opts = dist.BroadcastOptions()
        opts.rootRank = r
        opts.rootTensor = 0
        opts.asyncOp = True
        works.append(group.broadcast([output.narrow(0, r * n, n)], opts))
    return _AllWorks(works)


def _all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """An async in-place sum over ``group`` through the process group's own ``allreduce``
    (what ``dist.all_reduce`` ends in; the caller passes a plain, non-complex tensor)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    opts.asyncOp = True
    return group.allreduce([tensor], opts)


def _finish(done: Waitable, async_op: bool) -> Waitable | None:
    """Hand back ``done`` to be waited later, or wait now (a synchronous call returns None)."""
    if async_op:
        return done
    done.wait()
    return None


class TorchComm:
    """The default ``Comm``: ``torch.distributed`` on the mesh's process groups.

    On gloo both collectives of a group are rebuilt from simpler ones that work in place on the
    engine's buffers, because gloo's own versions copy (``ProcessGroupGloo``, torch 2.13):

    - ``reduce_scatter_tensor`` there clones the whole input on the calling thread, all-reduces
      the clone and copies out the caller's chunk. We all-reduce our packed gradient buffer in
      place instead: the same bytes on the wire, no second ``(W * total,)`` buffer. Over two
      ranks it is one exchange instead (each rank sends the half the other owns, receives the
      other's copy of its own half into the output and adds its own): half the all-reduce's
      bytes, no extra buffer, the same bits.
    - ``all_gather_into_tensor`` there gathers into a temporary flat tensor that it allocates
      on its worker thread, then copies into the output. We issue W broadcasts instead, rank r
      sending its shard straight into slice r of the output: every rank receives each other
      rank's shard once, as in an all-gather, and no temporary exists.

    On 2 CPU cores over loopback both took 0.6-0.9x torch's time per call for shards of 1.5-16
    MiB (W = 2 and 4); below that the difference is inside the run-to-run noise
    (``benchmarks/bench_collectives.py``, ``docs/performance.md``). Other backends (NCCL) get
    their native collectives.

    Example:
        >>> comm = TorchComm()
    """

    def __init__(self) -> None:
        # Whether each process group it is handed is gloo's: dist.get_backend costs a dozen
        # Python calls, and a group's backend never changes. A plain dict, read inline (a C
        # call): it holds the few groups of one fully_shard group (shard, reduce, replicate),
        # which its mesh holds as long anyway.
        self._gloo: dict[dist.ProcessGroup, bool] = {}

    def _is_gloo(self, group: dist.ProcessGroup) -> bool:
        known = self._gloo[group] = dist.get_backend(group) == dist.Backend.GLOO
        return known

    # Looked up at every call, never bound once: what patches torch.distributed after
    # fully_shard (torch's own FSDP2 tests delay and inspect collectives that way) sees ours
    # too. torch 2.13 renamed the flat-tensor collectives and deprecated the old names; older
    # releases (2.6 ...) only have the old ones. (The gloo paths call the process group's
    # own methods instead: those tests patch the flat-tensor collectives of NCCL runs.)
    @staticmethod
    def _all_gather(*args: Any, **kwargs: Any) -> dist.Work | None:
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return fn(*args, **kwargs)  # type: ignore[no-any-return]

    @staticmethod
    def _reduce_scatter(*args: Any, **kwargs: Any) -> dist.Work | None:
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return fn(*args, **kwargs)  # type: ignore[no-any-return]

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
    ) -> Waitable | None:
        gloo = self._gloo.get(group)
        if gloo is None:
            gloo = self._is_gloo(group)
        if gloo and output.is_contiguous():
            n, world = input.numel(), group.size()
            mine = output.narrow(0, group.rank() * n, n)
            if mine.data_ptr() != input.data_ptr():  # the engine passes this very slice: no copy
                mine.copy_(input)
            if not output.is_complex():
                gathered = _broadcast_slices(output, n, group)
                return gathered if async_op else _finish(gathered, async_op)
            works = [
                dist.broadcast(
                    output.narrow(0, r * n, n),
                    src=dist.get_global_rank(group, r),
                    group=group,
                    async_op=True,
                )
                for r in range(world)
            ]
            return _finish(_AllWorks(works), async_op)
        return self._all_gather(output, input, group=group, async_op=async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        reduction: Reduction,
        async_op: bool,
    ) -> Waitable | None:
        if reduction.pre_divide is not None:
            divide_(input, reduction.pre_divide)  # our scratch buffer: divide it in place
        gloo = self._gloo.get(group)
        if gloo is None:
            gloo = self._is_gloo(group)
        if gloo:
            divisor = _after_sum(reduction, group.size())
            plain = input.is_contiguous() and not input.is_complex()
            if plain and group.size() == 2 and output.numel() > 0:
                exchange = _exchange_halves(output, input, group, divisor)
                return exchange if async_op else _finish(exchange, async_op)
            if plain:
                summed = _all_reduce_sum(input, group)
                return _finish(_ChunkOnWait(summed, output, input, group.rank(), divisor), async_op)
            if input.is_contiguous():
                work = dist.all_reduce(input, op=dist.ReduceOp.SUM, group=group, async_op=True)
                return _finish(_ChunkOnWait(work, output, input, group.rank(), divisor), async_op)
            work = self._reduce_scatter(
                output, input, op=dist.ReduceOp.SUM, group=group, async_op=True
            )
            return _finish(_DivideOnWait(work, output, divisor), async_op)
        work = self._reduce_scatter(
            output, input, op=reduction.torch_op(), group=group, async_op=True
        )
        return _finish(_DivideOnWait(work, output, reduction.post_divide), async_op)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup,
        reduction: Reduction,
        async_op: bool,
    ) -> Waitable | None:
        divide_(tensor, reduction.pre_divide)
        gloo = self._gloo.get(group)
        if gloo is None:
            gloo = self._is_gloo(group)
        if gloo:
            divisor = _after_sum(reduction, group.size())
            if not tensor.is_complex():
                return _finish(
                    _DivideOnWait(_all_reduce_sum(tensor, group), tensor, divisor), async_op
                )
            op = dist.ReduceOp(dist.ReduceOp.SUM)
        else:
            divisor, op = reduction.post_divide, reduction.torch_op()
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        return _finish(_DivideOnWait(work, tensor, divisor), async_op)


def comm_key(comm: object) -> Hashable:
    """What two groups' comms must agree on to share one collective: the default collectives
    (one stateless ``TorchComm`` per group) all agree; a comm set with ``set_comm`` (a
    counter, a tool) is matched by identity.

    Example:
        >>> comm_key(TorchComm()) == comm_key(TorchComm())
        True
    """
    return TorchComm if type(comm) is TorchComm else id(comm)


@dataclass(frozen=True)
class CommRecord:
    """One collective as seen by :class:`CountingComm`: op name, dtype and bytes sent by us.

    ``nbytes`` is the size of this rank's input: the shard for an all-gather, the full flat
    gradient buffer for a reduce-scatter, the tensor for an all-reduce.

    Example:
        >>> import torch
        >>> from fully_shard import CommRecord
        >>> CommRecord("all_gather", torch.float32, 256, 1024).nbytes
        1024
    """

    op: str
    dtype: torch.dtype
    numel: int
    nbytes: int


@dataclass
class CountingComm:
    """A ``Comm`` that records every collective it forwards to ``inner``.

    Attributes:
        inner: the ``Comm`` that does the work.
        records: one :class:`CommRecord` per collective, in issue order.

    Example:
        >>> from fully_shard import CountingComm, TorchComm
        >>> comm = CountingComm(TorchComm())
        >>> comm.bytes_by_op()
        {}
    """

    inner: Comm = field(default_factory=TorchComm)
    records: list[CommRecord] = field(default_factory=list)

    def _record(self, op: str, t: torch.Tensor) -> None:
        self.records.append(CommRecord(op, t.dtype, t.numel(), t.numel() * t.element_size()))

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
    ) -> Waitable | None:
        self._record("all_gather", input)
        return self.inner.all_gather(output, input, group, async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        reduction: Reduction,
        async_op: bool,
    ) -> Waitable | None:
        self._record("reduce_scatter", input)
        return self.inner.reduce_scatter(output, input, group, reduction, async_op)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup,
        reduction: Reduction,
        async_op: bool,
    ) -> Waitable | None:
        self._record("all_reduce", tensor)
        return self.inner.all_reduce(tensor, group, reduction, async_op)

    def bytes_by_op(self) -> dict[str, int]:
        """Total bytes per op name since the last :meth:`reset`."""
        out: dict[str, int] = {}
        for r in self.records:
            out[r.op] = out.get(r.op, 0) + r.nbytes
        return out

    def count_by_op(self) -> dict[str, int]:
        """Number of collectives per op name since the last :meth:`reset`."""
        out: dict[str, int] = {}
        for r in self.records:
            out[r.op] = out.get(r.op, 0) + 1
        return out

    def reset(self) -> None:
        self.records.clear()


class AllGather(ABC):
    """The all-gather of ``FSDPModule.set_custom_all_gather``: allocate, then gather.

    The same protocol as torch's ``torch.distributed.fsdp.AllGather``, whose subclasses are
    accepted too (checked by duck typing: a callable ``allocate`` and ``__call__``).
    ``allocate`` makes the group's all-gather output ``(W * total,)``; this rank's input is
    its own slice of it (gathered in place). The call goes through the group's observers
    (trace, profiler labels) like every other collective.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from fully_shard import AllGather
        >>> class MyAllGather(AllGather):
        ...     def allocate(self, size, *, dtype, device):
        ...         return torch.empty(*size, dtype=dtype, device=device)
        ...     def __call__(self, output_tensor, input_tensor, group, async_op=False):
        ...         return dist.all_gather_into_tensor(
        ...             output_tensor, input_tensor, group=group, async_op=async_op)
        >>> model.set_custom_all_gather(MyAllGather())  # doctest: +SKIP
    """

    @abstractmethod
    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A buffer of ``size`` for the collective (e.g. from a communication memory pool)."""

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Gather every rank's ``input_tensor`` into ``output_tensor``, rank by rank."""


class ReduceScatter(ABC):
    """The reduce-scatter of ``FSDPModule.set_custom_reduce_scatter``: allocate, then reduce.

    The same protocol as torch's ``torch.distributed.fsdp.ReduceScatter`` (its subclasses
    are accepted too). ``allocate`` makes the ``(W * total,)`` input and ``(total,)`` output
    buffers; ``__call__`` is handed the ``torch.distributed`` op torch's FSDP2 would use
    (``AVG``, ``SUM`` or ``PREMUL_SUM``) and is called synchronously, as torch calls it. The
    divisions that come before or after the collective (fp16, ``force_sum``) are done by
    the engine around the call.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from fully_shard import ReduceScatter
        >>> class MyReduceScatter(ReduceScatter):
        ...     def allocate(self, size, *, dtype, device):
        ...         return torch.empty(*size, dtype=dtype, device=device)
        ...     def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        ...         return dist.reduce_scatter_tensor(
        ...             output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        >>> model.set_custom_reduce_scatter(MyReduceScatter())  # doctest: +SKIP
    """

    @abstractmethod
    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A buffer of ``size`` for the collective."""

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Reduce ``input_tensor`` over ranks with ``op``; keep this rank's chunk in ``output``."""


def is_comm_protocol(obj: object) -> bool:
    """Whether ``obj`` looks like an ``AllGather`` / ``ReduceScatter`` (ours or torch's)."""
    return callable(getattr(obj, "allocate", None)) and callable(obj)


class UserAllGather:
    """Our ``Comm.all_gather`` over a user's :class:`AllGather` (the other calls: ``inner``)."""

    def __init__(self, user: Any) -> None:
        self.user = user

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
    ) -> Waitable | None:
        # Keywords, as torch's FSDP2 calls it: a user's implementation may rely on the names.
        work: Waitable | None = self.user(
            output_tensor=output, input_tensor=input, group=group, async_op=async_op
        )
        if async_op:
            return work
        _finish_if(work)
        return None


class UserReduceScatter:
    """Our ``Comm.reduce_scatter`` over a user's :class:`ReduceScatter`.

    The user's call gets the op; the divisions before and after it are done here.
    """

    def __init__(self, user: Any) -> None:
        self.user = user

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        reduction: Reduction,
        async_op: bool,
    ) -> Waitable | None:
        divide_(input, reduction.pre_divide)
        work: Waitable | None = self.user(
            output_tensor=output, input_tensor=input, group=group, op=reduction.torch_op()
        )
        return _finish(_DivideOnWait(work, output, reduction.post_divide), async_op)


def _finish_if(work: Waitable | None) -> None:
    """A synchronous call's handle, if the implementation returned one anyway: wait it."""
    if work is not None:
        work.wait()
