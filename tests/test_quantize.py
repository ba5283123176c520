"""Block int8 quantization (``fully_shard.quantize``): the error bound, on random and adversarial
blocks.

The bound (module docstring of ``quantize.py``): every dequantized element is within half its
block's quantization step ``s_b / 2`` of the fp32 value, up to fp32 rounding of one multiply;
in bf16 the bf16 rounding of the result is added on top.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fully_shard.packing import copy_in, split_sizes, wire_dtype
from fully_shard.quantize import (
    PLAIN,
    QMAX,
    Int8BlockGather,
    dequantize_blocks,
    dequantize_into,
    n_blocks,
    quantize_blocks,
)

FP32_EPS = torch.finfo(torch.float32).eps


def _check_bound(x: torch.Tensor, block: int, dtype: torch.dtype = torch.float32) -> None:
    q, s = quantize_blocks(x, block)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (n_blocks(x.numel(), block),)
    assert int(q.abs().max()) <= QMAX
    # The scale is never rounded below max |x| / 127 (exactly, in float64): nothing clamps.
    padded = torch.cat([x, x.new_zeros(s.numel() * block - x.numel())]).view(-1, block)
    assert bool((s.double() * QMAX >= padded.abs().amax(dim=1).double()).all())
    assert bool((s > 0).all())
    y = dequantize_blocks(q, s, block, dtype)
    assert y.dtype == dtype
    step = s.repeat_interleave(block)[: x.numel()]  # each element's block scale
    bound = step / 2 + x.abs() * 2 * FP32_EPS  # half a step, plus fp32 rounding
    if dtype != torch.float32:
        bound = bound + y.float().abs() * torch.finfo(dtype).eps  # the narrower dtype's rounding
    err = (y.float() - x).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@settings(max_examples=60)
@given(
    n=st.integers(1, 2000),
    block=st.sampled_from([1, 7, 64, 256]),
    scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e4]),
    seed=st.integers(0, 2**16),
)
def test_random_blocks_are_within_half_a_step(n: int, block: int, scale: float, seed: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    _check_bound(x, block)


@pytest.mark.parametrize(
    "case",
    [
        "zeros",
        "one_outlier",
        "tiny",
        "subnormal",
        "below_127_subnormals",
        "constant",
        "alternating",
        "mixed_blocks",
        "bf16",
    ],
)
def test_adversarial_blocks_are_within_half_a_step(case: str) -> None:
    block = 256
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    if case == "zeros":
        x = torch.zeros(1000)
    elif case == "one_outlier":
        x[3] = 1e6  # coarsens block 0 only
    elif case == "tiny":
        x = x * 1e-38  # near fp32's smallest normal
    elif case == "subnormal":
        x = (
            torch.randint(-1000, 1001, (1000,), generator=torch.Generator().manual_seed(1))
            * 2.0**-149
        )
    elif case == "below_127_subnormals":
        # max |x| / 127 rounds to zero: the scale must be rounded up, not flush the block
        x = torch.randint(-50, 51, (1000,), generator=torch.Generator().manual_seed(2)) * 2.0**-149
    elif case == "constant":
        x = torch.full((1000,), -3.5)
    elif case == "alternating":
        x = torch.tensor([(-1.0) ** i * 127.5 for i in range(1000)])
    elif case == "mixed_blocks":
        x[:256] = 0.0
        x[256:512] *= 1e-20
    _check_bound(x, block, torch.bfloat16 if case == "bf16" else torch.float32)
    if case == "zeros":
        q, s = quantize_blocks(x, block)
        assert torch.equal(dequantize_blocks(q, s, block, torch.float32), x)  # exact
    if case == "below_127_subnormals":
        q, s = quantize_blocks(x, block)
        assert bool((s == 2.0**-149).all())  # one unit, not zero
        # multiples of the smallest subnormal, at most 127 of them: q * s is x itself
        assert torch.equal(dequantize_blocks(q, s, block, torch.float32), x)
    if case == "one_outlier":
        q, s = quantize_blocks(x, block)
        y = dequantize_blocks(q, s, block, torch.float32)
        # The other blocks keep their own fine scale.
        torch.testing.assert_close(y[256:], x[256:], atol=float(s[1:].max()) / 2, rtol=0)


def test_quantize_writes_into_given_buffers() -> None:
    x = torch.randn(300)
    values, scales = torch.empty(300, dtype=torch.int8), torch.empty(2)
    q, s = quantize_blocks(x, 256, out=(values, scales))
    assert q is values and s is scales
    ref_q, ref_s = quantize_blocks(x, 256)
    assert torch.equal(values, ref_q) and torch.equal(scales, ref_s)


def test_dequantize_into_blocks_each_row_on_its_own() -> None:
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randn(100, generator=gen) * 10.0**k for k in range(3)]  # (3, 100), 7 blocks
    packed = [quantize_blocks(r, 16) for r in rows]
    values = torch.stack([q for q, _ in packed])
    scales = torch.stack([s for _, s in packed])
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        out = torch.empty(3, 100, dtype=dtype)
        dequantize_into(out, values, scales, 16)
        for r, (q, s) in enumerate(packed):
            assert torch.equal(out[r], dequantize_blocks(q, s, 16, dtype)), (dtype, r)


def _gather_by_hand(fmt: Int8BlockGather, full: torch.Tensor, world: int, dim: int) -> torch.Tensor:
    """What a group's all-gather of ``full`` in ``fmt`` rebuilds, without processes.

    Each rank's inputs are copied into its slice of one wire buffer, as the group does; the
    (W, total) buffer is split into each input's column block and handed to ``rebuild``.
    """
    chunk = -(-full.size(dim) // world)
    padded_size = list(full.shape)
    padded_size[dim] = chunk
    shards = list(torch.chunk(full, world, dim)) + [
        full.narrow(dim, 0, 0) for _ in range(world - len(torch.chunk(full, world, dim)))
    ]
    per_rank = [
        fmt.inputs(s.contiguous(), torch.Size(padded_size), dim, full.dtype) for s in shards
    ]
    wire = wire_dtype([gi.dtype for gi in per_rank[0]])
    sizes = split_sizes(per_rank[0], wire)
    buffer = torch.empty(world, sum(sizes), dtype=wire)
    for r, inputs in enumerate(per_rank):
        copy_in(buffer[r], inputs)
    storage = torch.empty(*padded_size[:dim], world * chunk, *padded_size[dim + 1 :])
    ranked = storage.view(*padded_size[:dim], world, chunk, *padded_size[dim + 1 :]).movedim(dim, 0)
    fmt.rebuild(list(torch.split(buffer, sizes, dim=1)), ranked)
    return storage.narrow(dim, 0, full.size(dim))


@pytest.mark.parametrize(("world", "dim"), [(1, 0), (3, 0), (4, 0), (3, 1), (2, 1)])
def test_int8_format_rebuilds_each_ranks_blocks(world: int, dim: int) -> None:
    full = torch.randn(10, 7, generator=torch.Generator().manual_seed(world))
    full[:, 3] *= 50  # one large column: blocks that hold it are coarser
    fmt = Int8BlockGather(block_size=5)
    got = _gather_by_hand(fmt, full, world, dim)
    # The same thing, shard by shard: padded, flattened, quantized, dequantized.
    chunk = -(-full.size(dim) // world)
    for r in range(world):
        start = min(r * chunk, full.size(dim))
        rows = min(chunk, full.size(dim) - start)
        padded_size = list(full.shape)
        padded_size[dim] = chunk
        padded = torch.zeros(padded_size)
        padded.narrow(dim, 0, rows).copy_(full.narrow(dim, start, rows))
        q, s = quantize_blocks(padded.flatten(), 5)
        want = dequantize_blocks(q, s, 5, torch.float32).view(padded_size).narrow(dim, 0, rows)
        assert torch.equal(got.narrow(dim, start, rows), want), r
    assert not torch.equal(got, full)


def test_plain_format_is_the_shard_itself() -> None:
    full = torch.randn(10, 7, generator=torch.Generator().manual_seed(0))
    (gi,) = PLAIN.inputs(full[:4], torch.Size([4, 7]), 0, torch.bfloat16)
    assert gi.data is not None and gi.dtype == torch.bfloat16 and PLAIN.direct
    assert not Int8BlockGather(256).direct
