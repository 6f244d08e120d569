"""The memory server: retrieval, composition and the engine, per request.

Per request: the user's facts (loaded once per user from their artifact version) ->
embed the query -> exact top-k of that user's facts (on the GPU when there is one) ->
compose ``[instruction prefix | facts | query]`` from stored token ids -> generate on the
vLLM engine with the memory KV injected by the connector (mode ``kv``), or with the facts
as text and a full prefill (mode ``prompt``, the Mem0-style baseline on the same engine
and the same retrieval).

Callers: the HTTP app (:mod:`inferscale.serve.app`), benchmarks, tests.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from inferscale.encode.compose import Composer, memory_layout
from inferscale.serve.engine import EngineConfig, MemoryEngine, MemoryRef
from inferscale.types import PREFIX_ID, Tier

log = logging.getLogger("inferscale.serve")
Mode = Literal["kv", "prompt"]


@dataclass
class UserMemory:
    """What the server holds per user: the version, facts and their retrieval index."""

    user: str
    version: str
    fact_ids: list[str]
    texts: list[str]
    token_ids: dict[str, list[int]]  # chunk id -> token ids ("prefix" included)
    index: Any  # retrieval.FactIndex
    source_index: dict[str, int]  # fact id -> source turn index (chronological order)
    memory_order: str = "relevance"  # the artifact's composer settings (encoder config)
    text_tail: int = 0


class MemoryServer:
    """Retrieval + composition + the engine; the HTTP layer calls :meth:`answer`."""

    def __init__(self, engine: MemoryEngine, tokenizer: Any, embedder: Any, store: Any,
                 mode: Mode = "kv", top_k: int = 10, max_tokens: int = 128):
        self.engine, self.tokenizer, self.embedder, self.store = engine, tokenizer, embedder, store
        self.mode, self.top_k, self.max_tokens = mode, top_k, max_tokens
        self.fp = engine.config.model_fingerprint
        self.users: dict[str, UserMemory] = {}
        self._composers: dict[str, Composer] = {}

    def _composer(self, instruction: str | None) -> Composer:
        key = instruction or ""
        if key not in self._composers:
            self._composers[key] = (Composer(self.tokenizer, instruction) if instruction
                                    else Composer(self.tokenizer))
        return self._composers[key]

    def load_user(self, user: str, version: str = "latest") -> UserMemory:
        """Read a user's facts (texts, token ids, embeddings) for retrieval and composition."""
        from inferscale.artifacts.read import read_facts, read_manifest
        from inferscale.serve.retrieval import FactIndex

        manifest = read_manifest(self.store, user, self.fp, version)
        facts = read_facts(self.store, user, self.fp, manifest.version)
        fact_ids = facts.column("fact_id").to_pylist()
        token_ids = dict(zip(fact_ids, facts.column("token_ids").to_pylist()))
        composer = self._composer(manifest.encoder_config.get("instruction"))
        token_ids[PREFIX_ID] = composer.prefix_ids()
        enc = manifest.encoder_config
        mem = UserMemory(user, manifest.version, fact_ids, facts.column("text").to_pylist(),
                         token_ids, FactIndex.from_table(facts, device=self.embedder.device),
                         dict(zip(fact_ids, facts.column("source_index").to_pylist())),
                         enc.get("memory_order", "relevance"), int(enc.get("text_tail", 0)))
        self.users[user] = mem
        return mem

    def memory_of(self, user: str | None) -> UserMemory | None:
        if user is None:
            return None
        mem = self.users.get(user)
        if mem is None:
            try:
                mem = self.load_user(user)
            except Exception as exc:  # noqa: BLE001 - no memory: answer without it
                log.info("user %s has no usable memory (%s); answering without it", user, exc)
                return None
        return mem

    def prepare(self, user: str | None, question: str, k: int | None = None,
                mode: Mode | None = None) -> tuple[list[int], MemoryRef | None, dict]:
        """Embed, retrieve and compose: prompt ids, the memory to inject, timings.

        ``mode`` overrides the server's mode for this request (A/B on one engine)."""
        mode = mode or self.mode
        t0 = time.perf_counter()
        mem = self.memory_of(user)
        composer = self._composer(None)
        info: dict[str, Any] = {"user": user, "mode": mode, "facts": [], "version": None}
        if mem is None:
            ids = composer.compose([composer.prefix_ids()], question)[0]
            info["timings_ms"] = {"retrieve": 0.0, "compose": (time.perf_counter() - t0) * 1e3}
            return ids, None, info
        q = self.embedder.embed([question])
        t1 = time.perf_counter()
        facts = mem.index.topk(q[0], min(k or self.top_k, len(mem.fact_ids)))
        t2 = time.perf_counter()
        if mode == "kv":  # the artifact's layout: injected facts, then a text tail
            injected, tail = memory_layout(facts, mem.memory_order, mem.text_tail,
                                           mem.source_index)
        else:  # the baseline: every fact as text, best first
            injected, tail = list(facts), []
        chunks = (PREFIX_ID, *injected)
        ids, m = composer.compose([mem.token_ids[c] for c in chunks], question,
                                  [mem.token_ids[c] for c in tail])
        ref = MemoryRef(mem.user, mem.version, chunks) if mode == "kv" else None
        t3 = time.perf_counter()
        info.update(facts=list(facts), version=mem.version, memory_tokens=m,
                    text_tail_tokens=sum(len(mem.token_ids[c]) for c in tail), timings_ms={
                        "embed": (t1 - t0) * 1e3, "retrieve": (t2 - t1) * 1e3,
                        "compose": (t3 - t2) * 1e3})
        return ids, ref, info

    async def answer(self, user: str | None, question: str, *, k: int | None = None,
                     max_tokens: int | None = None, temperature: float = 0.0,
                     mode: Mode | None = None) -> dict:
        t0 = time.perf_counter()
        ids, ref, info = self.prepare(user, question, k, mode)
        gen = await self.engine.generate(ids, ref, max_tokens=max_tokens or self.max_tokens,
                                         temperature=temperature)
        info["timings_ms"].update(engine_ttft=gen.ttft_s * 1e3,
                                  query_to_first_token=(time.perf_counter() - t0 - gen.total_s
                                                        + gen.ttft_s) * 1e3)
        info.update(injected_tokens=gen.injected_tokens, cached_tokens=gen.cached_tokens)
        return {"generation": gen, "info": info}

    async def hydrate(self, user: str, *, version: str = "latest", tier: Tier = "gpu") -> dict:
        """Load ``user``'s facts (for retrieval) and KV (into the engine's ``tier``)."""
        mem = self.load_user(user, version)
        result = await self.engine.hydrate(user, version=mem.version, tier=tier)
        return {**result, "facts": len(mem.fact_ids)}

    async def evict(self, user: str) -> bool:
        self.users.pop(user, None)
        return await self.engine.evict(user)


