"""The CUDA injection kernel (Triton): rotated K and V of every layer into the paged cache.

Imported only by :class:`inferscale.vllm_plugin.kernels.writer.FusedWriter` on a CUDA
engine.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # float8 e4m3fn (``inferscale.kv_quant.FP8_MAX``); a global
# a @jit function reads must be a constexpr (compiled Triton refuses others)


# Triton compiles one variant per pattern of "integer is 1 / divisible by 16" and "pointer
# is 16-byte aligned" over the arguments. A cold compile takes hundreds of ms on the
# engine's thread, stalling every request in flight, so nothing that changes between
# steps may be specialized on: the per-step index columns are addressed through one
# buffer that always starts aligned (``idx``) plus an unspecialized column offset
# (``at``) and row length (``n_all``), and the source slab's strides are unspecialized
# too. The scales of fp8 sources arrive in one buffer that always starts aligned
# (``scl``), each token's row of it named by the index's fourth column, its strides
# unspecialized (``2 * L * H`` and ``L * H`` of the source: the start-up probe's slab has
# one layer, 8 heads give 8 there and 256 at 32 layers), and the cache's own scales sit
# in a table built once (``out_scl``). Every step then runs the variants the start-up
# warm-up compiled (one per source kind: float, fp8).
@triton.jit(do_not_specialize=["s_tok", "s_kv", "s_layer", "at", "n_all", "sc_row", "sc_kv"])
def inject_kernel(src, s_tok, s_kv, s_layer, idx, at, n_all, scl, sc_row, sc_kv, cos_sin,
                  cs_stride, cache0, layer_off, out_scl, kb, ko, kh, kd, vb, vo, vh, vd,
                  k_off, v_off, block_size,
                  HEADS: tl.constexpr, DIM: tl.constexpr, BH: tl.constexpr,
                  BHALF: tl.constexpr, BDIM: tl.constexpr, NEOX: tl.constexpr,
                  SCALED: tl.constexpr, QUANT_OUT: tl.constexpr):
    """One program per (token, layer): load the token's K and V of that layer from
    ``src`` (logical ``[T, 2, L, H, D]``, element strides ``s_tok``, ``s_kv``,
    ``s_layer``) at slab row ``idx[0, at + n]``, rotate K at position ``idx[1, at + n]``
    in float32 (one rounding to the cache dtype), and store both at slot
    ``idx[2, at + n]`` through the layout's strides (block, offset, head, dim). ``idx``:
    ``[4, n_all]`` int64; ``layer_off``: ``[L, 2]`` (layer index, element offset of
    that layer's cache from ``cache0``).

    ``SCALED`` (an fp8 source): K and V are multiplied by their scales first, in the same
    pass: ``scl`` holds float32 rows ``[2, L, H]`` (K, V; strides ``sc_row``, ``sc_kv``),
    the token's row at ``idx[3, at + n]``. ``QUANT_OUT`` (an fp8 cache): what is stored
    is ``x / scale`` saturated to fp8, with the layer's cache scales ``out_scl[li]``
    (``[2, H]``: K, V), as vLLM's cache writer stores it."""
    n = tl.program_id(0)
    li = tl.program_id(1)
    half = DIM // 2
    col = idx + at + n
    r = tl.load(col)
    p = tl.load(col + n_all)
    s = tl.load(col + 2 * n_all)
    b = s // block_size
    o = s % block_size
    hh = tl.arange(0, BH)[:, None]
    ii = tl.arange(0, BHALF)[None, :]
    mask = (hh < HEADS) & (ii < half)
    if NEOX:
        xi = ii
        yi = ii + half
    else:
        xi = 2 * ii
        yi = 2 * ii + 1
    layer = tl.load(layer_off + 2 * li)
    k = src + r * s_tok + layer * s_layer + hh * DIM
    x = tl.load(k + xi, mask=mask).to(tl.float32)
    y = tl.load(k + yi, mask=mask).to(tl.float32)
    if SCALED:
        sc = scl + tl.load(col + 3 * n_all) * sc_row + layer * HEADS + hh  # [BH, 1]
        k_scale = tl.load(sc, mask=hh < HEADS, other=1.0)
        v_scale = tl.load(sc + sc_kv, mask=hh < HEADS, other=1.0)
        x = x * k_scale
        y = y * k_scale
    cs = cos_sin + p * cs_stride
    co = tl.load(cs + ii, mask=ii < half).to(tl.float32)
    si = tl.load(cs + half + ii, mask=ii < half).to(tl.float32)
    base = cache0 + tl.load(layer_off + 2 * li + 1)
    out_t = cache0.dtype.element_ty
    kx = x * co - y * si
    ky = y * co + x * si
    if QUANT_OUT:
        osc = out_scl + li * 2 * HEADS + hh
        ok = tl.load(osc, mask=hh < HEADS, other=1.0)
        kx = tl.minimum(tl.maximum(kx / ok, -FP8_MAX), FP8_MAX)
        ky = tl.minimum(tl.maximum(ky / ok, -FP8_MAX), FP8_MAX)
    kdst = base + k_off + b * kb + o * ko + hh * kh
    tl.store(kdst + xi * kd, kx.to(out_t), mask=mask)
    tl.store(kdst + yi * kd, ky.to(out_t), mask=mask)
    dd = tl.arange(0, BDIM)[None, :]
    vmask = (hh < HEADS) & (dd < DIM)
    val = tl.load(k + s_kv + dd, mask=vmask)
    if SCALED:
        val = val.to(tl.float32) * v_scale
    if QUANT_OUT:
        ov = tl.load(out_scl + li * 2 * HEADS + HEADS + hh, mask=hh < HEADS, other=1.0)
        val = tl.minimum(tl.maximum(val.to(tl.float32) / ov, -FP8_MAX), FP8_MAX)
    tl.store(base + v_off + b * vb + o * vo + hh * vh + dd * vd, val.to(out_t), mask=vmask)
