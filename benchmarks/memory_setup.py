"""Build a benchmark user's memory from a LoCoMo conversation and publish it.

Every turn becomes one fact (``"Speaker: text"``), embedded with the packaged
MiniLM, tokenized on its own, encoded (real model) or filled with random KV (dummy-weight
shapes), and published as a real artifact, so the benchmarks hydrate and serve exactly
what production does. Imports only what the GPU machine has (no Mem0, no LanceDB).

Small hand-written memories (the equivalence benchmark, the connector tests through
``tests/engine_helpers.py``): :func:`facts_table` from texts, :func:`limiting_memory`
(each fact encoded with the whole memory before it: exactly a joint prefill's KV) and
:func:`memory_prompt` (every fact in stored order).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import torch

from inferscale.artifacts.layout import StoreConfig
from inferscale.artifacts.publish import Lineage, publish
from inferscale.encode.batches import Segment
from inferscale.compose import Composer, memory_text
from inferscale.encode.capture import EncodedChunk, encode_segments, kv_shape
from inferscale.encode.encoder import EncodedMemory, encode_facts
from inferscale.encode.identity import EncoderConfig, EncodingIdentity
from inferscale.facts.extractor import fact_id
from inferscale.ingest.logs import read_logs, turns_hash
from inferscale.kv_quant import is_quantized, quantize
from inferscale.pipeline.steps import turns_and_facts
from inferscale.types import PREFIX_ID, KVGeometry
from storage_schemas import facts as facts_schema


def load_turns(conversation: str | Path) -> pa.Table:
    (turns,) = read_logs(str(conversation)).turns.values()
    return turns


def turn_facts(turns: pa.Table, user: str, tokenizer, embedder, max_tokens: int = 256) -> pa.Table:
    """One fact per turn, for ``user``: the facts table the artifact stores."""
    rows = turns.sort_by("turn_index").to_pylist()
    texts = [f"{r['speaker']}: {r['text']}" for r in rows]
    composer = Composer(tokenizer)
    emb = embedder.embed(texts).cpu().numpy()
    return pa.table({
        "fact_id": [fact_id(user, r["turn_id"], t) for r, t in zip(rows, texts)],
        "user": [user] * len(rows),
        "source_turn_id": [r["turn_id"] for r in rows],
        "source_index": [r["turn_index"] for r in rows],
        "text": texts,
        "token_ids": [composer.fact_ids(t, max_tokens) for t in texts],
        "embedding": [list(map(float, e)) for e in emb],
    }, schema=facts_schema.schema(emb.shape[1]))


def raw_facts(turns: pa.Table, tokenizer, embedder, max_tokens: int = 256) -> pa.Table:
    """The pipeline's raw fact mode without Mem0: every turn one fact
    ``"[date] Speaker: text"`` (the same ids, texts and token ids ``extract_facts`` gives
    in raw mode), embedded with ``embedder``. For machines without Mem0/LanceDB."""
    rows = turns.sort_by("turn_index").to_pylist()
    user = rows[0]["user"]
    texts = [memory_text(r["speaker"], r["text"], r["timestamp"]) for r in rows]
    composer = Composer(tokenizer)
    emb = embedder.embed(texts).cpu().numpy()
    return pa.table({
        "fact_id": [fact_id(user, r["turn_id"], t) for r, t in zip(rows, texts)],
        "user": [user] * len(rows),
        "source_turn_id": [r["turn_id"] for r in rows],
        "source_index": [r["turn_index"] for r in rows],
        "text": texts,
        "token_ids": [composer.fact_ids(t, max_tokens) for t in texts],
        "embedding": [list(map(float, e)) for e in emb],
    }, schema=facts_schema.schema(emb.shape[1]))


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


def as_stored(memory: EncodedMemory, dtype: str) -> EncodedMemory:
    """``memory`` (encoded in a float dtype) stored in ``dtype`` instead: converted, or
    quantized per chunk for fp8 (what the encoder itself does with that stored dtype:
    capture in the compute dtype, then convert), with the encoder config's ``dtype`` set
    accordingly. One encoding, several storage formats."""
    chunks = []
    for c in memory.chunks:
        if c.scales is not None:
            raise ValueError("as_stored converts float encodings only")
        if is_quantized(dtype):
            kv, sc = quantize(c.kv)
        else:
            kv, sc = c.kv.to(getattr(torch, dtype)), None
        chunks.append(EncodedChunk(c.chunk_id, c.token_ids, kv, c.content_key, sc))
    return EncodedMemory(chunks, memory.model_fingerprint,
                         {**memory.encoder_config, "dtype": dtype}, memory.stats,
                         memory.calibration, memory.geometry)


def kv_errors(memory: EncodedMemory) -> dict:
    """How far stored K/V are from a float encoding (``memory``, float32 or bf16), for
    bf16 storage and two fp8 scale granularities: the stored format's (per chunk, K/V,
    layer, KV head) and per token (one scale per token, layer, head: what the format
    would need if chunk scales were too coarse). Relative RMS error over all chunks,
    K and V apart: sqrt(sum (x' - x)^2 / sum x^2)."""
    from inferscale.kv_quant import FP8_DTYPE, FP8_MAX, dequantize

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


def facts_table(user: str, texts: list[str], token_ids: list[list[int]], embedder) -> pa.Table:
    emb = embedder.embed(texts).cpu().numpy()
    return pa.table({
        "fact_id": [fact_id(user, f"t{i}", t) for i, t in enumerate(texts)],
        "user": [user] * len(texts),
        "source_turn_id": [f"t{i}" for i in range(len(texts))],
        "source_index": list(range(len(texts))),
        "text": texts,
        "token_ids": token_ids,
        "embedding": [list(map(float, e)) for e in emb],
    }, schema=facts_schema.schema(emb.shape[1]))


def limiting_memory(model, tokenizer, user: str, texts: list[str], fingerprint: str,
                    embedder, dtype: torch.dtype = torch.float32
                    ) -> tuple[EncodedMemory, pa.Table]:
    """The limiting case: each fact encoded with the whole memory before it (instruction
    prefix and the preceding facts) as its window -> exactly a joint prefill's KV."""
    composer = Composer(tokenizer)
    prefix = composer.prefix_ids()
    ids = [composer.fact_ids(t) for t in texts]
    table = facts_table(user, texts, ids, embedder)
    fids = table.column("fact_id").to_pylist()
    segments = [Segment((), ((PREFIX_ID, tuple(prefix)),))]
    before = list(prefix)
    for fid, f in zip(fids, ids):
        segments.append(Segment(tuple(before), ((fid, tuple(f)),)))
        before += f
    chunks = {c.chunk_id: c for c in encode_segments(model, segments, out_dtype=dtype,
                                                     batch_tokens=8192)}
    ordered = [chunks[PREFIX_ID]] + [chunks[f] for f in fids]
    return EncodedMemory(ordered, fingerprint, {"limiting_case": True, "dtype": str(dtype)},
                         geometry=kv_shape(model)), table


def memory_prompt(tokenizer, table: pa.Table, question: str) -> tuple[list[int], tuple[str, ...]]:
    """Prompt ids with every fact in stored order, and the chunk list naming them."""
    composer = Composer(tokenizer)
    chunks = (PREFIX_ID, *table.column("fact_id").to_pylist())
    memory = [composer.prefix_ids()] + table.column("token_ids").to_pylist()
    return composer.compose(memory, question)[0], chunks
