"""Arrow IPC round trips of the encoder's output (the cached encode step's result): every
stored dtype, fp8 scales and the key calibration come back bit for bit; other bytes are
refused."""

from __future__ import annotations

import pytest
import torch

from inferscale.artifacts.result_codec import encoded_from_ipc, encoded_to_ipc
from inferscale.encode.capture import EncodedChunk
from inferscale.encode.encoder import EncodedMemory
from inferscale.kv_quant import quantize
from inferscale.types import PREFIX_ID, KVGeometry

L, H, D = 2, 2, 8


def _memory(dtype: str) -> EncodedMemory:
    g = torch.Generator().manual_seed(0)
    chunks = []
    for cid, n in ((PREFIX_ID, 3), ("f1", 2), ("f2", 4)):
        kv = torch.randn(n, 2, L, H, D, generator=g)  # [T, 2, L, H, D]
        if dtype == "float8_e4m3fn":
            kv, sc = quantize(kv)
        else:
            kv, sc = kv.to(getattr(torch, dtype)), None
        chunks.append(EncodedChunk(cid, list(range(n)), kv, f"key-{cid}", sc))
    return EncodedMemory(chunks, "f" * 32, {"dtype": dtype, "window": 3}, {"facts": 2},
                         {"mode": "head", "temperatures": [[1.5, 1.0], [1.0, 2.0]]},
                         KVGeometry(L, H, D))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_encoded_round_trip(dtype):
    mem = _memory(dtype)
    back = encoded_from_ipc(encoded_to_ipc(mem))
    assert (back.model_fingerprint, back.encoder_config, back.stats, back.calibration,
            back.geometry) == (mem.model_fingerprint, mem.encoder_config, mem.stats,
                               mem.calibration, mem.geometry)
    assert isinstance(back.geometry, KVGeometry)
    assert [c.chunk_id for c in back.chunks] == [c.chunk_id for c in mem.chunks]
    for a, b in zip(mem.chunks, back.chunks):
        assert (a.token_ids, a.content_key) == (b.token_ids, b.content_key)
        assert b.kv.dtype == a.kv.dtype and b.kv.shape == a.kv.shape
        assert torch.equal(a.kv.view(torch.uint8), b.kv.view(torch.uint8))
        if a.scales is None:
            assert b.scales is None
        else:
            assert torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("bad", [float("nan"), 1e38, 7.6e35, 1e-45])
def test_forged_fp8_scales_are_refused(bad):
    """A cached result whose scale was changed in its bytes (shared result storage is
    writable by others): refused, never dequantized into garbage (or infinities, or a
    chunk of zeros)."""
    data = bytearray(encoded_to_ipc(_memory("float8_e4m3fn")))
    one = _memory("float8_e4m3fn").chunks[0].scales.reshape(-1)[:1].numpy().tobytes()
    at = bytes(data).index(one)
    data[at:at + 4] = torch.tensor([bad]).numpy().tobytes()
    with pytest.raises(ValueError, match="finite and positive"):
        encoded_from_ipc(bytes(data))


def test_other_bytes_are_refused():
    with pytest.raises(ValueError, match="not an Arrow IPC stream"):
        encoded_from_ipc(b"\x80\x04pickle")


def test_a_result_cached_without_a_geometry_reads_without_one():
    """Results cached before the encoder recorded its model's geometry still read (the
    pipeline's publish takes the geometry from the checkpoint then)."""
    import dataclasses

    back = encoded_from_ipc(encoded_to_ipc(dataclasses.replace(_memory("float32"),
                                                               geometry=None)))
    assert back.geometry is None
