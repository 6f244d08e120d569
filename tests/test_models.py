"""Checkpoints without real weights: dummy (config and tokenizer) and random (seeded)."""

from __future__ import annotations

import json

import pytest

from inferscale.models import (
    dummy_fingerprint, resolve_checkpoint, write_dummy_checkpoint, write_random_checkpoint,
)

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 128}


@pytest.fixture(scope="module")
def tokenizer_dir(inferscale_home):
    return resolve_checkpoint("embedded", inferscale_home)


def test_a_dummy_checkpoint_is_its_config_and_tokenizer(tmp_path, tokenizer_dir):
    ckpt = write_dummy_checkpoint(TINY, tokenizer_dir, tmp_path / "a")
    assert json.loads((ckpt / "config.json").read_text()) == TINY
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(
        ["config.json"] + [p.name for p in tokenizer_dir.iterdir()
                           if p.name.startswith(("tokenizer", "chat_template"))])
    other = write_dummy_checkpoint({**TINY, "num_key_value_heads": 4}, tokenizer_dir,
                                   tmp_path / "b")
    assert dummy_fingerprint(ckpt) == dummy_fingerprint(
        write_dummy_checkpoint(TINY, tokenizer_dir, tmp_path / "c"))
    assert dummy_fingerprint(other) != dummy_fingerprint(ckpt)


def test_a_random_checkpoint_is_its_seeds_and_takes_the_tokenizers_vocabulary(
        tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def weights(path):
        return AutoModelForCausalLM.from_pretrained(path).state_dict()

    a = write_random_checkpoint(TINY, tokenizer_dir, tmp_path / "a", seed=1)
    b = write_random_checkpoint(TINY, tokenizer_dir, tmp_path / "b", seed=1)
    c = write_random_checkpoint(TINY, tokenizer_dir, tmp_path / "c", seed=2)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = json.loads((a / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"]) == (len(tok), tok.eos_token_id)
    assert (config["num_key_value_heads"], config["head_dim"]) == (2, 8)
    wa, wb, wc = weights(a), weights(b), weights(c)
    assert all((wa[k] == wb[k]).all() for k in wa)
    assert any((wa[k] != wc[k]).any() for k in wa)
    # written once: a second call leaves the directory as it is
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert write_random_checkpoint(TINY, tokenizer_dir, a, seed=3) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