async def start_server(settings: Any, mode: Mode = "kv") -> tuple[MemoryServer, str]:
    """Engine (with the connector), tokenizer, embedder and store from ``settings``."""
    import torch
    from transformers import AutoTokenizer

    from inferscale.artifacts.layout import StoreConfig
    from inferscale.encode.models import checkpoint_fingerprint, resolve_checkpoint
    from inferscale.serve.retrieval import Embedder

    cuda = torch.cuda.is_available() and settings.device != "cpu"
    ckpt = resolve_checkpoint(settings.model, settings.home)
    store = StoreConfig.from_settings(settings)
    engine = await MemoryEngine(EngineConfig(
        model=str(ckpt), model_fingerprint=checkpoint_fingerprint(ckpt, settings.home),
        dtype="auto" if cuda else "float32",
        gpu_memory_utilization=settings.gpu_memory_utilization,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        max_model_len=settings.max_model_len,
        tensor_parallel_size=settings.tensor_parallel_size,
        enforce_eager=settings.enforce_eager if settings.enforce_eager is not None else not cuda,
        artifact_root=store.root, storage_options=store.storage_options,
        gpu_budget_bytes=settings.gpu_budget_bytes, host_budget_bytes=settings.host_budget_bytes,
    )).start()
    embedder = Embedder(settings.embedder, device="cuda" if cuda else "cpu",
                        dtype=torch.float16 if cuda else None)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    server = MemoryServer(engine, tokenizer, embedder, store, mode=mode, top_k=settings.top_k)
    return server, settings.model
