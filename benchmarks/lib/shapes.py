"""Architectures of the big models benchmarked with random/dummy weights.

Used by ``benchmarks.encode`` (transformers ``from_config``: :func:`hf_config`),
``benchmarks.ttft`` and ``benchmarks.load`` (vLLM with ``load_format="dummy"``: a
checkpoint of only ``config.json`` and a tokenizer, :func:`dummy_checkpoint`) and
``benchmarks.footprint`` (KV sizes: ``KVGeometry.of_config``). Values are those of the
models' public ``config.json`` files. No weights are downloaded anywhere.
:data:`RANDOM_LLAMA`: a small model with real random weights (tensor parallelism at
TP=2, ``benchmarks.equivalence --model random-llama``).
"""

from __future__ import annotations

from pathlib import Path

from inferscale.models import write_dummy_checkpoint

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


def dummy_checkpoint(shape: str, tokenizer_dir: str | Path, dest: str | Path) -> Path:
    """A checkpoint directory of ``shape`` for ``load_format="dummy"``. Having no
    tokenizer of these models offline, the embedded SmolLM2 tokenizer stands in (its ids
    fit both vocabularies; only shapes and timings matter here)."""
    return write_dummy_checkpoint(SHAPES[shape], tokenizer_dir, dest)


def hf_config(shape: str):
    """A transformers config object for ``shape`` (sdpa attention)."""
    from transformers import AutoConfig

    cfg = dict(SHAPES[shape])
    model_type = cfg.pop("model_type")
    cfg.pop("architectures")
    return AutoConfig.for_model(model_type, attn_implementation="sdpa", **cfg)


# A small Llama with real random weights for tensor parallelism at TP=2 (its 4 KV heads
# split in two): larger than default initial weights (``initializer_range`` 0.1), so that
# greedy answers depend on the whole context instead of repeating one token; written by
# ``inferscale.models.write_random_checkpoint`` with the SmolLM2 tokenizer.
RANDOM_LLAMA = {
    **SHAPES["tiny-llama-shape"], "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 4096,
    "rope_scaling": None, "rope_theta": 10000.0, "initializer_range": 0.1,
    "tie_word_embeddings": True,
}

