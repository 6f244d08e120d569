"""Fused memory injection: the one entry point of the kernels. One kernel per source slab
writes rotated K and V of every layer straight into vLLM's paged cache.

The generic path (:mod:`inferscale.vllm_plugin.inject`) gathers the needed rows into a
staging buffer, rotates every key with the model's rotary op and then calls the backend's
cache writer once per layer: three passes over the K/V bytes and 30-40 writer calls per
step. Where the cache layout is known (:func:`inferscale.vllm_plugin.compat.cache_layout`)
one kernel does it all in a single pass, reading each needed slab row once:

- CUDA: a Triton kernel (:mod:`inferscale.vllm_plugin.kernels.cuda`), one program per
  (token, layer); rotation in float32, rounded once to the cache dtype (as the compiled
  model's fused rotary does). fp8 slabs are dequantized in the same pass (their scales
  travel with the step's indices, :mod:`~inferscale.vllm_plugin.kernels.indices`), and
  an fp8 cache (``kv_cache_dtype="fp8"``) is written as vLLM's writer does: divided by
  the layer's scales and saturated to fp8.
- CPU: a Numba kernel (:mod:`inferscale.vllm_plugin.kernels.cpu`, code in
  :mod:`~inferscale.vllm_plugin.kernels.cpu_jit`) over (layer, block tile); rotation with
  the same rounding as vLLM-CPU's rotary op (fused multiply-adds, or on AVX2 machines each
  product rounded: the self-check keeps the one that matches), so float32 keys are
  bit-identical to the prefill path. CPU slabs are kept layer-major
  (:mod:`inferscale.hydrate.resident`) so that each thread streams one layer's rows.

Owned by the connector's worker half: :meth:`FusedWriter.build` runs once when the
model is attached (``inferscale_attach``) and checks the kernel against the backend's own
writer on scratch blocks; any disagreement, unknown layout or missing compiler leaves the
connector on the generic path and says why (``FusedWriter.reason``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
import torch

from inferscale.kv_quant import FP8_DTYPE, dequantize, quantize
from inferscale.vllm_plugin.compat import (
    CacheLayout, cache_layout, cache_scales, rotate_with_model, write_layer_kv,
)
from inferscale.vllm_plugin.kernels.indices import (
    INDEX_CAPACITY, SCALE_CAPACITY, IndexBuffers, Source, batches,
)

log = logging.getLogger("vllm.inferscale.kernels")


def slot_tiles(slots: np.ndarray, block_size: int) -> np.ndarray:
    """``[M, 4]`` int64 tiles ``(first token, count, block, first offset)``: maximal runs
    of tokens whose slots are consecutive inside one block."""
    s = np.asarray(slots, dtype=np.int64)
    if s.size == 0:
        return np.zeros((0, 4), dtype=np.int64)
    cut = np.flatnonzero((np.diff(s) != 1) | (np.diff(s // block_size) != 0)) + 1
    starts = np.concatenate([[0], cut])
    counts = np.diff(np.concatenate([starts, [s.size]]))
    return np.stack([starts, counts, s[starts] // block_size, s[starts] % block_size],
                    axis=1).astype(np.int64)


def flat_numpy(t: torch.Tensor) -> np.ndarray | None:
    """A 1-D numpy view of ``t``'s elements (any dense stride order) starting at its
    first element, or None if ``t`` does not cover one dense block of memory."""
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    dense = t.permute(order)
    if not dense.is_contiguous():
        return None
    return dense.reshape(-1).numpy()


# ----------------------------------------------------------------------------- writer


class FusedWriter:
    """Writes rotated K/V of all layers for a list of :class:`Source` in one kernel each.

    Build it with :meth:`build` (an engine's layers; :meth:`over` for known caches
    without an engine); ``writer.ok`` says whether it may be used and ``writer.reason``
    why not.
    """

    def __init__(self, layers: list[tuple[int, Any]], rotary: torch.nn.Module,
                 dtype: torch.dtype):
        self.layers = layers
        self.rotary = rotary
        self.dtype = dtype
        self.ok = False
        self.reason = "not built"
        self.kind = ""
        self.layout: CacheLayout | None = None
        self._kernel: Any = None
        self._fma = True  # the CPU kernel's rounding, as the backend's (cpu_jit)

    # -------------------------------------------------------------- construction

    @classmethod
    def build(cls, layers: list[tuple[int, Any]], rotary: torch.nn.Module, dtype: torch.dtype,
              place: Callable[[torch.Tensor], torch.Tensor] | None = None) -> "FusedWriter":
        """Pick the kernel for the layers' device and check it against the backend's
        writer on a random slab passed through ``place`` (how the resident store places
        real slabs: device, layout)."""
        w = cls(layers, rotary, dtype)
        try:
            w._prepare()
            w._self_check(place or (lambda slab: slab))
            w.ok, w.reason = True, "checked against the backend's writer"
        except Exception as exc:  # noqa: BLE001 - any failure means the generic path
            w.ok, w.reason = False, f"{type(exc).__name__}: {exc}"
        log.info("fused injection %s (%s)", "on, " + w.kind if w.ok else "off", w.reason)
        return w

    def _prepare(self) -> None:
        if not self.layers:
            raise RuntimeError("no attention layers")
        first = self.layers[0][1]
        layout = cache_layout(first)
        if layout is None:
            raise RuntimeError(f"cache layout of {type(first.impl).__name__} is not known")
        for _, layer in self.layers:
            kv = layer.kv_cache
            if (kv.shape, kv.stride(), kv.dtype) != (first.kv_cache.shape,
                                                     first.kv_cache.stride(),
                                                     first.kv_cache.dtype):
                raise RuntimeError("layers' caches differ in shape, stride or dtype")
            if cache_layout(layer) != layout:
                raise RuntimeError("layers' cache layouts differ")
        rot = self.rotary
        if getattr(rot, "rotary_dim", layout.head_size) != layout.head_size or \
                not hasattr(rot, "cos_sin_cache"):
            raise RuntimeError("only full-dimension rotary embeddings with a cos/sin cache")
        if not layout.quantized and first.kv_cache.dtype != self.dtype:
            raise RuntimeError(f"cache dtype {first.kv_cache.dtype} is not the model's")
        self.layout = layout
        self.blocks = first.kv_cache.shape[0]  # every layer's cache: [B, ...]
        self.neox = bool(getattr(rot, "is_neox_style", True))
        device = first.kv_cache.device
        self.cos_sin = rot.cos_sin_cache.to(device=device, dtype=(
            torch.float32 if device.type == "cpu" else self.dtype))  # [P, D]
        if device.type == "cuda":
            self._setup_triton(device)
        else:
            if layout.quantized or self.dtype != torch.float32:
                raise RuntimeError("the CPU kernel handles float32 models only")
            self.kind = "numba"
            arrays = [flat_numpy(layer.kv_cache) for _, layer in self.layers]
            if any(a is None for a in arrays):
                raise RuntimeError("a layer's cache is not dense")
            self._layer_idx = np.asarray([i for i, _ in self.layers], dtype=np.int64)
            self._cos_sin_np = self.cos_sin.numpy()
            self._ks = np.asarray(layout.k_strides, dtype=np.int64)
            self._vs = np.asarray(layout.v_strides, dtype=np.int64)
            self._arrays = arrays

    def _setup_triton(self, device: torch.device) -> None:
        from inferscale.vllm_plugin.kernels.cuda import inject_kernel

        self.kind, self._kernel = "triton", inject_kernel
        base = self.layers[0][1].kv_cache
        size = base.element_size()
        offs = [(idx, (layer.kv_cache.data_ptr() - base.data_ptr()) // size)
                for idx, layer in self.layers]
        self._layer_off = torch.tensor(offs, dtype=torch.int64, device=device)  # [L, 2]
        self._layer_idx = np.asarray([i for i, _ in self.layers], dtype=np.int64)
        self._indices = IndexBuffers(INDEX_CAPACITY, device)
        # the cache's own scales per layer row [L, 2, H] (fp8 caches; else unused)
        self._out_scales = (cache_scales([layer for _, layer in self.layers],
                                         self.layout.num_heads) if self.layout.quantized
                            else torch.ones(1, dtype=torch.float32, device=device))

    @classmethod
    def over(cls, caches: list[tuple[int, torch.Tensor]], layout: CacheLayout,
             cos_sin: torch.Tensor, dtype: torch.dtype, neox: bool = True) -> "FusedWriter":
        """The Triton writer over CUDA paged caches of a known float ``layout`` (one
        ``(layer index, cache)`` per layer, every cache ``[B, ...]`` of one storage) and a
        cos/sin table ``[P, D]``, without an engine's attention layers: what
        ``benchmarks.inject_kernel`` times. Unlike :meth:`build` nothing checks it against
        a backend's writer (there is none); the unit tests check the kernel."""
        device = caches[0][1].device
        if device.type != "cuda" or layout.quantized:
            raise ValueError("FusedWriter.over takes float CUDA caches")
        w = cls([(i, _CacheOnly(kv)) for i, kv in caches], None, dtype)
        w.layout, w.blocks, w.neox = layout, caches[0][1].shape[0], neox
        w.cos_sin = cos_sin.to(device=device, dtype=dtype)  # [P, D]
        w._setup_triton(device)
        w.ok, w.reason = True, "built over known caches (not checked)"
        return w

    # -------------------------------------------------------------- writing

    def write(self, sources: list[Source]) -> None:
        """Write every source's tokens into every layer (enqueued on CUDA, not awaited)."""
        if self.kind == "numba":
            for src in sources:
                self._write_cpu(src, self._caches, self._layer_idx, self.blocks)
        else:
            self._write_cuda(sources)

    def check_source(self, src: Source, layer_idx: np.ndarray, blocks: int) -> None:
        """RuntimeError unless the kernel can write ``src`` into caches of ``blocks``
        blocks without leaving its slots: the slab's heads x dim are the cache's (the
        kernels take them from the slab and write through the cache's strides: a slab
        regrouped as ``[L, 2H, D/2]`` would write heads H.. into the next block), it has
        every layer written, and each token's row, position, slot and scales row is in
        range (the Numba kernel runs without bounds checks). Once per launch, over the
        launch's index arrays; nothing per token on the device."""
        lay, slab = self.layout, src.slab
        if slab.dim() != 5 or slab.shape[1] != 2 or \
                (slab.shape[3], slab.shape[4]) != (lay.num_heads, lay.head_size):
            raise RuntimeError(f"slab {list(slab.shape)} is not [T, 2, L, H={lay.num_heads}, "
                               f"D={lay.head_size}] of the paged cache")
        if len(layer_idx) and int(layer_idx.max()) >= slab.shape[2]:
            raise RuntimeError(f"slab of {slab.shape[2]} layers for layer {layer_idx.max()}")
        n = len(src.rows)
        if len(src.positions) != n or len(src.slots) != n:
            raise RuntimeError("a source's rows, positions and slots differ in length")
        for name, values, bound in (("row", src.rows, slab.shape[0]),
                                    ("position", src.positions, self.cos_sin.shape[0]),
                                    ("slot", src.slots, blocks * lay.block_size)):
            if n and (int(values.min()) < 0 or int(values.max()) >= bound):
                raise RuntimeError(f"a {name} outside [0, {bound})")
        if src.scales is not None:
            if tuple(src.scales.shape[1:]) != (2, *slab.shape[2:4]) or src.scale_rows is None \
                    or len(src.scale_rows) != n or (n and (
                        int(src.scale_rows.min()) < 0
                        or int(src.scale_rows.max()) >= src.scales.shape[0])):
                raise RuntimeError(f"scales {list(src.scales.shape)} do not fit the slab "
                                   f"{list(slab.shape)} and its tokens")

    def _write_cpu(self, src: Source, caches: Any, layer_idx: np.ndarray, blocks: int) -> None:
        lay = self.layout
        if src.scales is not None:  # a CPU store dequantizes fp8 slabs when it places them
            raise RuntimeError("the CPU kernel reads float slabs only")
        self.check_source(src, layer_idx, blocks)
        flat = flat_numpy(src.slab)
        if flat is None:
            raise RuntimeError("slab is not dense")
        s_tok, s_kv, s_layer = src.slab.stride(0), src.slab.stride(1), src.slab.stride(2)
        _, _, _, heads, dim = src.slab.shape
        self._kernel(flat, s_tok, s_kv, s_layer, src.rows, src.positions,
                     slot_tiles(src.slots, lay.block_size), self._cos_sin_np, caches,
                     layer_idx, self._ks, self._vs, lay.k_offset, lay.v_offset,
                     heads, dim, self.neox, self._fma)

    def _write_cuda(self, sources: list[Source], cache0: torch.Tensor | None = None,
                    layer_off: torch.Tensor | None = None,
                    out_scales: torch.Tensor | None = None,
                    probe: tuple[np.ndarray, int] | None = None) -> None:
        """``probe``: (layer indices, blocks) of the scratch cache ``cache0`` stands for."""
        layer_idx, blocks = probe or (self._layer_idx, self.blocks)
        for src in sources:
            self.check_source(src, layer_idx, blocks)
        for batch in batches(sources, INDEX_CAPACITY, SCALE_CAPACITY):
            self._launch(batch, cache0, layer_off, out_scales)

    def _launch(self, sources: list[Source], cache0: torch.Tensor | None,
                layer_off: torch.Tensor | None, out_scales: torch.Tensor | None) -> None:
        import triton

        lay = self.layout
        cache0 = self.layers[0][1].kv_cache if cache0 is None else cache0
        if lay.quantized:  # vLLM keeps fp8 caches as uint8 and views them as fp8
            cache0 = cache0.view(FP8_DTYPE)
        layer_off = self._layer_off if layer_off is None else layer_off
        out_scales = self._out_scales if out_scales is None else out_scales
        # [4, n_all] int64 on the device, aligned; the packed scales of fp8 sources
        idx, n_all, scales = self._indices.fill(sources)
        at = 0
        for src in sources:
            n = len(src.rows)
            _, _, layers, heads, dim = src.slab.shape
            self._kernel[(n, layer_off.shape[0])](
                src.slab, src.slab.stride(0), src.slab.stride(1), src.slab.stride(2),
                idx, at, n_all, scales, 2 * layers * heads, layers * heads,
                self.cos_sin, self.cos_sin.stride(0), cache0, layer_off, out_scales,
                *lay.k_strides, *lay.v_strides, lay.k_offset, lay.v_offset, lay.block_size,
                HEADS=heads, DIM=dim, BH=triton.next_power_of_2(heads),
                BHALF=triton.next_power_of_2(dim // 2), BDIM=triton.next_power_of_2(dim),
                NEOX=self.neox, SCALED=src.scales is not None, QUANT_OUT=lay.quantized)
            at += n

    # -------------------------------------------------------------- self-check

    def _self_check(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Write probes with the kernel and with the generic path (the model's rotary op +
        the backend's writer) into scratch blocks of the first layer's cache shape; they
        must agree (exactly on CPU; within one rounding of the cache dtype on CUDA). On
        CUDA a second probe is an fp8 slab (dequantized in float32 for the generic path)."""
        try:
            self._probe(place, fp8=False)
        except RuntimeError:  # vLLM-CPU's rotary op rounds each product on AVX2 machines
            if self.kind != "numba" or not self._fma:
                raise
            self._fma = False
            self._probe(place, fp8=False)
        if self.kind == "triton":
            self._probe(place, fp8=True)

    def _probe(self, place: Callable[[torch.Tensor], torch.Tensor], fp8: bool) -> None:
        idx, layer = self.layers[0]
        lay = self.layout
        kv = layer.kv_cache
        device, bs = kv.device, lay.block_size
        gen = torch.Generator().manual_seed(0)
        n = 2 * bs + 3
        shape = (n + 5, 2, idx + 1, lay.num_heads, lay.head_size)
        slab = torch.randn(shape, generator=gen)
        rows = torch.randperm(slab.shape[0], generator=gen)[:n].sort().values.numpy()
        positions = (np.arange(n) + 7).astype(np.int64)
        blocks = 4
        slots = np.concatenate([np.arange(bs - 3, bs), 2 * bs + np.arange(n - 3)]).astype(
            np.int64)
        want, got = _scratch_like(kv, blocks), _scratch_like(kv, blocks)
        scales = None
        if fp8:  # the whole probe one chunk: [1, 2, L, H] scales
            slab, sc = quantize(slab)
            slab, scales = slab.to(device), sc[None]
            pre = dequantize(slab[torch.from_numpy(rows).to(device)],
                             scales.expand(n, -1, -1, -1), self.dtype)[:, :, idx]
        else:
            slab = place(slab.to(self.dtype)).to(device)
            pre = slab[torch.from_numpy(rows).to(slab.device)][:, :, idx].to(device, self.dtype)
        # generic: gather, rotate with the model's op, write with the backend's writer
        k = pre[:, 0].contiguous()  # [n, H, D]
        rotate_with_model(self.rotary, torch.from_numpy(positions).to(device), k)
        write_layer_kv(layer, k, pre[:, 1].contiguous(),
                       torch.from_numpy(slots).to(device), kv_cache=want)
        src = Source(slab, rows, positions, slots, scales,
                     np.zeros(n, dtype=np.int64) if fp8 else None)
        if self.kind == "numba":
            from inferscale.vllm_plugin.kernels.cpu import load

            def first_call(kernel: Any) -> None:  # compiles, starts Numba's threads
                from numba.typed import List

                self._kernel = kernel
                self._caches = List(self._arrays)
                self._write_cpu(src, List([flat_numpy(got)]), np.asarray([idx], dtype=np.int64),
                                blocks)

            load(first_call)
        else:
            self._write_cuda([src], cache0=got, layer_off=torch.tensor(
                [[idx, 0]], dtype=torch.int64, device=device),
                out_scales=self._out_scales[idx:idx + 1] if lay.quantized else None,
                probe=(np.asarray([idx], dtype=np.int64), blocks))
            torch.cuda.synchronize(device)
        if lay.quantized:  # compare fp8 codes as numbers: within one fp8 rounding
            want, got = want.view(FP8_DTYPE), got.view(FP8_DTYPE)
        (wk, wv), (gk, gv) = lay.views(want), lay.views(got)
        b, o = torch.from_numpy(slots // bs).to(device), torch.from_numpy(slots % bs).to(device)
        what = "fp8 probe: " if fp8 else ""
        if lay.quantized:
            _close(wv[b, o], gv[b, o], 0.125, what + "values")
        elif not torch.equal(wv[b, o], gv[b, o]):
            raise RuntimeError(what + "values differ from the backend writer's")
        rel = 0.0 if self.kind == "numba" else \
            0.125 if lay.quantized else 2 * torch.finfo(self.dtype).eps
        _close(wk[b, o], gk[b, o], rel, what + "keys")


class _CacheOnly:
    """A layer as :meth:`FusedWriter.over` keeps it: its paged cache only."""

    def __init__(self, kv_cache: torch.Tensor):
        self.kv_cache = kv_cache


def _close(want: torch.Tensor, got: torch.Tensor, rel: float, what: str) -> None:
    err = (want.float() - got.float()).abs().max().item()
    tol = rel * want.float().abs().max().item()
    if err > tol:
        raise RuntimeError(f"{what} differ from the backend writer's by {err:g} (> {tol:g})")


def _scratch_like(kv: torch.Tensor, blocks: int) -> torch.Tensor:
    """Zeros with ``kv``'s stride order and per-block shape, ``blocks`` blocks."""
    order = sorted(range(kv.dim()), key=lambda i: -kv.stride(i))
    shape = (blocks, *kv.shape[1:])
    dense = torch.zeros([shape[i] for i in order], dtype=kv.dtype, device=kv.device)
    return dense.permute([order.index(i) for i in range(kv.dim())])
