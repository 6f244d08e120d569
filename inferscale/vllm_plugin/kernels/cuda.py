"""The CUDA injection kernel (Triton): rotated K and V of every layer into the paged cache.

Imported only by :class:`inferscale.vllm_plugin.kernels.writer.FusedWriter` on a CUDA
engine.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def inject_kernel(src, s_tok, s_kv, s_layer, rows, pos, slots, cos_sin, cs_stride, cache0,
                  layer_off, kb, ko, kh, kd, vb, vo, vh, vd, k_off, v_off, block_size,
                  HEADS: tl.constexpr, DIM: tl.constexpr, BH: tl.constexpr,
                  BHALF: tl.constexpr, BDIM: tl.constexpr, NEOX: tl.constexpr):
    """One program per (token, layer): load the token's K and V of that layer from
    ``src`` (logical ``[T, 2, L, H, D]``, element strides ``s_tok``, ``s_kv``,
    ``s_layer``) at slab row ``rows[n]``, rotate K at ``pos[n]`` in float32 (one rounding
    to the cache dtype), and store both at ``slots[n]`` through the layout's strides
    (block, offset, head, dim). ``layer_off``: ``[L, 2]`` (layer index, element offset
    of that layer's cache from ``cache0``)."""
    n = tl.program_id(0)
    li = tl.program_id(1)
    half = DIM // 2
    r = tl.load(rows + n)
    p = tl.load(pos + n)
    s = tl.load(slots + n)
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
    cs = cos_sin + p * cs_stride
    co = tl.load(cs + ii, mask=ii < half).to(tl.float32)
    si = tl.load(cs + half + ii, mask=ii < half).to(tl.float32)
    base = cache0 + tl.load(layer_off + 2 * li + 1)
    out_t = cache0.dtype.element_ty
    kdst = base + k_off + b * kb + o * ko + hh * kh
    tl.store(kdst + xi * kd, (x * co - y * si).to(out_t), mask=mask)
    tl.store(kdst + yi * kd, (y * co + x * si).to(out_t), mask=mask)
    dd = tl.arange(0, BDIM)[None, :]
    vmask = (hh < HEADS) & (dd < DIM)
    val = tl.load(k + s_kv + dd, mask=vmask)
    tl.store(base + v_off + b * vb + o * vo + hh * vh + dd * vd, val.to(out_t), mask=vmask)
