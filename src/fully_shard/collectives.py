"""Communication: the ``Comm`` interface, byte accounting, and flat-buffer packing.

Every collective the engine issues goes through a ``Comm``: a three-method object whose
default, :class:`TorchComm`, calls ``torch.distributed``. Tests and benchmarks wrap it in a
:class:`CountingComm` to count bytes and check dtypes without patching ``torch.distributed``.

The packing functions are pure: they move bytes between per-parameter tensors and one flat
buffer per group, laid out rank by rank, so that a group needs exactly one all-gather and one
reduce-scatter::

    all-gather input   (total,)        = [p0 shard | p1 shard | ...]            (this rank)
    all-gather output  (W * total,)    = [rank 0's input | rank 1's input | ...]
    reduce-scatter in  (W * total,)    = [p0 chunk 0 | p1 chunk 0 | ... | p0 chunk 1 | ...]
    reduce-scatter out (total,)        = this rank's summed chunk of every parameter

``total`` is the sum of the parameters' padded shard sizes, so every rank sends the same bytes.
The all-gather buffer has one dtype (:func:`wire_dtype`): the parameters' compute dtype, or
``uint8`` when they differ (each :class:`GatherInput` then takes its byte size); padding is
written as zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Waitable(Protocol):
    """What an async collective returns (a ``dist.Work``, or a wrapper around one)."""

    def wait(self) -> Any: ...


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
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
    ) -> Waitable | None:
        """Sum ``input`` (W times larger) over ranks; rank r keeps the r-th chunk in ``output``.

        ``input`` is the engine's own scratch buffer, dropped once the work is done: an
        implementation may overwrite it (``TorchComm`` does, on gloo).
        """
        ...

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool
    ) -> dist.Work | None:
        """Sum ``tensor`` over the ranks of ``group``, in place."""
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
    """An in-place all-reduce that finishes as a reduce-scatter: ``wait()`` copies our chunk."""

    def __init__(
        self, work: dist.Work | None, output: torch.Tensor, summed: torch.Tensor, rank: int
    ) -> None:
        self._work = work
        self._output = output
        self._summed = summed  # (W * n,) the all-reduced buffer; rank r's chunk is r-th
        self._rank = rank

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
        n = self._output.numel()
        self._output.copy_(self._summed.narrow(0, self._rank * n, n))
        return True


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
      place instead: the same bytes on the wire, no second ``(W * total,)`` buffer.
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
        # torch 2.13 renamed the flat-tensor collectives and deprecated the old names; older
        # releases (2.6 ...) only have the old ones.
        self._all_gather: Callable[..., dist.Work | None] = (
            getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        )
        self._reduce_scatter: Callable[..., dist.Work | None] = (
            getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        )

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
    ) -> Waitable | None:
        if dist.get_backend(group) == dist.Backend.GLOO and output.is_contiguous():
            n, world = input.numel(), group.size()
            mine = output.narrow(0, group.rank() * n, n)
            if mine.data_ptr() != input.data_ptr():  # the engine passes this very slice: no copy
                mine.copy_(input)
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
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
    ) -> Waitable | None:
        if dist.get_backend(group) == dist.Backend.GLOO and input.is_contiguous():
            work = dist.all_reduce(input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
            return _finish(_ChunkOnWait(work, output, input, group.rank()), async_op)
        return self._reduce_scatter(
            output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool
    ) -> dist.Work | None:
        work: dist.Work | None = dist.all_reduce(
            tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )
        return work


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
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
    ) -> Waitable | None:
        self._record("reduce_scatter", input)
        return self.inner.reduce_scatter(output, input, group, async_op)

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool
    ) -> dist.Work | None:
        self._record("all_reduce", tensor)
        return self.inner.all_reduce(tensor, group, async_op)

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


@dataclass(frozen=True)
class GatherInput:
    """One tensor a parameter sends in a group's all-gather, before padding and casting.

    Every rank sends ``padded_size`` elements in ``dtype``; ``data`` is this rank's part of
    them: the first ``data.size(dim)`` rows along ``dim`` (fewer than ``padded_size[dim]`` on
    a trailing rank of an uneven split, or none). The rest is padding, written as zeros.

    Attributes:
        data: ``(rows, *rest)`` this rank's rows, in any dtype and on any device.
        dtype: the dtype it travels in (and the unsharded tensor is rebuilt in).
        padded_size: ``(chunk, *rest)`` (for ``dim == 0``): what every rank sends.
        dim: the dim along which ``data`` is padded to ``padded_size``.

    Example:
        >>> import torch
        >>> from fully_shard.collectives import GatherInput
        >>> gi = GatherInput(torch.ones(1, 3), torch.float32, torch.Size([2, 3]), 0)
        >>> gi.numel, gi.nbytes
        (6, 24)
    """

    data: torch.Tensor
    dtype: torch.dtype
    padded_size: torch.Size
    dim: int

    @property
    def numel(self) -> int:
        return self.padded_size.numel()

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def write_typed(self, slot: torch.Tensor) -> None:
        """Fill ``slot`` ``(numel,)`` of ``self.dtype``: cast rows, then zero padding."""
        padded = slot.view(self.padded_size)
        rows = self.data.size(self.dim)
        padded.narrow(self.dim, 0, rows).copy_(self.data, non_blocking=True)
        pad = self.padded_size[self.dim] - rows
        if pad > 0:
            # Zeros, not whatever the buffer held: the padding is gathered into every rank's
            # unsharded storage and, under reshard_after_forward=<int>, sent again.
            padded.narrow(self.dim, rows, pad).zero_()


def wire_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The dtype of a group's flat all-gather buffer for inputs of ``dtypes``.

    One dtype gathers in that dtype. Mixed dtypes (a frozen bf16, float8 or int8 weight
    beside fp32 ones) gather as ``uint8``, every input viewed as its bytes. A float8 dtype
    gathers as ``uint8`` too: gloo has no float8 type, and a 1-byte view costs nothing.
    """
    kinds = set(dtypes)
    if len(kinds) == 1:
        (only,) = kinds
        if only.is_floating_point and only.itemsize == 1:  # float8 variants
            return torch.uint8
        return only
    return torch.uint8


