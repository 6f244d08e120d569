"""Build a benchmark user's memory from a LoCoMo conversation and publish it.

Every turn becomes one fact (``"Speaker: text"``), embedded with the packaged
MiniLM, tokenized on its own, encoded (real model) or filled with random KV (dummy-weight
shapes), and published as a real artifact, so the benchmarks hydrate and serve exactly
what production does. Imports only what the GPU machine has (no Mem0, no LanceDB).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import torch

from inferscale.artifacts import Lineage, publish
from inferscale.compose import Composer
from inferscale.encode import PREFIX_ID, EncodedChunk, EncodedMemory, EncoderConfig, encode_facts
from inferscale.facts import fact_id
from inferscale.logs import read_logs, turns_hash
from inferscale.pipeline import turns_and_facts
from inferscale.store import StoreConfig
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


def random_memory(facts: pa.Table, tokenizer, shape: tuple[int, int, int], dtype: torch.dtype,
                  fingerprint: str, seed: int = 0) -> EncodedMemory:
    """Random K/V ``[L, T, H, D]`` per chunk (for dummy-weight models, whose real KV would
    be as meaningless): right sizes, right token ids, no forward pass."""
    L, H, D = shape
    g = torch.Generator().manual_seed(seed)
    chunks = [(PREFIX_ID, Composer(tokenizer).prefix_ids())]
    chunks += list(zip(facts.column("fact_id").to_pylist(), facts.column("token_ids").to_pylist()))
    out = []
    for cid, ids in chunks:
        kv = torch.randn((2, L, len(ids), H, D), generator=g).to(dtype)
        out.append(EncodedChunk(cid, list(ids), kv[0], kv[1]))
    return EncodedMemory(out, fingerprint, {"random_kv": True, "dtype": str(dtype)})


def encoded_memory(model, tokenizer, turns: pa.Table, facts: pa.Table, cfg: EncoderConfig,
                   fingerprint: str) -> EncodedMemory:
    """The real encoder over the conversation (context windows of preceding turns)."""
    turn_texts, specs = turns_and_facts(turns, facts)
    return encode_facts(model, tokenizer, turn_texts, specs, cfg, fingerprint, progress=False)


def publish_memory(root: str | Path, user: str, turns: pa.Table, facts: pa.Table,
                   encoded: EncodedMemory) -> str:
    """Publish (no LanceDB table: the GPU machine has no lancedb) -> version id."""
    res = publish(StoreConfig(str(root)), user, encoded, facts,
                  Lineage(turns_hash(turns), f"bench-{facts.num_rows}"), embeddings=False)
    return res.version
