"""Flat-buffer packing: the pure functions that lay a group's tensors out for one collective.

They move bytes between per-parameter tensors and one flat buffer per group, laid out rank by
rank, so that a group needs exactly one all-gather and one reduce-scatter::

    all-gather input   (total,)        = [p0 shard | p1 shard | ...]            (this rank)
    all-gather output  (W * total,)    = [rank 0's input | rank 1's input | ...]
    reduce-scatter in  (W * total,)    = [p0 chunk 0 | p1 chunk 0 | ... | p0 chunk 1 | ...]
    reduce-scatter out (total,)        = this rank's summed chunk of every parameter

``total`` is the sum of the parameters' padded shard sizes, so every rank sends the same bytes.
The all-gather buffer has one dtype (:func:`wire_dtype`): the parameters' compute dtype, or
``uint8`` when they differ (each :class:`GatherInput` then takes its byte size); padding is
written as zeros. Nothing here communicates: :mod:`fully_shard.collectives` does.

The buffers come from :func:`allocate_buffer`: ``torch.empty``, the process group's own
allocator (:class:`ProcessGroupAllocator`), or a user's collective's ``allocate``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._compat import backend_allocate
from .errors import FullyShardValueError
from .layout import split_rows


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
        >>> from fully_shard.packing import GatherInput
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
    whole = whole_inputs(inputs, flat_in)
    if whole is not None:
        torch.cat(whole, out=flat_in)
        return
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


def whole_inputs(inputs: Sequence[GatherInput], flat: torch.Tensor) -> list[torch.Tensor] | None:
    """Each input's data flattened, when every input is its whole padded shard, contiguous,
    in the wire dtype, on the buffer's device (the usual even split; not an offloaded shard,
    whose copy is the host-to-device one of :func:`copy_in`): then ``torch.cat`` of them into
    ``flat``'s slice is the whole copy-in, one call for the group instead of a view, a copy
    and a padding check per input, the same bytes in the same places. ``None`` otherwise."""
    whole = [gi.data.view(-1) for gi in inputs if _fills_its_slot(gi, flat)]
    return whole if whole and len(whole) == len(inputs) else None


def _fills_its_slot(gi: GatherInput, flat: torch.Tensor) -> bool:
    """``gi.data`` is already its slot's bytes: a plain tensor (a subclass's own ops stay on
    the per-input path), no padding, no cast, contiguous, on ``flat``'s device."""
    data = gi.data
    return (
        type(data) is torch.Tensor
        and data.dtype == flat.dtype
        and gi.dtype == flat.dtype
        and data.device == flat.device
        and data.is_contiguous()
        and data.size(gi.dim) == gi.padded_size[gi.dim]
    )


def copy_out(
    gathered: torch.Tensor, world: int, split_numels: Sequence[int], outs: Sequence[torch.Tensor]
) -> None:
    """Scatter the all-gather output into each input's ``(W, numel)`` destination.

    ``gathered`` is ``(W * total,)`` or ``(W, total)``; as the latter, column block i belongs to
    input i. One ``split_with_sizes_copy`` moves them all. A ``uint8`` buffer (mixed dtypes)
    is copied into each destination viewed as bytes.
    """
    if gathered.dtype == torch.uint8:
        outs = [o if o.dtype == torch.uint8 else o.view(torch.uint8) for o in outs]
    if gathered.ndim != 2:  # a bucket hands each group its (W, total) columns already
        gathered = gathered.view(world, -1)
    torch.split_with_sizes_copy(gathered, list(split_numels), dim=1, out=list(outs))


