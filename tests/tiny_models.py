"""Tiny models with random weights and random K/V for the encoder's tests (fp32, CPU,
seconds): 2-layer Llama (any rotary type of :data:`ROPE_TYPES`) and Qwen3 (with
``k_norm``)."""

from __future__ import annotations

import torch

# rotary embeddings of each kind transformers implements, at tiny context lengths
ROPE_TYPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 64},
}


def tiny_llama(rope_parameters: dict | None = None, seed: int = 0, **overrides):
    """A 2-layer Llama with random weights (fp32) and the given rotary parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, attn_implementation="sdpa",
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        **overrides,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen3(seed: int = 0):
    """A 2-layer Qwen3 (with q_norm/k_norm) with random weights (fp32)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, attn_implementation="sdpa",
    )
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so a skipped k_norm would show
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


def random_kv(num_layers=2, tokens=5, heads=2, head_dim=16, dtype=torch.float32, seed=0):
    """Random K, V ``[L, T, H, D]``."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, tokens, heads, head_dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
