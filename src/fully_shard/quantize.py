"""Block-quantized int8: the pack and unpack functions of a quantized all-gather (ZeRO++ qwZ).

Each rank quantizes its own flat shard block by block: symmetric int8 with one fp32 scale per
block of ``block_size`` consecutive elements (the last block may be shorter)::

    shard   (n,)               fp32 master values x
    scales  (ceil(n / B),)     s_b = max |x| over block b / 127, rounded up (by at most 2^-21
                               relative, or one subnormal step)
    values  (n,)  int8         q_i = round(x_i / s_b), in [-127, 127]
    unpack                     x'_i = q_i * s_b, rounded once to the compute dtype

Error bound: ``|x_i - q_i * s_b| <= s_b / 2`` (half the block's quantization step) up to fp32
rounding of one division and one multiply, since rounding to the nearest integer moves
``x_i / s_b`` by at most one half and no value needs clamping (``|x_i| / s_b <= 127``: the
scale is rounded up, never down, so even a block of subnormals, whose ``max |x| / 127`` would
round to zero, gets a positive scale). A compute dtype narrower than fp32 (bf16) adds its own
rounding of ``x'_i`` on top. An outlier only coarsens its own block; an all-zero block is
exact. A block holding an inf or a NaN comes back as NaNs (its scale is not finite).

How a parameter travels in its group's all-gather is a *gather format*
(:class:`GatherFormat`): :data:`PLAIN` sends the shard cast to the compute dtype and copies it
back; :class:`Int8BlockGather` sends int8 values plus fp32 scales and dequantizes them into the
unsharded storage. :func:`gather_format` asks the group's
:class:`~fully_shard.policies.QuantizationPolicy` which one a parameter uses.

Example:
    >>> import torch
    >>> x = torch.tensor([0.5, -1.0, 0.25, 0.0])
    >>> q, s = quantize_blocks(x, block_size=2)
    >>> q.tolist(), [round(v, 6) for v in s.tolist()]
    ([63, -127, 127, 0], [0.007874, 0.001969])
    >>> [round(v, 4) for v in dequantize_blocks(q, s, block_size=2, dtype=torch.float32).tolist()]
    [0.4961, -1.0, 0.25, 0.0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from .packing import GatherInput, typed_block
from .policies import QuantizationPolicy

QMAX = 127
SCALE_BYTES = 4  # one fp32 scale per block


def n_blocks(numel: int, block_size: int) -> int:
    """How many scales a flat tensor of ``numel`` elements needs."""
    return math.ceil(numel / block_size)


def int8_gather_nbytes(numel: int, block_size: int) -> int:
    """Bytes one rank sends for a quantized shard of ``numel`` elements: values plus scales.

    Example:
        >>> int8_gather_nbytes(1000, 256)  # 1000 int8 values + 4 fp32 scales
        1016
    """
    return numel + SCALE_BYTES * n_blocks(numel, block_size)


def _blocked(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` (n,) zero-padded to whole blocks, viewed ``(n_blocks, block_size)``."""
    n = x.numel()
    padded = n_blocks(n, block_size) * block_size
    if padded != n:
        x = torch.cat([x, x.new_zeros(padded - n)])
    return x.view(-1, block_size)


# max |x| * (1 + 2^-22) / 127, rounded to fp32, is at least max |x| / 127 for every normal
# max |x| (the two roundings lose at most 2^-23 together); one subnormal step more covers the
# absolute rounding of the subnormal range. So |x| / s <= 127 always: no value is clamped.
_SCALE_FACTOR = (1 + 2.0**-22) / QMAX
_SMALLEST_SUBNORMAL = 2.0**-149


def _scales_from_abs(abs_blocks: torch.Tensor) -> torch.Tensor:
    """``(n_blocks,)`` fp32: ``max |x| / 127`` per row of ``|blocks|``, never below it, never 0.

    Few ops on purpose: at the shard sizes of a transformer block each costs more in dispatch
    than in arithmetic.
    """
    return abs_blocks.amax(dim=1).mul_(_SCALE_FACTOR).add_(_SMALLEST_SUBNORMAL)


