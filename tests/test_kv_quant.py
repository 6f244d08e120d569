"""fp8 quantization of a chunk's K/V (inferscale.kv_quant): the error bound of e4m3 with
per (K/V, layer, head) scales, for any values Hypothesis finds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.kv_quant import FP8_MAX, check_scales_for, dequantize, is_quantized, quantize


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 3), T=st.integers(1, 9), H=st.integers(1, 3), D=st.integers(1, 8),
       exponent=st.integers(-30, 30), seed=st.integers(0, 2 ** 16), zero_head=st.booleans())
def test_quantize_round_trip_within_one_fp8_rounding(L, T, H, D, exponent, seed, zero_head):
    g = torch.Generator().manual_seed(seed)
    kv = torch.stack([torch.randn(T, L, H, D, generator=g) * 2.0 ** exponent,
                      torch.randn(T, L, H, D, generator=g).pow(3) * 2.0 ** -exponent],
                     dim=1)  # [T, 2, L, H, D]; values heavy-tailed
    if zero_head:
        kv[:, 0, :, 0] = 0
    rows, sc = quantize(kv)
    assert rows.dtype == torch.float8_e4m3fn and rows.shape == kv.shape
    assert sc.shape == (2, L, H) and torch.isfinite(sc).all() and (sc > 0).all()
    back = dequantize(rows, sc.expand(T, -1, -1, -1))
    for i in range(2):
        x, got = kv[:, i], back[:, i]  # [T, L, H, D]
        scale = sc[i][None, :, :, None]  # [1, L, H, 1]
        # e4m3: 3 mantissa bits (half a step: 2^-4 relative); subnormals below 2^-6
        bound = torch.maximum(x.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-6)
        assert ((got - x).abs() <= bound).all()
        assert (got.abs() <= scale * FP8_MAX * (1 + 1e-6)).all()  # saturated at the amax
    if zero_head:
        assert (rows[:, 0, :, 0].float() == 0).all() and (sc[0, :, 0] == 1).all()


def test_is_quantized_names():
    assert is_quantized("float8_e4m3fn") and is_quantized(torch.float8_e4m3fn)
    assert not is_quantized("bfloat16") and not is_quantized(torch.float32)


def test_a_tiny_head_keeps_a_normal_scale():
    """A head whose values are all far below float32's normal range gets the smallest
    normal scale (readers refuse a subnormal one), and still reads back within fp8."""
    from storage_schemas.kv import FLOAT32_TINY

    kv = torch.stack([torch.full((2, 1, 1, 4), 1e-40), torch.ones(2, 1, 1, 4)], dim=1)
    rows, sc = quantize(kv)  # [T=2, 2, L=1, H=1, D=4]
    assert float(sc[0, 0, 0]) == FLOAT32_TINY and float(sc[1, 0, 0]) == float(torch.tensor(1 / FP8_MAX))
    assert torch.isfinite(rows[:, 0].float()).all()


@pytest.mark.parametrize("dtype, ok, bad", [
    (torch.float16, 103.0, 147.0), (torch.bfloat16, 5e35, 7.6e35),
    (torch.float32, 5e35, 7.6e35)])
def test_scales_for_the_engine_dtype(dtype, ok, bad):
    """The worker's bound: dequantized values, and keys rotated from them, finite in the
    engine's dtype (float16 overflows at 65504: 448 * 147 does)."""
    check_scales_for(torch.tensor([1.0, ok]), dtype)
    for value in (bad, float("nan"), 1e-40, 0.0):
        with pytest.raises(ValueError, match="stay finite"):
            check_scales_for(torch.tensor([1.0, value]), dtype)
    rows = torch.full((1, 2, 1, 1, 1), FP8_MAX).to(torch.float8_e4m3fn)
    assert torch.isfinite(dequantize(rows, torch.full((1, 2, 1, 1), ok), dtype)
                          * 2 ** 0.5).all()
