"""The fused injection kernels against vLLM's own rotary op and cache writers.

CPU: vLLM-CPU's real attention backend and rotary module (no engine needed). CUDA's
Triton kernel: under Triton's CPU interpreter, against an independent computation in the
FlashAttention layout (the same kernel runs compiled on the H200; see benchmarks/gpu).
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from inferscale.hydrate.resident import layer_major
from inferscale.vllm_plugin.compat import (
    cache_layout, read_layer_kv, rotate_with_model, write_layer_kv,
)
from inferscale.vllm_plugin.kernels.writer import FusedWriter, Source, flat_numpy, slot_tiles
from tests.vllm_plugin.cpu_attention import cpu_layers

REPO = Path(__file__).resolve().parents[2]


def test_slot_tiles_split_at_blocks_and_gaps():
    tiles = slot_tiles(np.array([13, 14, 15, 16, 17, 40, 41]), 16)
    assert tiles.tolist() == [[0, 3, 0, 13], [3, 2, 1, 0], [5, 2, 2, 8]]
    assert slot_tiles(np.array([], dtype=np.int64), 16).shape == (0, 4)


def test_launch_batches_respect_token_and_scale_capacities():
    """A step's sources are cut into launches of at most ``capacity`` tokens and scale
    values (distinct chunk rows x 2 * L * H floats), splitting a source by rows."""
    from inferscale.vllm_plugin.kernels.indices import batches

    slab = torch.zeros(40, 2, 2, 3, 4)
    scales = torch.ones(10, 2, 2, 3)  # 12 floats per chunk row
    n = 30
    fp8 = Source(slab, np.arange(n), np.arange(n), np.arange(n), scales,
                 np.repeat(np.arange(10), 3))  # 10 chunks of 3 tokens
    plain = Source(slab, np.arange(5), np.arange(5), np.arange(5))
    cut = batches([plain, fp8], capacity=16, scale_capacity=4 * 12)
    # chunk 3 straddles the first cut: its scales travel in both launches
    assert [sum(len(s.rows) for s in b) for b in cut] == [5 + 11, 10, 9]
    for b in cut:  # at most 4 distinct chunk rows of scales per launch
        assert sum(len(np.unique(s.scale_rows)) for s in b if s.scales is not None) <= 4
    got = np.concatenate([s.scale_rows for b in cut for s in b if s.scales is not None])
    assert got.tolist() == fp8.scale_rows.tolist()  # nothing lost, in order
    with pytest.raises(ValueError, match="exceed"):
        batches([fp8], capacity=16, scale_capacity=8)


def test_flat_numpy_views_layer_major_slabs_without_copying():
    slab = torch.randn(5, 2, 3, 2, 4)
    lm = layer_major(slab)
    assert torch.equal(lm, slab) and lm.shape == slab.shape
    flat = flat_numpy(lm)
    assert flat.size == slab.numel()
    assert flat.ctypes.data == lm.data_ptr()
    assert flat_numpy(slab[:, :, 1]) is None  # a strided slice is not one dense block


def generic_write(layers, rope, slab, rows, positions, slots):
    """The generic path: gather, the model's rotary op, the backend's writer per layer."""
    pre = slab[torch.from_numpy(rows)].clone()  # [N, 2, L, H, D]
    n, _, L, H, D = pre.shape
    rotate_with_model(rope, torch.from_numpy(positions), pre[:, 0].reshape(n, L * H, D))
    for i, layer in layers:
        write_layer_kv(layer, pre[:, 0, i], pre[:, 1, i], torch.from_numpy(slots))


def test_cpu_kernel_is_bit_identical_to_rotary_op_and_backend_writer(cpu_backend):
    from vllm.config import set_current_vllm_config

    L, bs = 4, 16
    g = torch.Generator().manual_seed(1)
    slab = torch.randn((90, 2, L, cpu_backend.heads, cpu_backend.dim), generator=g)
    rows = np.concatenate([np.arange(40, 52), np.arange(3, 20), np.arange(70, 75)])
    positions = np.arange(rows.size, dtype=np.int64) + 11
    # a load that starts mid-block and runs over non-consecutive blocks
    blocks = np.array([7, 2, 30])
    slots = (blocks[:, None] * bs + np.arange(bs)).reshape(-1)[5:5 + rows.size]
    with set_current_vllm_config(cpu_backend.config):
        fused_layers, ref_layers = cpu_layers(cpu_backend, L), cpu_layers(cpu_backend, L)
        writer = FusedWriter.build(fused_layers, cpu_backend.rope, torch.float32,
                                   place=layer_major)
        assert writer.ok and writer.kind == "numba", writer.reason
        writer.write([Source(layer_major(slab), rows, positions, slots)])
        generic_write(ref_layers, cpu_backend.rope, slab, rows, positions, slots)
    for (_, a), (_, b) in zip(fused_layers, ref_layers):
        assert torch.equal(a.kv_cache, b.kv_cache)
    # and the layout reads back what the backend wrote
    got_k, got_v = read_layer_kv(ref_layers[2][1], torch.from_numpy(slots), bs)
    assert torch.equal(got_v, slab[torch.from_numpy(rows), 1, 2])
    assert got_k.shape == (rows.size, cpu_backend.heads, cpu_backend.dim)


def test_a_launch_never_writes_outside_its_slots(cpu_backend):
    """The kernel takes heads and dim from the slab and writes through the cache's
    strides: a slab whose tokens hold the same bytes in another geometry (``[L, 2H, D/2]``)
    would write heads H.. into the next block. Every launch checks the slab's heads x dim
    against the cache's, its layers, and each token's row, position and slot: refused
    before anything is written, the caches untouched."""
    from vllm.config import set_current_vllm_config

    L, bs, H, D = 2, 16, cpu_backend.heads, cpu_backend.dim
    g = torch.Generator().manual_seed(3)
    slab = torch.randn((20, 2, L, H, D), generator=g)
    rows = np.arange(10, dtype=np.int64)
    positions = np.arange(10, dtype=np.int64) + 5
    slots = np.arange(10, dtype=np.int64) + 3 * bs
    with set_current_vllm_config(cpu_backend.config):
        layers = cpu_layers(cpu_backend, L, blocks=8)
        writer = FusedWriter.build(layers, cpu_backend.rope, torch.float32, place=layer_major)
        assert writer.ok, writer.reason
        before = [layer.kv_cache.clone() for _, layer in layers]
        bad = {
            "regrouped [L, 2H, D/2]": Source(layer_major(slab.reshape(20, 2, L, 2 * H, D // 2)),
                                            rows, positions, slots),
            "fewer layers": Source(layer_major(slab[:, :, :1]), rows, positions, slots),
            "a row past the slab": Source(layer_major(slab), rows + 11, positions, slots),
            "a slot past the cache": Source(layer_major(slab), rows, positions, slots + 5 * bs),
            "a negative slot": Source(layer_major(slab), rows, positions, slots - 4 * bs),
            "a position past the rotary table": Source(layer_major(slab), rows,
                                                       positions + 10 ** 7, slots),
        }
        for what, src in bad.items():
            with pytest.raises(RuntimeError):
                writer.write([src])
            for (_, layer), old in zip(layers, before):
                assert torch.equal(layer.kv_cache, old), what
        writer.write([Source(layer_major(slab), rows, positions, slots)])  # the real one
    assert not torch.equal(layers[0][1].kv_cache, before[0])


def test_unknown_layout_stays_on_the_generic_path(cpu_backend):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cpu_backend.config):
        layers = cpu_layers(cpu_backend, 2, isa="amx")  # an ISA-packed layout we do not know
        assert cache_layout(layers[0][1]) is None
        writer = FusedWriter.build(layers, cpu_backend.rope, torch.float32)
    assert not writer.ok and "not known" in writer.reason


def test_self_check_rejects_a_kernel_that_disagrees(cpu_backend, monkeypatch):
    """A kernel that would write keys anywhere else than the backend's writer does (here:
    a layout with the key's dim and offset strides swapped) is never used."""
    import dataclasses

    from vllm.config import set_current_vllm_config

    import inferscale.vllm_plugin.kernels.writer as ik

    def wrong_layout(layer):
        real = cache_layout(layer)
        kb, ko, kh, kd = real.k_strides
        return dataclasses.replace(real, k_strides=(kb, kd, kh, ko))

    monkeypatch.setattr(ik, "cache_layout", wrong_layout)
    with set_current_vllm_config(cpu_backend.config):
        writer = FusedWriter.build(cpu_layers(cpu_backend, 2), cpu_backend.rope, torch.float32)
    assert not writer.ok and "keys differ" in writer.reason


