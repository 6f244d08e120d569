"""Architectures of the big models benchmarked with random/dummy weights.

Used by ``encode.py`` (transformers ``from_config``), ``ttft.py`` (vLLM with
``load_format="dummy"``: a checkpoint directory holding only ``config.json`` and a
tokenizer) and ``footprint.py`` (KV sizes). Values are those of the models' public
``config.json`` files. No weights are downloaded anywhere.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SHAPES: dict[str, dict] = {
    "llama-3.1-8b-shape": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
    "qwen3-14b-shape": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    # Qwen2.5-7B(-Instruct) config.json: head_dim is hidden_size / num_attention_heads = 128
    "qwen2.5-7b-shape": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "use_sliding_window": False,
        "sliding_window": 131072, "max_window_layers": 28, "bos_token_id": 1,
        "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
    # Mistral-7B-(Instruct-)v0.3 config.json
    "mistral-7b-shape": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
}

# A two-layer Llama for smoke-testing the dummy-weight path on a CPU in seconds.
SHAPES["tiny-llama-shape"] = {
    **SHAPES["llama-3.1-8b-shape"], "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "vocab_size": 49152, "torch_dtype": "float32",
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_dummy_checkpoint(shape: str, tokenizer_dir: str | Path, dest: str | Path) -> Path:
    """A checkpoint directory for ``load_format="dummy"``: config + a tokenizer.

    Having no tokenizer of these models offline, the embedded SmolLM2 tokenizer stands
    in (its ids fit both vocabularies; only shapes and timings matter here).
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(SHAPES[shape], indent=1))
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.exists():
            shutil.copy(src, dest / name)
    return dest


def kv_shape(config: dict) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a config dict (head_dim defaults to hidden/heads)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return config["num_hidden_layers"], heads, head_dim


def hf_config(shape: str):
    """A transformers config object for ``shape`` (sdpa attention)."""
    from transformers import AutoConfig

    cfg = dict(SHAPES[shape])
    model_type = cfg.pop("model_type")
    cfg.pop("architectures")
    return AutoConfig.for_model(model_type, attn_implementation="sdpa", **cfg)


# A small Llama with real random weights for tensor parallelism at TP=2 (its 4 KV heads
# split in two): larger than default initial weights (``initializer_range`` 0.1), so that
# greedy answers depend on the whole context instead of repeating one token.
RANDOM_LLAMA = {
    **SHAPES["tiny-llama-shape"], "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 4096,
    "rope_scaling": None, "rope_theta": 10000.0, "initializer_range": 0.1,
    "tie_word_embeddings": True,
}


def write_random_checkpoint(tokenizer_dir: str | Path, dest: str | Path, seed: int = 0,
                            **overrides) -> Path:
    """A float32 checkpoint of :data:`RANDOM_LLAMA` (``overrides`` changed) with random
    weights drawn from ``seed`` and the tokenizer of ``tokenizer_dir`` (its special token
    ids replace the shape's). Used by the tensor-parallel tests and
    ``equivalence.py --model random-llama``; written once per ``dest``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dest = Path(dest)
    if (dest / "model.safetensors").exists():
        return dest
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = {**RANDOM_LLAMA, **overrides, "vocab_size": len(tok),
           "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    cfg.pop("architectures")
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest
