"""What the plugin takes from vLLM, checked against this vLLM build (no engine): layer
discovery, the backend's cache writer and its layout read back, the model's rotary op,
scheduler output and prefill counters."""

from __future__ import annotations

import dataclasses
import re
import types

import numpy as np
import pytest
import torch
import vllm

from inferscale.encode.rope import RotaryTables, rotate_keys
from inferscale.vllm_plugin.compat import (
    SUPPORTED, VLLM_VERSION, CacheLayout, attention_layers, block_ids_of, cache_layout,
    engine_stages, find_rotary, kv_transfer_group, layer_index, prefill_stats, read_layer_kv,
    rotate_with_model, write_layer_kv,
)
from tests.vllm_plugin.cpu_attention import cpu_layers


def test_this_vllm_is_a_supported_release():
    assert VLLM_VERSION == tuple(int(x) for x in re.findall(r"\d+", vllm.__version__)[:2])
    assert VLLM_VERSION in SUPPORTED


def test_layer_index_and_attention_layers(cpu_backend):
    assert layer_index("model.layers.7.self_attn.attn") == 7
    assert layer_index("language_model.model.layers.12.attn") == 12
    with pytest.raises(ValueError, match="layer index"):
        layer_index("lm_head")
    (_, l0), (_, l1) = cpu_layers(cpu_backend, 2)
    found = attention_layers({
        "model.layers.1.self_attn.attn": l1,
        "model.layers.0.self_attn.attn": l0,
        "model.layers.2.self_attn.attn": types.SimpleNamespace(impl=l0.impl,
                                                               kv_cache=torch.empty(0)),
        "model.layers.3.mlp": types.SimpleNamespace(kv_cache=l0.kv_cache),  # no impl
    })
    assert found == [(0, l0), (1, l1)]  # layers with a paged cache, by index


def test_backend_writer_and_layout_read_back(cpu_backend):
    from vllm.config import set_current_vllm_config

    bs = 16
    ((_, layer),) = cpu_layers(cpu_backend, 1, blocks=6, block_size=bs)
    layout = cache_layout(layer)
    assert isinstance(layout, CacheLayout)
    assert (layout.block_size, layout.num_heads, layout.head_size) == (
        bs, cpu_backend.heads, cpu_backend.dim)
    g = torch.Generator().manual_seed(3)
    n = 21
    key = torch.randn(n, cpu_backend.heads, cpu_backend.dim, generator=g)  # [N, H, D]
    value = torch.randn(n, cpu_backend.heads, cpu_backend.dim, generator=g)
    slots = torch.from_numpy(np.concatenate([np.arange(3 * bs + 5, 4 * bs),
                                             np.arange(bs, bs + 10)]))
    scratch = torch.zeros_like(layer.kv_cache)
    with set_current_vllm_config(cpu_backend.config):
        write_layer_kv(layer, key, value, slots)
        write_layer_kv(layer, 2 * key, 2 * value, slots, kv_cache=scratch)
    got_k, got_v = read_layer_kv(layer, slots, bs)
    assert torch.equal(got_k, key) and torch.equal(got_v, value)
    k_view, _ = layout.views(layer.kv_cache)  # [B, N, H, D]
    assert k_view.shape == (6, bs, cpu_backend.heads, cpu_backend.dim)
    written = torch.zeros(6, bs, dtype=torch.bool)
    written[slots // bs, slots % bs] = True
    assert k_view[~written].abs().max() == 0  # nothing else was touched
    sk, sv = layout.views(scratch)
    assert torch.equal(sk[slots // bs, slots % bs], 2 * key)
    assert torch.equal(sv[slots // bs, slots % bs], 2 * value)
    packed = types.SimpleNamespace(impl=layer.impl, isa="amx", kv_cache=layer.kv_cache)
    assert cache_layout(packed) is None and read_layer_kv(packed, slots, bs) is None
    with pytest.raises(ValueError):
        dataclasses.replace(layout, block_size=0)


def test_the_models_rotary_op_matches_transformers_tables(cpu_backend, smollm2):
    rope = find_rotary(torch.nn.Sequential(torch.nn.Identity(), cpu_backend.rope))
    assert rope is cpu_backend.rope
    with pytest.raises(RuntimeError, match="one rotary embedding"):
        find_rotary(torch.nn.Identity())
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(9, 4, cpu_backend.dim, generator=g)  # [N, X, D], X = layers x heads
    positions = torch.arange(9) * 37 + 2
    want = rotate_keys(keys[:, None], positions, RotaryTables.from_model(smollm2.model),
                       token_dim=0)[:, 0]  # [N, X, D]
    rotate_with_model(rope, positions, keys)  # in place
    assert torch.allclose(keys, want, atol=1e-5)


def test_scheduler_output_and_prefill_counters():
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.metrics.stats import PrefillStats

    blank = {f.name: None for f in dataclasses.fields(NewRequestData)
             if f.default is dataclasses.MISSING}
    new_req = NewRequestData(**{**blank, "req_id": "r", "block_ids": ([3, 4, 9], [1])})
    assert block_ids_of(new_req) == [3, 4, 9]
    stats = PrefillStats(num_prompt_tokens=40, num_computed_tokens=8,
                         num_local_cached_tokens=2, num_external_cached_tokens=30)
    assert prefill_stats(types.SimpleNamespace(prefill_stats=stats)) == {
        "prompt": 40, "computed": 8, "local_cached": 2, "external": 30}
    assert prefill_stats(types.SimpleNamespace()) is None


def test_engine_stages_from_the_request_outputs_stats():
    """Queued and prefill seconds from vLLM's own per-request timestamps; none where the
    engine kept no stats or has not scheduled the request (no first token yet)."""
    from vllm.v1.metrics.stats import RequestStateStats

    stats = RequestStateStats(queued_ts=10.0, scheduled_ts=10.25, first_token_ts=10.75)
    assert engine_stages(types.SimpleNamespace(metrics=stats)) == (0.25, 0.5)
    assert engine_stages(types.SimpleNamespace(metrics=None)) is None
    assert engine_stages(types.SimpleNamespace()) is None
    assert engine_stages(types.SimpleNamespace(metrics=RequestStateStats(queued_ts=1.0))) is None


def test_no_connector_outside_an_engine():
    assert kv_transfer_group() is None
