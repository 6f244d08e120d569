"""fp8 KV memory: the one definition of how a chunk's K/V is quantized and read back.

``INFERSCALE_KV_DTYPE=float8_e4m3fn`` stores every chunk's pre-RoPE K and V as float8
e4m3 (the "fn" variant: finite, max 448, what Hopper and vLLM's fp8 KV caches use) with
one float32 scale per (chunk, K/V, layer, KV head): ``scale = amax / 448`` over the
chunk's tokens and the head's dims, ``q = clamp(x / scale, -448, 448)`` rounded to
nearest, ``x' = q * scale``. Half the bytes of bf16 plus ``2 * L * H * 4`` bytes per
chunk (0.3% of a 40-token fact at the Llama-3.1-8B shape).

Why per chunk: a chunk's quantized bytes and scales are a function of its own K/V alone,
so content-keyed reuse stays byte-identical and a fact read alone from storage carries
its scales with it. Why not per token: measured on SmolLM2 (``benchmarks/README.md``,
"fp8 memory"), per-token scales remove only a fifth of the keys' error (0.026 -> 0.021
relative RMS; values 0.026 -> 0.025: the error is e4m3's three mantissa bits, not its
range) and would cost 3-6% more bytes.

A scale is read only within the bounds of :func:`storage_schemas.kv.check_scales` (every
reader) and of :func:`check_scales_for` (the serving worker, for its engine's dtype).

Imports only torch and the kv format's constants: every stage may use it (a shared
contract, beside ``inferscale.types``).
"""

from __future__ import annotations

import torch

from storage_schemas.kv import FLOAT32_TINY, FP8_MAX, max_scale

FP8 = "float8_e4m3fn"
FP8_DTYPE = torch.float8_e4m3fn
QUANTIZED = (FP8,)  # the stored dtypes that carry scales


def is_quantized(dtype: str | torch.dtype) -> bool:
    """True for a stored dtype (name or torch dtype) whose K/V need scales to be read."""
    return str(dtype).removeprefix("torch.") in QUANTIZED


def quantize(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's rows ``kv [T, 2, L, H, D]`` (any float dtype) -> fp8 rows
    ``[T, 2, L, H, D]`` and their scales ``[2, L, H]`` float32 (K, then V). A scale is
    never below the smallest normal float32 (readers refuse smaller ones): a head whose
    amax is below ``448 * tiny`` keeps that floor, its values still within fp8's range."""
    kv = kv.float()
    amax = kv.abs().amax(dim=(0, 4))  # [2, L, H]
    scales = torch.where(amax > 0, (amax / FP8_MAX).clamp(min=FLOAT32_TINY),
                         torch.ones_like(amax))
    q = (kv / scales[None, :, :, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales.contiguous()


def check_scales_for(scales: torch.Tensor, dtype: torch.dtype) -> None:
    """ValueError unless every scale (any shape, float32) is finite, at least the smallest
    normal float32 and small enough that the values it dequantizes, and the keys rotated
    from them, are finite in ``dtype`` (the engine's compute and cache dtype:
    :func:`storage_schemas.kv.max_scale`). The worker checks each slab once, when it
    arrives; the readers have checked the dtype-independent bounds already."""
    if not scales.numel():
        return
    top = max_scale(float(torch.finfo(dtype).max))
    low, high = float(scales.min()), float(scales.max())
    if not torch.isfinite(scales).all() or low < FLOAT32_TINY or high > top:
        name = str(dtype).removeprefix("torch.")
        raise ValueError(f"fp8 scales from {low:.4g} to {high:.4g} are outside "
                         f"[{FLOAT32_TINY:.4g}, {top:.4g}], where values dequantized (and "
                         f"rotated) in {name} stay finite")


def dequantize(rows: torch.Tensor, row_scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 rows ``[N, 2, L, H, D]`` times their scales ``[N, 2, L, H]`` (float32: one
    rounding to ``dtype``) -> ``[N, 2, L, H, D]`` in ``dtype``."""
    out = rows.to(torch.float32) * row_scales.to(rows.device, torch.float32)[..., None]
    return out if dtype == torch.float32 else out.to(dtype)


def dequantize_into(dst: torch.Tensor, rows: torch.Tensor, row_scales: torch.Tensor,
                    block: int = 4096) -> torch.Tensor:
    """:func:`dequantize` of ``rows`` written into ``dst`` (any layout, its dtype), a
    block of rows at a time (bounded temporaries); returns ``dst``."""
    for a in range(0, rows.shape[0], block):
        dst[a:a + block].copy_(dequantize(rows[a:a + block], row_scales[a:a + block]))
    return dst
