"""benchmarks/footprint.py arithmetic on a tiny shape: a really published artifact's KV
slab is tokens x layers x kv_heads x head_dim x 2 (K, V) x 2 bytes (bf16)."""

from __future__ import annotations

import torch

from benchmarks.footprint import kv_bytes_per_token, measure
from benchmarks.memory_setup import facts_table, random_memory
from benchmarks.shapes import SHAPES, kv_shape
from inferscale.artifacts.layout import StoreConfig
from inferscale.artifacts.publish import Lineage, publish
from inferscale.compose import Composer


class ByteTokenizer:
    """A stand-in tokenizer: one token per byte, no chat template."""

    chat_template = None
    bos_token = "<s>"

    def encode(self, text, add_special_tokens=False, split_special_tokens=False):
        return list(text.encode())  # no special tokens: nothing to split


class RandomEmbedder:
    def embed(self, texts):
        return torch.randn(len(texts), 8)


def test_kv_bytes_per_token():
    assert kv_shape(SHAPES["tiny-llama-shape"]) == (2, 2, 64)
    assert kv_bytes_per_token((2, 2, 64)) == 2 * 2 * 64 * 2 * 2
    assert kv_bytes_per_token((32, 8, 128)) == 131072  # Llama-3.1-8B: 128 KiB per token
    assert kv_bytes_per_token((28, 4, 128), "float32") == 28 * 4 * 128 * 2 * 4
    # Qwen2.5-7B has no head_dim in its config: hidden / heads
    assert kv_shape(SHAPES["qwen2.5-7b-shape"]) == (28, 4, 128)


def test_published_tiny_artifact_matches_arithmetic(tmp_path):
    tok = ByteTokenizer()
    texts = ["Ann: I adopted a dog.", "Bob: What is its name?", "Ann: Rex."]
    composer = Composer(tok)
    table = facts_table("ann", texts, [composer.fact_ids(t) for t in texts], RandomEmbedder())
    shape = kv_shape(SHAPES["tiny-llama-shape"])
    mem = random_memory(table, tok, shape, torch.bfloat16, "tiny-fp")
    store = StoreConfig(str(tmp_path / "artifacts"))
    res = publish(store, "ann", mem, table, Lineage("log", "facts"), embeddings=False)
    row = measure(store, "ann", "tiny-fp", res.version, shape)
    tokens = len(composer.prefix_ids()) + sum(len(composer.fact_ids(t)) for t in texts)
    assert row["tokens"] == tokens and row["facts"] == 3
    assert row["kv_slab_bytes"] == tokens * 1024 == row["kv_slab_expected_bytes"]
    assert row["slab_matches_shape"]
    assert row["kv_file_bytes"] >= row["kv_slab_bytes"]  # slab + offsets table + framing
    assert row["embeddings_bytes"] == 3 * 8 * 4 and row["embedding_dim"] == 8
    assert row["lancedb_bytes"] is None
    assert row["total_bytes"] == row["kv_file_bytes"] + row["facts_file_bytes"]


def test_fp8_rows_and_the_ratio(tmp_path):
    """The same tiny memory published in bf16 and fp8: the fp8 slab is half, the resident
    size adds one float32 scale per (chunk, K/V, layer, head), and the ratio is reported."""
    from benchmarks.footprint import fp8_ratios

    tok = ByteTokenizer()
    texts = ["Ann: I adopted a dog.", "Bob: What is its name?", "Ann: Rex."]
    composer = Composer(tok)
    table = facts_table("ann", texts, [composer.fact_ids(t) for t in texts], RandomEmbedder())
    shape = kv_shape(SHAPES["tiny-llama-shape"])  # (2, 2, 64)
    rows = []
    for dtype in ("bfloat16", "float8_e4m3fn"):
        mem = random_memory(table, tok, shape, getattr(torch, dtype), "tiny-fp")
        store = StoreConfig(str(tmp_path / dtype))
        res = publish(store, "ann", mem, table, Lineage("log", "facts"), embeddings=False)
        row = measure(store, "ann", "tiny-fp", res.version, shape, dtype)
        rows.append({"conversation": "c", "model": "tiny", **row})
    bf16, fp8 = rows
    assert fp8["kv_dtype"] == "float8_e4m3fn" and fp8["slab_matches_shape"]
    assert fp8["kv_slab_bytes"] * 2 == bf16["kv_slab_bytes"] == bf16["resident_bytes"]
    assert fp8["scale_bytes_per_chunk"] == 2 * 2 * 2 * 4 and bf16["scale_bytes_per_chunk"] == 0
    assert fp8["resident_bytes"] == fp8["kv_slab_bytes"] + 4 * fp8["scale_bytes_per_chunk"]
    facts_tokens = sum(len(composer.fact_ids(t)) for t in texts)
    assert bf16["bytes_per_fact"] == round(facts_tokens * 1024 / 3, 1)
    ratio = fp8_ratios(rows)["c_tiny"]
    assert 0.5 < ratio["resident"] < 0.52 and 0.5 < ratio["per_fact"] < 0.52
