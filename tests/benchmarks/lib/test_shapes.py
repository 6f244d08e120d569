"""The big models' shapes the benchmarks use with dummy or random weights
(``benchmarks.lib.shapes``): their KV geometry, a transformers config, a dummy checkpoint."""

from __future__ import annotations

import json

from benchmarks.lib.shapes import RANDOM_LLAMA, SHAPES, dummy_checkpoint, hf_config
from inferscale.models import dummy_fingerprint, resolve_checkpoint
from inferscale.types import KVGeometry


def test_geometries_of_the_shapes():
    assert KVGeometry.of_config(SHAPES["llama-3.1-8b-shape"]) == (32, 8, 128)
    assert KVGeometry.of_config(SHAPES["tiny-llama-shape"]) == (2, 2, 64)
    # Qwen2.5-7B has no head_dim in its config: hidden / heads
    assert KVGeometry.of_config(SHAPES["qwen2.5-7b-shape"]) == (28, 4, 128)
    assert KVGeometry.of_config(RANDOM_LLAMA) == (4, 4, 32)  # TP=2 splits its 4 KV heads


def test_a_shape_as_a_config_and_as_a_dummy_checkpoint(tmp_path, inferscale_home):
    cfg = hf_config("qwen3-14b-shape")
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg._attn_implementation) == \
        (40, 8, "sdpa")
    ckpt = dummy_checkpoint("tiny-llama-shape", resolve_checkpoint("embedded", inferscale_home),
                            tmp_path / "tiny")
    assert json.loads((ckpt / "config.json").read_text()) == SHAPES["tiny-llama-shape"]
    assert (ckpt / "tokenizer.json").is_file() and dummy_fingerprint(ckpt)