def split_sizes(inputs: Sequence[GatherInput], wire: torch.dtype) -> list[int]:
    """Each input's length in the flat buffer, in elements of ``wire`` (bytes for uint8)."""
    if wire == torch.uint8:
        return [gi.nbytes for gi in inputs]
    return [gi.numel for gi in inputs]


def copy_in(flat_in: torch.Tensor, inputs: Sequence[GatherInput]) -> None:
    """Write every input, cast and padded with zeros, into its slot of ``flat_in``.

    ``flat_in`` is ``(total,)`` in the wire dtype (:func:`wire_dtype`), laid out as
    ``[input 0 | input 1 | ...]`` with the lengths of :func:`split_sizes`.
    """
    slots = torch.split(flat_in, split_sizes(inputs, flat_in.dtype))
    for slot, gi in zip(slots, inputs, strict=True):
        if slot.dtype == gi.dtype:
            gi.write_typed(slot)
        elif slot.storage_offset() % gi.dtype.itemsize == 0:
            # A byte slot at an offset the input's dtype can start at: write it in place.
            gi.write_typed(slot.view(gi.dtype))
        else:
            typed = torch.empty(gi.numel, dtype=gi.dtype, device=slot.device)
            gi.write_typed(typed)
            slot.copy_(typed.view(torch.uint8))


def copy_out(
    gathered: torch.Tensor, world: int, split_numels: Sequence[int], outs: Sequence[torch.Tensor]
) -> None:
    """Scatter the all-gather output into each input's ``(W, numel)`` destination.

    ``gathered`` is ``(W * total,)``; viewed ``(W, total)``, column block i belongs to
    input i. One ``split_with_sizes_copy`` moves them all. A ``uint8`` buffer (mixed dtypes)
    is copied into each destination viewed as bytes.
    """
    if gathered.dtype == torch.uint8:
        outs = [o if o.dtype == torch.uint8 else o.view(torch.uint8) for o in outs]
    torch.split_with_sizes_copy(gathered.view(world, -1), list(split_numels), dim=1, out=list(outs))


def typed_block(block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``(W, n)`` column block of the gathered buffer as ``dtype`` (a copy if it is bytes)."""
    if block.dtype == dtype:
        return block
    typed = torch.empty(
        block.size(0), block.size(1) // dtype.itemsize, dtype=dtype, device=block.device
    )
    typed.view(torch.uint8).copy_(block)
    return typed


def pack_for_reduce_scatter(views: Sequence[torch.Tensor], world: int) -> torch.Tensor:
    """Lay out ``(W, padded_numel_i)`` gradient views rank by rank: ``(W * total,)``."""
    if len(views) == 1:
        return views[0].reshape(-1).contiguous()
    return torch.cat(list(views), dim=1).view(-1)
