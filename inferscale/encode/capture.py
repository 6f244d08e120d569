"""Capturing pre-RoPE K and V (and queries) from one forward pass of a Hugging Face
decoder, and the passes themselves (:func:`encode_segments`): the encoder's mechanics,
apart from what it encodes (:mod:`inferscale.encode.encoder`).

K is the tensor entering the modeling module's ``apply_rotary_pos_emb``, V the tensor
entering the attention function: exactly what a KV cache stores, before rotation. Both
land in token-major rows ``[T, 2, L, H, D]`` (:attr:`~inferscale.types.KVFormat.TOKEN_MAJOR`),
the layout ``kv.arrow`` stores, so a chunk goes to storage (or to the task cache, or is
reused from a previous version) without being laid out again.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from inferscale.encode.batches import Segment, build_batch, plan_batches
from inferscale.encode.identity import EncodeError
from inferscale.types import KVFormat, KVGeometry

_capture_lock = threading.Lock()


@dataclass
class EncodedChunk:
    """One memory chunk's pre-RoPE KV: the prefix, or one fact."""

    chunk_id: str
    token_ids: list[int]
    kv: torch.Tensor  # [T, 2, L, H, D] (KVFormat.TOKEN_MAJOR): pre-RoPE K, then V
    content_key: str | None = None  # set by encode_facts in batch-invariant mode
    scales: torch.Tensor | None = None  # [2, L, H] float32: fp8 K/V's (inferscale.kv_quant)


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    return base if base is not None else model


class _KVCapture:
    """Capture pre-RoPE K and V of selected tokens during one forward pass, into the
    token-major rows ``out`` ``[N, 2, L, H, D]``.

    K is taken where it enters the modeling module's ``apply_rotary_pos_emb`` (patched
    for the pass); V where it enters the attention function (the registered attention
    implementation, or the module's ``eager_attention_forward``), which is exactly what
    a KV cache would store. Both patches hold a process-wide lock for the pass, and
    capture only calls made by this model in this thread: any other model (another
    thread's embedder, say) that runs meanwhile goes straight to the originals.
    """

    def __init__(self, model: torch.nn.Module, out: torch.Tensor, sel_b: torch.Tensor,
                 sel_s: torch.Tensor, out_q: torch.Tensor | None = None, q_from: int = 0):
        self.out = out  # [N, 2, L, H, D]
        self.out_q, self.q_from = out_q, q_from  # [L, S - q_from, Hq, D] of batch row 0
        self.sel_b, self.sel_s = sel_b, sel_s
        self.k_calls = 0
        self.v_layers: set[int] = set()
        self.module = sys.modules[type(model).__module__]
        if not hasattr(self.module, "apply_rotary_pos_emb"):
            raise EncodeError(f"{self.module.__name__} has no apply_rotary_pos_emb to capture")
        self.impl = getattr(model.config, "_attn_implementation", None) or "eager"
        self.modules = {id(m) for m in model.modules()}
        self.thread = threading.get_ident()

    def _select(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, H, S, D] -> selected tokens [N, H, D]
        return x.transpose(1, 2)[self.sel_b, self.sel_s]

    def _rope(self, q, k, cos, sin, *args, **kwargs):
        if threading.get_ident() != self.thread:
            return self.original_rope(q, k, cos, sin, *args, **kwargs)
        if self.k_calls >= self.out.shape[2]:
            raise EncodeError("apply_rotary_pos_emb called more often than there are layers")
        if k.shape[-1] != self.out.shape[-1]:
            raise EncodeError(f"the model rotates {k.shape[-1]} of {self.out.shape[-1]} key "
                              "channels outside apply_rotary_pos_emb: unsupported")
        self.out[:, 0, self.k_calls] = self._select(k).to(self.out.dtype)
        if self.out_q is not None:
            self.out_q[self.k_calls] = q[0, :, self.q_from:].transpose(0, 1).to(self.out_q.dtype)
        self.k_calls += 1
        return self.original_rope(q, k, cos, sin, *args, **kwargs)

    def _attention(self, module, query, key, value, *args, **kwargs):
        if threading.get_ident() != self.thread or id(module) not in self.modules:
            return self.original_attn(module, query, key, value, *args, **kwargs)
        layer = module.layer_idx
        self.out[:, 1, layer] = self._select(value).to(self.out.dtype)
        self.v_layers.add(layer)
        return self.original_attn(module, query, key, value, *args, **kwargs)

    def __enter__(self) -> "_KVCapture":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        _capture_lock.acquire()
        self.original_rope = self.module.apply_rotary_pos_emb
        self.module.apply_rotary_pos_emb = self._rope
        if self.impl == "eager":
            self.original_attn = self.module.eager_attention_forward
            self.module.eager_attention_forward = self._attention
        else:
            self.original_attn = ALL_ATTENTION_FUNCTIONS[self.impl]
            ALL_ATTENTION_FUNCTIONS[self.impl] = self._attention
        return self

    def __exit__(self, *exc) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.module.apply_rotary_pos_emb = self.original_rope
        if self.impl == "eager":
            self.module.eager_attention_forward = self.original_attn
        else:
            ALL_ATTENTION_FUNCTIONS[self.impl] = self.original_attn
        _capture_lock.release()