def typed_block(block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``(W, n)`` column block of the gathered buffer as ``dtype`` (a copy if it is bytes)."""
    if block.dtype == dtype:
        return block
    typed = torch.empty(
        block.size(0), block.size(1) // dtype.itemsize, dtype=dtype, device=block.device
    )
    typed.view(torch.uint8).copy_(block)
    return typed


def pack_grads(
    columns: torch.Tensor, items: Sequence[tuple[int, int, torch.Tensor | None, int, int]]
) -> None:
    """Write several gradients into their column blocks of a ``(W, total)`` reduce-scatter
    input: ``items`` are ``(offset, padded_numel, grad, dim, chunk)``, each as
    :func:`pack_grad` takes it.

    When the blocks tile ``columns`` in order and every gradient is an even dim-0 split,
    contiguous, in the buffer's dtype (the usual case), row r of each block is the gradient's
    rows ``[r * chunk, (r + 1) * chunk)`` flattened, so ``torch.cat`` of the gradients viewed
    ``(W, -1)`` along dim 1 writes them all in one call, the same bytes as one copy each.
    """
    world, total = columns.size(0), columns.size(1)
    views = []
    end = 0
    for off, numel, grad, dim, chunk in items:
        if (
            grad is None
            or off != end
            or dim != 0
            or grad.dtype != columns.dtype
            or grad.size(0) != chunk * world
            or not grad.is_contiguous()
        ):
            break
        views.append(grad.view(world, -1))
        end += numel
    else:
        if end == total and views:
            torch.cat(views, dim=1, out=columns)
            return
    for off, numel, grad, dim, chunk in items:
        pack_grad(columns[:, off : off + numel], grad, dim, chunk)


def pack_grad(block: torch.Tensor, grad: torch.Tensor | None, dim: int, chunk: int) -> None:
    """Write one parameter's full gradient into its column block of the reduce-scatter input.

    ``block`` is ``(W, padded_numel)``, a column slice of the ``(W, total)`` buffer: row r
    receives the ``chunk`` rows (along ``dim``) that rank r owns, padded with zeros. One copy
    per rank at most, cast to the buffer's dtype on the way: no padded temporary, no second
    pass. ``grad`` ``None`` (a parameter unused on this rank) writes zeros, so that every
    rank reduce-scatters the same layout.
    """
    world = block.size(0)
    if grad is None:
        block.zero_()
        return
    size = grad.size()
    n = size[dim]
    # (W, *size[:dim], chunk, *size[dim+1:]): row r as the shape of one padded shard.
    ranked = block.view(world, *size[:dim], chunk, *size[dim + 1 :])
    if dim == 0 and n == chunk * world:  # even split on dim 0: one copy
        ranked.copy_(grad.view(world, chunk, *size[1:]))
        return
    for r in range(world):
        split = split_rows(n, world, r)  # its chunk is ``chunk``: the layout's own split
        dst = ranked[r]
        if split.rows > 0:
            dst.narrow(dim, 0, split.rows).copy_(grad.narrow(dim, split.start, split.rows))
        if split.rows < chunk:
            dst.narrow(dim, split.rows, chunk - split.rows).zero_()


class ProcessGroupAllocator:
    """Buffers from the process group's own allocator (NCCL), else ``torch.empty`` (gloo).

    Example:
        >>> alloc = ProcessGroupAllocator(group)  # doctest: +SKIP
        >>> alloc.allocate((1024,), dtype=torch.float32, device=device)  # doctest: +SKIP
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = math.prod(size)
        out = backend_allocate(self.group, numel, dtype, device)
        return torch.empty(numel, dtype=dtype, device=device) if out is None else out


def allocate_buffer(
    allocator: Any, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A flat ``(numel,)`` communication buffer from ``allocator.allocate`` or ``torch.empty``."""
    if allocator is None:
        return torch.empty(numel, dtype=dtype, device=device)
    out: torch.Tensor = allocator.allocate((numel,), dtype=dtype, device=device)
    if out.numel() != numel or out.dtype != dtype:
        raise FullyShardValueError(
            f"{type(allocator).__name__}.allocate(({numel},), dtype={dtype}) returned a tensor "
            f"of shape {tuple(out.shape)} and dtype {out.dtype}; it must return that size and "
            "dtype"
        )
    return out.view(-1)
