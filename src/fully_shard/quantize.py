"""Block-quantized int8: the pack and unpack functions of a quantized all-gather (ZeRO++ qwZ).

Each rank quantizes its own flat shard block by block: symmetric int8 with one fp32 scale per
block of ``block_size`` consecutive elements (the last block may be shorter)::

    shard   (n,)               fp32 master values x
    scales  (ceil(n / B),)     s_b = max |x| over block b / 127   (0 for an all-zero block)
    values  (n,)  int8         q_i = round(x_i / s_b), in [-127, 127]
    unpack                     x'_i = q_i * s_b, cast to the compute dtype

Error bound: ``|x_i - q_i * s_b| <= s_b / 2`` (half the block's quantization step) up to fp32
rounding of one multiply, since rounding to the nearest integer moves ``x_i / s_b`` by at most
one half and no value is clamped (``|x_i| / s_b <= 127`` by the choice of ``s_b``). A compute
dtype narrower than fp32 (bf16) adds its own rounding of ``x'_i`` on top. An outlier only
coarsens its own block; an all-zero block is exact.

Example:
    >>> import torch
    >>> x = torch.tensor([0.5, -1.0, 0.25, 0.0])
    >>> q, s = quantize_blocks(x, block_size=2)
    >>> q.tolist(), [round(v, 6) for v in s.tolist()]
    ([64, -127, 127, 0], [0.007874, 0.001969])
    >>> dequantize_blocks(q, s, block_size=2, dtype=torch.float32).tolist()  # doctest: +ELLIPSIS
    [0.50393..., -1.0, 0.25, 0.0]
"""

from __future__ import annotations

import math

import torch

QMAX = 127


def n_blocks(numel: int, block_size: int) -> int:
    """How many scales a flat tensor of ``numel`` elements needs."""
    return math.ceil(numel / block_size)


def _blocked(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` (n,) zero-padded to whole blocks, viewed ``(n_blocks, block_size)``."""
    n = x.numel()
    padded = n_blocks(n, block_size) * block_size
    if padded != n:
        x = torch.cat([x, x.new_zeros(padded - n)])
    return x.view(-1, block_size)


def quantize_blocks(
    x: torch.Tensor, block_size: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 values ``(n,)`` and fp32 scales ``(ceil(n / block_size),)`` of flat ``x``.

    ``out``: (values, scales) buffers to write into, e.g. slices of an all-gather input.
    """
    if x.dim() != 1:
        raise ValueError(f"quantize_blocks takes a flat tensor, got shape {tuple(x.shape)}")
    n = x.numel()
    blocks = _blocked(x.detach().float(), block_size)  # (n_blocks, B)
    scales = blocks.abs().amax(dim=1) / QMAX  # (n_blocks,)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(blocks / safe[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    values = values.view(-1)[:n]
    if out is None:
        return values, scales
    out[0].copy_(values)
    out[1].copy_(scales)
    return out


def dequantize_blocks(
    values: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``values * scale`` of each element's block, as ``dtype`` ``(n,)`` (into ``out`` if given)."""
    n = values.numel()
    blocks = _blocked(values.float(), block_size) * scales.float()[:, None]
    result = blocks.view(-1)[:n]
    if out is None:
        return result.to(dtype)
    out.copy_(result)
    return out
