"""The footprint benchmark's arithmetic (``benchmarks.footprint``) on a tiny shape: a
really published artifact's KV slab is tokens x layers x kv_heads x head_dim x 2 (K, V) x
bytes per element, and fp8's resident bytes add one float32 scale per (chunk, K/V,
layer, head)."""

from __future__ import annotations

import torch

from benchmarks.footprint import fp8_ratios, kv_bytes_per_token, measure
from builders import EMB_DIM, make_inputs
from inferscale.artifacts.layout import StoreConfig
from inferscale.artifacts.publish import publish

SHAPE = (2, 2, 64)  # layers, kv heads, head dim


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(SHAPE) == 2 * 2 * 64 * 2 * 2
    assert kv_bytes_per_token((32, 8, 128)) == 131072  # Llama-3.1-8B: 128 KiB per token
    assert kv_bytes_per_token((28, 4, 128), "float32") == 28 * 4 * 128 * 2 * 4
    assert kv_bytes_per_token((28, 4, 128), "float8_e4m3fn") == 28 * 4 * 128 * 2


def published(tmp_path, dtype: str) -> tuple[dict, list[int]]:
    """A tiny memory of 3 facts published in ``dtype``: its row, its chunks' lengths."""
    memory, facts, lineage = make_inputs("ann", 3, layers=2, heads=2, head_dim=64,
                                         dtype=getattr(torch, dtype), fp="tiny-fp")
    store = StoreConfig(str(tmp_path / dtype))
    res = publish(store, "ann", memory, facts, lineage, embeddings=False)
    row = measure(store, "ann", "tiny-fp", res.version, SHAPE, dtype)
    return row, [len(c.token_ids) for c in memory.chunks]


def test_published_tiny_artifact_matches_arithmetic(tmp_path):
    row, lengths = published(tmp_path, "bfloat16")
    assert row["tokens"] == sum(lengths) and row["facts"] == 3
    assert row["kv_slab_bytes"] == sum(lengths) * 1024 == row["kv_slab_expected_bytes"]
    assert row["slab_matches_shape"] and row["resident_bytes"] == row["kv_slab_bytes"]
    assert row["kv_file_bytes"] >= row["kv_slab_bytes"]  # slab + offsets table + framing
    assert row["embeddings_bytes"] == 3 * EMB_DIM * 4 and row["embedding_dim"] == EMB_DIM
    assert row["lancedb_bytes"] is None
    assert row["total_bytes"] == row["kv_file_bytes"] + row["facts_file_bytes"]
    assert row["bytes_per_fact"] == round(sum(lengths[1:]) * 1024 / 3, 1)  # prefix left out


def test_fp8_rows_and_the_ratio(tmp_path):
    """The same tiny memory published in bf16 and fp8: the fp8 slab is half, the resident
    size adds one float32 scale per (chunk, K/V, layer, head), and the ratio is reported."""
    rows = []
    for dtype in ("bfloat16", "float8_e4m3fn"):
        row, lengths = published(tmp_path, dtype)
        rows.append({"conversation": "c", "model": "tiny", **row})
    bf16, fp8 = rows
    assert fp8["kv_dtype"] == "float8_e4m3fn" and fp8["slab_matches_shape"]
    assert fp8["kv_slab_bytes"] * 2 == bf16["kv_slab_bytes"] == bf16["resident_bytes"]
    assert fp8["scale_bytes_per_chunk"] == 2 * 2 * 2 * 4 and bf16["scale_bytes_per_chunk"] == 0
    assert fp8["resident_bytes"] == fp8["kv_slab_bytes"] + 4 * fp8["scale_bytes_per_chunk"]
    ratio = fp8_ratios(rows)["c_tiny"]
    assert 0.5 < ratio["resident"] < 0.52 and 0.5 < ratio["per_fact"] < 0.52
