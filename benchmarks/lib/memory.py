"""A benchmark user's memory from a LoCoMo conversation, published as a real artifact, so
the benchmarks hydrate and serve exactly what production does. Imports only what the
GPU machine has (no Mem0, no LanceDB).

Facts: the library's (:mod:`inferscale.facts.table`): ``raw_facts`` (the pipeline's raw
fact mode, ``"[date] Speaker: text"``) with :func:`vectors` of the packaged MiniLM, or
:func:`turn_facts` (``"Speaker: text"``, the TTFT and footprint benchmarks'). K/V: the
real encoder (:func:`encoded_memory`), or random K/V of a model's geometry for
dummy-weight shapes (:func:`random_memory`); :func:`kv_errors` measures what a stored
dtype loses. :func:`placed_bytes`: what a published user takes in a worker's tiers.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import torch

from inferscale.artifacts.layout import StoreConfig
from inferscale.artifacts.publish import Lineage, publish
from inferscale.compose import Composer, memory_text
from inferscale.encode.capture import EncodedChunk
from inferscale.encode.encoder import EncodedMemory, encode_facts
from inferscale.encode.identity import EncoderConfig, EncodingIdentity
from inferscale.facts.table import facts_table
from inferscale.hydrate.slab import slab_nbytes
from inferscale.hydrate.store import kept_dtype
from inferscale.ingest.logs import turns_hash
from inferscale.kv_quant import FP8_DTYPE, FP8_MAX, dequantize, is_quantized, quantize
from inferscale.pipeline.steps import turns_and_facts
from inferscale.types import PREFIX_ID, KVGeometry
from storage_schemas.manifest import Manifest


def vectors(embedder):
    """``embed(texts)`` -> one row per text, by ``embedder`` (an
    ``inferscale.serve.retrieval.Embedder``)."""
    return lambda texts: embedder.embed(texts).float().cpu().numpy()


def turn_facts(turns: pa.Table, user: str, tokenizer, embedder, max_tokens: int = 256) -> pa.Table:
    """One fact per turn, ``"Speaker: text"`` (no date), for ``user``."""
    rows = turns.sort_by("turn_index").to_pylist()
    texts = [memory_text(r["speaker"], r["text"]) for r in rows]
    return facts_table(user, list(zip(rows, texts)), vectors(embedder)(texts), tokenizer,
                       max_tokens=max_tokens)


def random_memory(facts: pa.Table, tokenizer, shape: tuple[int, int, int], dtype: torch.dtype,
                  fingerprint: str, seed: int = 0, layout: dict | None = None) -> EncodedMemory:
    """Random K/V rows ``[T, 2, L, H, D]`` per chunk (for dummy-weight models, whose real KV would
    be as meaningless): right sizes, right token ids, no forward pass. ``layout``: the
    composer settings (``memory_order``, ``text_tail``) the artifact carries. An fp8
    ``dtype`` quantizes each chunk (``inferscale.kv_quant``)."""
    L, H, D = shape
    g = torch.Generator().manual_seed(seed)
    fp8 = is_quantized(dtype)
    chunks = [(PREFIX_ID, Composer(tokenizer).prefix_ids())]
    chunks += list(zip(facts.column("fact_id").to_pylist(), facts.column("token_ids").to_pylist()))
    out = []
    for cid, ids in chunks:
        kv = torch.randn((2, L, len(ids), H, D), generator=g).permute(2, 0, 1, 3, 4)
        if fp8:
            kv, sc = quantize(kv)
            out.append(EncodedChunk(cid, list(ids), kv, scales=sc))
        else:
            out.append(EncodedChunk(cid, list(ids), kv.to(dtype)))
    return EncodedMemory(out, fingerprint, {"random_kv": True, "dtype": str(dtype),
                                            **(layout or {})}, geometry=KVGeometry(L, H, D))


def kv_errors(memory: EncodedMemory) -> dict:
    """How far stored K/V are from a float encoding (``memory``, float32 or bf16), for
    bf16 storage and two fp8 scale granularities: the stored format's (per chunk, K/V,
    layer, KV head) and per token (one scale per token, layer, head: what the format
    would need if chunk scales were too coarse). Relative RMS error over all chunks,
    K and V apart: sqrt(sum (x' - x)^2 / sum x^2)."""
    err: dict[str, list[float]] = {}

    def add(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        e = err.setdefault(name, [0.0, 0.0])
        e[0] += float((y - x).pow(2).sum())
        e[1] += float(x.pow(2).sum())

    for c in memory.chunks:
        for kind, x in (("k", c.kv[:, 0].float()), ("v", c.kv[:, 1].float())):  # [T, L, H, D]
            add(f"bf16_{kind}", x, x.to(torch.bfloat16).float())
            rows, sc = quantize(torch.stack([x, x], dim=1))  # per chunk, layer, head
            add(f"fp8_chunk_{kind}", x, dequantize(rows, sc.expand(rows.shape[0], -1, -1, -1))
                [:, 0])
            amax = x.abs().amax(dim=-1, keepdim=True)  # per token, layer, head
            s_tok = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
            add(f"fp8_token_{kind}", x, (x / s_tok).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
                .float() * s_tok)
    return {name: round((e[0] / max(e[1], 1e-30)) ** 0.5, 5) for name, e in err.items()}


def encoded_memory(model, tokenizer, turns: pa.Table, facts: pa.Table, cfg: EncoderConfig,
                   fingerprint: str) -> EncodedMemory:
    """The real encoder over the conversation (context windows of preceding turns)."""
    turn_texts, specs = turns_and_facts(turns, facts)
    return encode_facts(model, tokenizer, turn_texts, specs,
                        EncodingIdentity.of_model(cfg, fingerprint, model), progress=False)


def publish_memory(root: str | Path, user: str, turns: pa.Table, facts: pa.Table,
                   encoded: EncodedMemory) -> str:
    """Publish (no LanceDB table: the GPU machine has no lancedb) -> version id."""
    res = publish(StoreConfig(str(root)), user, encoded, facts,
                  Lineage(turns_hash(turns), f"bench-{facts.num_rows}"), embeddings=False)
    return res.version


def placed_bytes(manifest: Manifest, engine_dtype: str, cuda: bool) -> int:
    """The bytes a published version takes placed in the tiers of an engine of
    ``engine_dtype`` (fp8 kept with its scales on CUDA, dequantized on the CPU), from
    its manifest alone, as the worker's loader counts them."""
    stored = getattr(torch, manifest.kv["dtype"])
    return slab_nbytes(manifest, kept_dtype(stored, getattr(torch, engine_dtype), cuda))