def test_nothing_the_probe_and_a_served_step_pass_differently_is_specialized():
    """Triton compiles a variant per "integer divisible by 16": the start-up probe's
    slab has one layer (its scale strides ``2 * 1 * H``, ``1 * H``: 8 for 8 KV heads),
    a served slab all of them (256 at 32 layers). Specialized, the first served step of
    each source kind would compile on the engine's thread."""
    pytest.importorskip("triton")
    from inferscale.vllm_plugin.kernels.cuda import inject_kernel

    if not hasattr(inject_kernel, "params"):  # Triton's interpreter: nothing compiled
        pytest.skip("interpreted")
    loose = {p.name for p in inject_kernel.params if p.do_not_specialize}
    assert {"s_tok", "s_kv", "s_layer", "at", "n_all", "sc_row", "sc_kv"} <= loose


TRITON_SCRIPT = textwrap.dedent("""
    import os, torch, triton
    import triton.language as tl
    from inferscale.kv_quant import quantize
    from inferscale.vllm_plugin.kernels.cuda import inject_kernel

    @triton.jit
    def to_fp8(x, out, N: tl.constexpr):  # Triton's own float32 -> fp8 rounding
        i = tl.arange(0, N)
        tl.store(out + i, tl.load(x + i).to(out.dtype.element_ty))

    def triton_fp8(x):
        flat = x.contiguous().reshape(-1)
        n = triton.next_power_of_2(flat.numel())
        out = torch.zeros(n, dtype=torch.float8_e4m3fn)
        to_fp8[(1,)](torch.cat([flat, torch.zeros(n - flat.numel())]), out, N=n)
        return out[:flat.numel()].float().view(x.shape)
    torch.set_default_device(os.environ["KERNEL_DEVICE"])
    src_kind, cache_kind = os.environ["SRC"], os.environ["CACHE"]  # float32|bfloat16|fp8
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    torch.manual_seed(0)
    T, L, H, D, bs, B = 40, 3, 2, 16, 16, 6
    slab = torch.randn(T, 2, L, H, D)
    slab[:, 0, :, :, :2] *= 30  # outlier key channels, as real keys have
    rows = torch.tensor([5, 6, 7, 30, 31, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18])
    n = rows.numel()
    scales = torch.ones(1)  # unused unless the source is fp8
    scale_rows = torch.zeros(n, dtype=torch.int64)
    if src_kind == "fp8":  # chunks of 8 rows, each with its scales [2, L, H]
        q, sc = [], []
        for c in range(0, T, 8):
            rows_q, s = quantize(slab[c:c + 8])
            q.append(rows_q)
            sc.append(s)
        src = torch.cat(q)
        chunk_scales = torch.stack(sc)  # [C, 2, L, H]
        pre = src[rows].float() * chunk_scales[rows // 8][..., None]  # dequantized, float32
        # packed as a step packs them: the used chunks' rows, in another order
        used = torch.unique(rows // 8).flip(0)
        scales = torch.cat([chunk_scales[used].reshape(-1), torch.zeros(7)])
        scale_rows = torch.tensor([int((used == r // 8).nonzero()) for r in rows])
    else:
        src = slab.to(getattr(torch, src_kind))
        pre = src[rows].float()
    pos = torch.arange(n) + 3
    slots = (torch.tensor([4, 1])[:, None] * bs + torch.arange(bs)).reshape(-1)[9:9 + n]
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    f = torch.outer(torch.arange(64).float(), inv)
    cos_sin = torch.cat([f.cos(), f.sin()], -1)  # [P, D]
    # FlashAttention: logical (B, H, N, 2D), stored (B, N, H, 2D); one tensor per layer
    store = torch.uint8 if cache_kind == "fp8" else getattr(torch, cache_kind)
    caches = [torch.zeros(B, bs, H, 2 * D, dtype=store).permute(0, 2, 1, 3) for _ in range(L)]
    typed = [c.view(torch.float8_e4m3fn) if cache_kind == "fp8" else c for c in caches]
    views = [c.transpose(1, 2).split(D, dim=-1) for c in typed]  # K, V: [B, N, H, D]
    k0, v0 = views[0]
    base = caches[0].storage_offset()
    size = caches[0].element_size()
    off = torch.tensor([[l, (c.data_ptr() - caches[0].data_ptr()) // size]
                        for l, c in enumerate(caches)], dtype=torch.int64)
    out_scales = torch.tensor([[[0.05, 0.07], [0.02, 0.03]], [[0.04, 0.05], [0.01, 0.02]],
                               [[0.06, 0.05], [0.03, 0.01]]])  # [L, 2, H]: the layer's K, V
    # the columns of one [4, n_all] index buffer, starting at an odd column (as a later
    # request of a step does)
    at, n_all = 3, n + 5
    idx = torch.zeros(4, n_all, dtype=torch.int64)
    idx[0, at:at + n], idx[1, at:at + n], idx[2, at:at + n] = rows, pos, slots
    idx[3, at:at + n] = scale_rows
    inject_kernel[(n, L)](src, *src.stride()[:3], idx, at, n_all, scales, 2 * L * H, L * H,
                          cos_sin, cos_sin.stride(0), typed[0], off, out_scales,
                          *k0.stride(), *v0.stride(), k0.storage_offset() - base,
                          v0.storage_offset() - base, bs, HEADS=H, DIM=D, BH=2, BHALF=8,
                          BDIM=16, NEOX=True, SCALED=src_kind == "fp8",
                          QUANT_OUT=cache_kind == "fp8")
    x, y = pre[:, 0, :, :, :D // 2], pre[:, 0, :, :, D // 2:]
    c, s = cos_sin[pos, None, None, :D // 2], cos_sin[pos, None, None, D // 2:]
    want_k = torch.cat([x * c - y * s, y * c + x * s], -1)  # [n, L, H, D]
    b, o = slots // bs, slots % bs
    worst = 0.0
    for l, (k, v) in enumerate(views):
        got_k, got_v = k[b, o].float(), v[b, o].float()
        want_v = pre[:, 1, l]
        if cache_kind == "fp8":  # codes: x / the layer's scale, saturated, rounded to fp8
            # by Triton itself (its interpreter rounds some values wrongly; hardware does not)
            wk = triton_fp8((want_k[:, l] / out_scales[l, 0][:, None]).clamp(-448, 448))
            wv = triton_fp8((want_v / out_scales[l, 1][:, None]).clamp(-448, 448))
            for got, want in ((got_k, wk), (got_v, wv)):  # at most one rounding apart
                err = ((got - want).abs() - 2.0 ** -3 * want.abs()).max().item()
                assert err <= 2.0 ** -9, (l, err)
                assert (got == want).float().mean() > 0.99, l
            assert got_k.abs().max() == 448 and not torch.isnan(got_k).any()  # saturated
        else:
            ulp = torch.finfo(getattr(torch, cache_kind)).eps * (2 if interpreted else 1)
            ek = ((got_k - want_k[:, l]).abs() - ulp * want_k[:, l].abs()).max().item()
            assert ek <= 1e-5, (l, ek)
            if src_kind == cache_kind:  # a float source is copied exactly
                assert torch.equal(v[b, o], src[rows, 1, l]), l
            else:
                ev = ((got_v - want_v).abs() - ulp * want_v.abs()).max().item()
                assert ev <= 1e-6, (l, ev)
            worst = max(worst, (got_k - want_k[:, l]).abs().max().item())
        untouched = torch.ones(B, bs, dtype=torch.bool)
        untouched[b, o] = False
        assert k[untouched].float().abs().max() == 0 and v[untouched].float().abs().max() == 0
    print("ok", worst)
""")

