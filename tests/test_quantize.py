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

from fully_shard.quantize import QMAX, dequantize_blocks, n_blocks, quantize_blocks

FP32_EPS = torch.finfo(torch.float32).eps


def _check_bound(x: torch.Tensor, block: int, dtype: torch.dtype = torch.float32) -> None:
    q, s = quantize_blocks(x, block)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (n_blocks(x.numel(), block),)
    assert int(q.abs().max()) <= QMAX
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
    ["zeros", "one_outlier", "tiny", "constant", "alternating", "mixed_blocks", "bf16"],
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