def kv_shape(model: torch.nn.Module) -> KVGeometry:
    """The model's cache geometry: (layers L, KV heads H, head dim D)."""
    return KVGeometry.of_config(model.config)


@torch.no_grad()
def prefill_qk(model: torch.nn.Module, ids: Sequence[int], rows_from: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One plain causal prefill of ``ids``: the pre-RoPE queries of tokens ``rows_from..``
    ``[L, R, Hq, D]`` and the pre-RoPE keys of every token ``[L, S, H, D]`` (layer-first,
    dense: the calibration's attention maths, not a stored layout)."""
    p, geometry, S = next(model.parameters()), kv_shape(model), len(ids)
    L, _, D = geometry
    hq = (getattr(model.config, "text_config", None) or model.config).num_attention_heads
    sel_s = torch.arange(S, device=p.device)
    out = KVFormat.TOKEN_MAJOR.empty(S, geometry, p.dtype, p.device)  # [S, 2, L, H, D]
    out_q = torch.empty((L, S - rows_from, hq, D), dtype=p.dtype, device=p.device)
    with _KVCapture(model, out, torch.zeros_like(sel_s), sel_s, out_q, rows_from) as cap:
        _decoder(model)(input_ids=torch.tensor([list(ids)], device=p.device),
                        position_ids=sel_s[None], use_cache=False)
    if cap.k_calls != L:
        raise EncodeError(f"captured queries of {cap.k_calls} layers for {L}")
    return out_q, out[:, 0].transpose(0, 1).contiguous()


@torch.no_grad()
def encode_segments(model: torch.nn.Module, segments: Sequence[Segment], *,
                    out_dtype: torch.dtype, batch_tokens: int | None, pad_id: int = 0,
                    progress: Any = None, keep_on_device: bool = False
                    ) -> Iterator[EncodedChunk]:
    """Run the passes and yield every chunk's rows ``[T, 2, L, H, D]`` (a view of its
    batch's rows).

    ``batch_tokens``: segments packed into padded batches of at most that many tokens
    (:func:`plan_batches`), or ``None``: every segment alone in its pass, in the order
    given, unpadded — its chunks' bits then depend on nothing but the segment (batch
    invariance). Chunks come out batch by batch (not in input order when batched);
    ``progress`` (a tqdm bar) is advanced by the number of chunks done. Results move to
    CPU unless ``keep_on_device``.
    """
    device = next(model.parameters()).device
    compute_dtype = next(model.parameters()).dtype
    geometry = kv_shape(model)
    L = geometry.layers
    decoder = _decoder(model)
    plan = ([[i] for i in range(len(segments))] if batch_tokens is None
            else plan_batches(segments, batch_tokens))
    for batch in plan:
        inputs = build_batch([segments[i] for i in batch], pad_id, device, compute_dtype)
        n = inputs["select_b"].numel()
        out = KVFormat.TOKEN_MAJOR.empty(n, geometry, out_dtype, device)  # [N, 2, L, H, D]
        with _KVCapture(model, out, inputs["select_b"], inputs["select_s"]) as cap:
            decoder(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"],
                    attention_mask=inputs["attention_mask"], use_cache=False)
        if cap.k_calls != L or len(cap.v_layers) != L:
            raise EncodeError(f"captured K of {cap.k_calls} and V of {len(cap.v_layers)} layers "
                              f"for {L}: {type(model).__name__} is not supported by the encoder")
        if not keep_on_device:
            out = out.cpu()
        token_lists = {cid: ids for i in batch for cid, ids in segments[i].chunks}
        for chunk_id, start, length in inputs["spans"]:
            yield EncodedChunk(chunk_id, list(token_lists[chunk_id]), out[start:start + length])
        if progress is not None:
            progress.update(len(inputs["spans"]))