TRITON_CASES = [("float32", "float32"), ("bfloat16", "bfloat16"), ("fp8", "bfloat16"),
                ("fp8", "float32"), ("fp8", "fp8"), ("bfloat16", "fp8")]


def run_triton_script(src: str, cache: str, tmp_path: Path):
    """Runs :data:`TRITON_SCRIPT` from a file: compiled Triton reads a ``@triton.jit``
    function's source with ``inspect`` (``python -c`` has none; the interpreter needs none)."""
    pytest.importorskip("triton")
    script = tmp_path / "triton_kernel_check.py"
    script.write_text(TRITON_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "SRC": src, "CACHE": cache}
    env.update({"KERNEL_DEVICE": "cuda"} if torch.cuda.is_available() else
               {"KERNEL_DEVICE": "cpu", "TRITON_INTERPRET": "1"})
    out = subprocess.run([sys.executable, str(script)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("ok")


@pytest.mark.parametrize("src, cache", TRITON_CASES)
def test_triton_kernel_matches_an_independent_rotation(src, cache, tmp_path):
    """bf16/fp32 and fp8 sources (dequantized in the same pass) into bf16/fp32 and fp8
    caches (divided by the layer's scales, saturated), against an independent float32
    computation: under Triton's CPU interpreter here (it rounds to bf16 by truncation,
    hence two roundings of slack; fp8 codes are compared with Triton's own rounding),
    compiled where CUDA exists."""
    run_triton_script(src, cache, tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("src, cache", TRITON_CASES)
def test_cuda_kernel_compiled_matches_an_independent_rotation(src, cache, tmp_path):
    """The same checks with the kernel compiled for the GPU (one rounding to nearest)."""
    run_triton_script(src, cache, tmp_path)


def test_a_writer_over_known_caches_takes_float_cuda_caches_only():
    """``FusedWriter.over`` (the Triton writer without an engine's layers, for
    ``benchmarks.inject_kernel``) refuses CPU caches and fp8 layouts: it runs the CUDA
    kernel and has no backend writer to check a quantized cache against."""
    from inferscale.vllm_plugin.compat import CacheLayout

    strides = (16 * 2 * 8, 2 * 8, 8, 1)
    float_layout = CacheLayout(strides, strides, 0, 4 * 16 * 2 * 8, 16, 2, 8)
    fp8_layout = CacheLayout(strides, strides, 0, 4 * 16 * 2 * 8, 16, 2, 8, quantized=True)
    cpu = [(0, torch.zeros(4, 2, 16, 2, 8))]
    for layout in (float_layout, fp8_layout):
        with pytest.raises(ValueError, match="float CUDA caches"):
            FusedWriter.over(cpu, layout, torch.zeros(64, 8), torch.float32)