def _rounded_blocks(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``round(x / s)`` as fp32 ``(n_blocks, block_size)`` (zero-padded) and the scales ``s``.

    The values are whole numbers in ``[-127, 127]``, so any later cast to int8 is exact: the
    engine lets copy-in do that cast while it writes the all-gather buffer (one pass less).
    """
    blocks = _blocked(x if x.dtype == torch.float32 else x.float(), block_size)  # (n_blocks, B)
    # One temporary of the shard's size, used twice: |x|, then x / s. At these sizes a fresh
    # buffer costs more in page faults than the arithmetic that fills it.
    work = blocks.abs()
    scales = _scales_from_abs(work)  # (n_blocks,), all > 0
    return torch.div(blocks, scales[:, None], out=work).round_(), scales


def quantize_blocks(
    x: torch.Tensor, block_size: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 values ``(n,)`` and fp32 scales ``(ceil(n / block_size),)`` of flat ``x``.

    ``out``: (values, scales) buffers to write into, e.g. slices of an all-gather input.
    """
    if x.dim() != 1:
        raise ValueError(f"quantize_blocks takes a flat tensor, got shape {tuple(x.shape)}")
    n = x.numel()
    rounded, scales = _rounded_blocks(x.detach(), block_size)
    if out is None:
        return rounded.view(-1)[:n].to(torch.int8), scales
    out[0].copy_(rounded.view(-1)[:n])
    out[1].copy_(scales)
    return out


def dequantize_into(
    out: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, block_size: int
) -> torch.Tensor:
    """``out (R, n) = values (R, n) * scales (R, ceil(n / B))``, each row blocked on its own.

    Row r is one rank's shard (its blocks start at its own element 0). ``out`` is in the
    compute dtype; the int8 values convert exactly (``|q| <= 127`` fits every float dtype),
    and each product is rounded once to ``out``'s dtype (through fp32 for a narrower one).
    No temporary of ``out``'s size beyond what the multiply needs to cast.
    """
    rows, n = values.shape
    full = n // block_size
    # A copy, then a multiply in place: two passes, but each a same-dtype kernel. One mixed
    # int8 * fp32 multiply into `out` measured 15% slower here (no vectorized cast path).
    out.copy_(values)
    if full:
        out[:, : full * block_size].view(rows, full, block_size).mul_(scales[:, :full, None])
    if n > full * block_size:
        out[:, full * block_size :].mul_(scales[:, full : full + 1])
    return out


def dequantize_blocks(
    values: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``values * scale`` of each element's block, as ``dtype`` ``(n,)`` (into ``out`` if given).

    The same arithmetic as the engine's unpack (:func:`dequantize_into`), bit for bit.
    """
    result = torch.empty(values.numel(), dtype=dtype, device=values.device) if out is None else out
    dequantize_into(result.unsqueeze(0), values.unsqueeze(0), scales.unsqueeze(0), block_size)
    return result


# -- gather formats: what a parameter sends in its group's all-gather, and how it is rebuilt ----


class GatherFormat(Protocol):
    """How one parameter travels in its group's all-gather.

    ``inputs`` turns this rank's shard into the :class:`~fully_shard.packing.GatherInput`
    s it sends; ``rebuild`` gets their ``(W, numel)`` blocks of the gathered buffer back and
    writes the unsharded tensor. ``direct``: the gathered bytes *are* the unsharded tensor's,
    so the group may copy them straight into the storage instead of calling ``rebuild``.
    """

    direct: ClassVar[bool]

    def inputs(
        self, shard: torch.Tensor, padded_size: torch.Size, dim: int, dtype: torch.dtype
    ) -> list[GatherInput]:
        """What to send for ``shard`` (``(rows, *rest)``, padded on ``dim`` to ``padded_size``)."""
        ...

    def rebuild(self, blocks: list[torch.Tensor], ranked: torch.Tensor) -> None:
        """Write ``ranked`` (``(W, *padded_size)``: rank r's rows of the storage)."""
        ...


@dataclass(frozen=True)
class PlainGather:
    """The shard itself, cast to the compute dtype: one input, rebuilt by a copy.

    Example:
        >>> import torch
        >>> [gi.dtype for gi in PLAIN.inputs(torch.ones(2, 3), torch.Size([2, 3]), 0,
        ...                                 torch.bfloat16)]
        [torch.bfloat16]
    """

    direct: ClassVar[bool] = True

    def inputs(
        self, shard: torch.Tensor, padded_size: torch.Size, dim: int, dtype: torch.dtype
    ) -> list[GatherInput]:
        return [GatherInput(shard, dtype, padded_size, dim)]

    def rebuild(self, blocks: list[torch.Tensor], ranked: torch.Tensor) -> None:
        (block,) = blocks
        if ranked.is_contiguous() and block.dtype == torch.uint8:
            # Bytes into bytes: one copy, no typed temporary (a group with int8 neighbours
            # gathers as uint8, and rebuilds these here rather than straight into storage).
            ranked.view(ranked.size(0), -1).view(torch.uint8).copy_(block)
            return
        typed = typed_block(block, ranked.dtype)
        ranked.copy_(typed.reshape(ranked.shape))


PLAIN = PlainGather()


@dataclass(frozen=True)
class Int8BlockGather:
    """This rank's padded flat shard as int8 values and fp32 block scales; dequantized back.

    Two inputs: ``values`` ``(padded_numel,)`` int8 and ``scales``
    ``(ceil(padded_numel / block_size),)`` fp32, both written after the plain inputs' bytes
    into the group's one ``uint8`` all-gather buffer. Blocks run over the padded shard
    flattened, so padding rows are zeros inside the last blocks (or blocks of their own,
    scale 0) and never change a real element's scale.

    Attributes:
        block_size: elements per scale.

    Example:
        >>> import torch
        >>> fmt = Int8BlockGather(block_size=4)
        >>> [(gi.dtype, gi.numel) for gi in fmt.inputs(torch.randn(2, 3), torch.Size([3, 3]),
        ...                                            0, torch.float32)]
        [(torch.int8, 9), (torch.float32, 3)]
    """

    block_size: int
    direct: ClassVar[bool] = False

    def inputs(
        self, shard: torch.Tensor, padded_size: torch.Size, dim: int, dtype: torch.dtype
    ) -> list[GatherInput]:
        numel = padded_size.numel()
        rows = shard.size(dim)
        if dim == 0 or rows == padded_size[dim]:
            # The local elements are the first ones of the padded flat shard; the padding
            # after them is zeros (written by copy-in), as are the blocks it fills alone.
            flat = shard.reshape(-1)
        else:
            padded = shard.new_zeros(padded_size)
            padded.narrow(dim, 0, rows).copy_(shard)
            flat = padded.view(-1)
        rounded, scales = _rounded_blocks(flat.detach(), self.block_size)
        # Sent as int8: copy-in casts the whole-numbered fp32 values on the way (exact).
        return [
            GatherInput(rounded.view(-1)[: flat.numel()], torch.int8, torch.Size([numel]), 0),
            GatherInput(scales, torch.float32, torch.Size([n_blocks(numel, self.block_size)]), 0),
        ]

    def rebuild(self, blocks: list[torch.Tensor], ranked: torch.Tensor) -> None:
        values_block, scales_block = blocks  # (W, padded_numel) and (W, n_blocks), as bytes
        world = ranked.size(0)
        # Same item size: a view, even of this strided column block of the buffer.
        values = values_block if values_block.dtype == torch.int8 else values_block.view(torch.int8)
        scales = typed_block(scales_block, torch.float32)
        if ranked.is_contiguous():  # sharded on dim 0: rank r's rows are one flat run
            dequantize_into(ranked.view(world, -1), values, scales, self.block_size)
            return
        flat = torch.empty(values.shape, dtype=ranked.dtype, device=ranked.device)
        dequantize_into(flat, values, scales, self.block_size)
        ranked.copy_(flat.view(ranked.shape))


def gather_format(
    policy: QuantizationPolicy, size: torch.Size, dtype: torch.dtype, shard_numel: int
) -> GatherFormat:
    """The format a parameter of ``size`` and ``dtype`` travels in, as ``policy`` says.

    ``shard_numel``: the elements of its padded shard (what each rank sends).

    Example:
        >>> import torch
        >>> from fully_shard import QuantizationPolicy
        >>> policy = QuantizationPolicy(all_gather="int8", block_size=256)
        >>> gather_format(policy, torch.Size([1024, 512]), torch.float32, 262144)
        Int8BlockGather(block_size=256)
        >>> gather_format(policy, torch.Size([512]), torch.float32, 256)  # 1-D: a norm weight
        PlainGather()
    """
    if policy.quantizes(size, dtype, shard_numel):
        return Int8BlockGather(policy.block_size)
    return PLAIN
