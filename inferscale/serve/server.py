"""The memory server: retrieval, composition and the engine, per request.

Per request: the user's facts (:mod:`inferscale.serve.memory_cache`: loaded off the event
loop, refreshed from LATEST every ``INFERSCALE_SERVE_REFRESH_S``, bounded by a byte
budget) -> embed the query -> exact top-k of that user's facts (on the GPU when there is
one) ->
compose ``[instruction prefix | facts | query]`` from stored token ids -> generate on the
vLLM engine with the memory KV injected by the connector (mode ``kv``), or with the facts
as text and a full prefill (mode ``prompt``, the Mem0-style baseline on the same engine
and the same retrieval); a request without a user or whose user has no memory is
answered from the question alone (mode ``none``); a user whose memory exists but goes
unused (its first lookup shed under load, a failed load, a refused version) is answered
so too, saying why in the answer's ``fallback`` (the cache's ``Lookup``). A ``kv``
request also carries how many of its leading chunks to read from storage should its user
be in neither tier (:mod:`inferscale.serve.cold_split`), and the workers start reading
those before the engine sees the request (:meth:`MemoryServer.answer_stream`). Every
request carries a ``cache_salt`` derived from its user, its memory's version and the mode
(:func:`inferscale.vllm_plugin.metadata.request_salt`), so no two users share prefix-cache
blocks. Every finished request is counted in the server's metrics
(:mod:`inferscale.serve.metrics`), and so is every request aborted before it finished
(its client went, or its caller cancelled it), with the tokens it had generated.

:class:`MemoryServer` is the single-engine :class:`~inferscale.serve.backend.MemoryBackend`
of the HTTP app. Every server is made by :func:`build_server` (``inferscale serve``'s
:func:`start_server` from the settings, the replicas, the benchmarks, the tests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from os import PathLike
from typing import Any, AsyncIterator

from inferscale.compose import ComposeError, memory_layout
from inferscale.encode.identity import served_layout
from inferscale.serve.backend import (
    Answer, AnswerInfo, AnswerRequest, Mode, PromptTooLong, Timings,
)
from inferscale.serve.cold_requests import ColdRequests
from inferscale.serve.cold_split import ColdSplitConfig, Split
from inferscale.serve.engine import EngineConfig, Generation, MemoryEngine, Progress
from inferscale.serve.memory_cache import (
    Lookup, MemoryCache, MemoryCacheConfig, MemoryRefused, UserMemory,
)
from inferscale.serve.metrics import ABORT_REASONS, ServingMetrics
from inferscale.serve.prefixes import Prefixes
from inferscale.serve.user_memory import TokenTable
from inferscale.types import PREFIX_ID, HydrateTarget
from inferscale.vllm_plugin.config import ConnectorConfig
from inferscale.vllm_plugin.metadata import MemoryRef, request_salt

log = logging.getLogger("inferscale.serve")


@dataclass(frozen=True)
class ServerConfig:
    """How the memory server answers: the default ``mode``, ``top_k`` (INFERSCALE_TOP_K)
    and ``max_tokens`` of a request that names none, its memory cache and its
    compute-or-load split."""

    mode: Mode = "kv"
    top_k: int = 10
    max_tokens: int = 128
    cache: MemoryCacheConfig = field(default_factory=MemoryCacheConfig)
    cold: ColdSplitConfig = field(default_factory=ColdSplitConfig)

    def __post_init__(self) -> None:
        if self.mode not in ("kv", "prompt"):
            raise ValueError(f"mode must be 'kv' or 'prompt', not {self.mode!r}")
        if self.top_k < 1 or self.max_tokens < 1:
            raise ValueError("top_k and max_tokens must be >= 1")

    @classmethod
    def from_settings(cls, settings: Any, mode: Mode = "kv") -> "ServerConfig":
        return cls(mode, settings.top_k, cache=MemoryCacheConfig.from_settings(settings),
                   cold=ColdSplitConfig.from_settings(settings))


@dataclass
class Prepared:
    """One request ready for the engine: prompt ids, memory to inject, salt, info, and
    the request's parameters. ``abort_reason``: set by whoever stops reading its answer
    and knows why (``client_disconnected``: the HTTP layer), for the abort count."""

    ids: list[int]
    ref: MemoryRef | None
    salt: str
    info: AnswerInfo
    request: AnswerRequest
    split: Split | None = None  # the facts to read should the user be in neither tier
    abort_reason: str | None = None


class MemoryServer:
    """Retrieval + composition + the engine: the single-engine
    :class:`~inferscale.serve.backend.MemoryBackend` (made by :func:`build_server`).

    ``engine`` None (with ``fingerprint``, the model's): retrieval and composition only,
    nothing generated (the load benchmark composes stock vLLM's prompts with it)."""

    def __init__(self, engine: MemoryEngine | None, tokenizer: Any, embedder: Any, store: Any,
                 config: ServerConfig, fingerprint: str | None = None):
        self.engine, self.tokenizer, self.embedder, self.store = engine, tokenizer, embedder, store
        self.config = config
        self.top_k, self.max_tokens = config.top_k, config.max_tokens
        self.fp = fingerprint or engine.config.model_fingerprint
        self.memories = MemoryCache(self.read_user, self.latest_version, config.cache)
        self.prefixes = Prefixes(tokenizer, self.max_model_len)  # composers by instruction
        # one thread: retrieval runs in request order, and the embedder's CUDA graphs are
        # replayed from one thread only
        self._retrieval = ThreadPoolExecutor(1, thread_name_prefix="inferscale-retrieval")
        self.cold = ColdRequests(config.cold)  # the compute-or-load split of users in no tier
        self.metrics = ServingMetrics(self.memories, self.cold.estimator)  # the app's /metrics

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def max_model_len(self) -> int | None:
        """The engine's context in tokens (None without an engine: nothing is checked)."""
        return self.engine.config.max_model_len if self.engine is not None else None

    @property
    def users(self) -> dict[str, str | None]:
        """user -> version held (None: no usable memory)."""
        return self.memories.held()

    def read_user(self, user: str, version: str = "latest") -> UserMemory:
        """Read a user's facts (texts, token ids, embeddings) for retrieval and
        composition. Blocking: the cache runs it on its thread pool. MemoryRefused for
        facts embedded in another dimension than the serving embedder's, for a layout in
        the encoder config that cannot be served, and for an instruction that is not text
        or whose prefix leaves no room in the model's context for any request (a
        40,000-character one made every request of its user a 400); the user's answers
        without memory then name the refusal (the cache's ``Lookup.fallback``)."""
        from inferscale.artifacts.read import read_facts, read_manifest
        from inferscale.serve.retrieval import FactIndex

        manifest = read_manifest(self.store, user, self.fp, version)
        try:
            layout = served_layout(manifest.encoder_config)
        except ComposeError as exc:  # every request of the user would fail to compose
            raise MemoryRefused(manifest.version, "layout", str(exc)) from exc
        prefix = self.prefixes.servable(manifest.version, manifest.encoder_config)
        facts = read_facts(self.store, user, self.fp, manifest.version, manifest=manifest)
        dim = facts.schema.field("embedding").type.list_size
        if dim != self.embedder.dim:  # every query of this user would fail in the top-k
            raise MemoryRefused(manifest.version, "embedding_dim",
                                f"its facts are embedded in {dim} dimensions; the serving "
                                f"embedder ({self.embedder.path}) makes {self.embedder.dim}")
        fact_ids = facts.column("fact_id").to_pylist()
        tokens = TokenTable.from_arrow(fact_ids, facts.column("token_ids"), {PREFIX_ID: prefix})
        return UserMemory(user, manifest.version, fact_ids, facts.column("text").to_pylist(),
                          tokens, FactIndex.from_table(facts, device=self.embedder.device),
                          dict(zip(fact_ids, facts.column("source_index").to_pylist())),
                          *layout, kv_row_bytes=_row_bytes(manifest.kv))

    def latest_version(self, user: str) -> str | None:
        from inferscale.artifacts.read import latest_version

        return latest_version(self.store, user, self.fp)

    def compose(self, mem: UserMemory | None, request: AnswerRequest) -> Prepared:
        """Embed, retrieve and compose ``request`` of a user whose memory is ``mem``.

        The request's ``mode`` overrides the server's (A/B on one engine)."""
        user, question = request.user, request.question
        mode = request.mode or self.mode
        t0 = time.perf_counter()
        composer = self.prefixes.composer(None)
        if mem is None:  # no memory to use: the question alone
            ids = composer.compose([self.prefixes.ids(None)], question)[0]
            info = AnswerInfo(user, "none", timings_ms=Timings(
                retrieve=0.0, compose=(time.perf_counter() - t0) * 1e3))
            return Prepared(ids, None, request_salt(user, None, mode), info, request)
        q = self.embedder.embed([question])
        t1 = time.perf_counter()
        facts = mem.index.topk(q[0], min(request.top_k or self.top_k, len(mem.fact_ids)))
        t2 = time.perf_counter()
        if mode == "kv":  # the artifact's layout: injected facts, then a text tail
            injected, tail = memory_layout(facts, mem.memory_order, mem.text_tail,
                                           mem.source_index, mem.tail_max_k)
        else:  # the baseline: every fact as text, best first
            injected, tail = list(facts), []
        chunks = (PREFIX_ID, *injected)
        memory = [mem.token_ids[c] for c in chunks]
        tail_ids = [mem.token_ids[c] for c in tail]
        ids, m = composer.compose(memory, question, tail_ids)
        # the version this server serves the user from: the workers replace an older one
        ref = MemoryRef(mem.user, mem.version, chunks, tuple(map(len, memory)),
                        supersedes=True) if mode == "kv" else None
        salt = ref.cache_salt() if ref else request_salt(mem.user, mem.version, mode)
        t3 = time.perf_counter()
        info = AnswerInfo(user, mode, list(facts), mem.version, memory_tokens=m,
                          text_tail_tokens=sum(map(len, tail_ids)),
                          timings_ms=Timings((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))
        return Prepared(ids, ref, salt, info, request)

    async def prepare(self, request: AnswerRequest) -> Prepared:
        """The user's memory (off the event loop), then :meth:`compose`; PromptTooLong
        when the prompt and ``max_tokens`` exceed the engine's context. The request's
        ``shed``: the user's first lookup may be shed under load (False: an API-key
        user); memory that goes unused is named in the info's ``fallback``."""
        t0 = time.perf_counter()
        self.metrics.loop_probe.start()  # on the loop that serves (a no-op once running)
        user = request.user
        found = await self.memories.lookup(user, request.shed) if user is not None \
            else Lookup(None)
        looked_up = time.perf_counter()
        # off the event loop, which streams every other request's tokens: embedding the
        # question and reading the top-k back from the GPU wait for the device
        p = await asyncio.get_running_loop().run_in_executor(
            self._retrieval, self.compose, found.memory, request)
        if found.fallback:
            p.info.fallback = found.fallback
        mem = found.memory
        if p.ref is not None and p.ref.lengths and mem.kv_row_bytes and self.cold.on:
            p.split = self.cold.split(self.engine, p.ref.lengths, mem.kv_row_bytes)
            p.ref = replace(p.ref, cold_chunks=p.split.chunks,
                            read_deadline_s=p.split.deadline_s)
        p.info.timings_ms.memory = (time.perf_counter() - t0) * 1e3
        p.info.timings_ms.lookup = (looked_up - t0) * 1e3
        limit, max_tokens = self.max_model_len, request.max_tokens or self.max_tokens
        if limit is not None and len(p.ids) + max_tokens > limit:
            raise PromptTooLong(f"the prompt is {len(p.ids)} tokens; with max_tokens "
                                f"{max_tokens} it exceeds the model's {limit}")
        return p

    async def answer_stream(self, prepared: Prepared,
                            started: float) -> AsyncIterator[str | Answer]:
        """Generate the prepared request (:meth:`prepare`, begun at ``started``,
        ``time.perf_counter()``) as tokens arrive: yield the text of each new output
        (``""`` for tokens without text of their own yet), then the :class:`Answer` as
        :meth:`answer` returns it. The finished request is counted in :attr:`metrics`.
        The app's streaming responses call this.

        Closed early or cancelled, it closes the engine's generation at once (vLLM aborts
        the request) and counts the abort: ``prepared.abort_reason``, else the reason a
        cancellation carries (``client_disconnected``), else ``cancelled``."""
        first = gen = None
        progress = Progress()
        p, request = prepared, prepared.request
        queued = self.cold.handed_over(len(p.ids), p.ref, p.split)
        try:
            await self.cold.prefetch(self.engine, p.ref, p.split)
            async with aclosing(self.engine.generate_stream(
                    p.ids, p.ref, max_tokens=request.max_tokens or self.max_tokens,
                    temperature=request.temperature, ignore_eos=request.ignore_eos,
                    cache_salt=p.salt, progress=progress)) as items:
                async for item in items:
                    if isinstance(item, Generation):
                        gen = item
                        continue
                    if first is None:
                        first = time.perf_counter()
                        self.cold.came_back(queued)
                    yield item
        except (asyncio.CancelledError, GeneratorExit) as exc:
            self._aborted(p, exc, progress.tokens)
            raise
        finally:
            self.cold.came_back(queued)
        assert gen is not None
        info, reply = p.info, gen.reply
        info.timings_ms.engine_ttft = gen.ttft_s * 1e3
        if gen.stages_s is not None:
            info.timings_ms.engine_queued, info.timings_ms.engine_prefill = \
                (s * 1e3 for s in gen.stages_s)
        info.timings_ms.query_to_first_token = ((first or started) - started) * 1e3
        info.injected_tokens, info.cached_tokens = reply.injected_tokens, gen.cached_tokens
        info.completion_tokens = len(gen.token_ids)
        if reply.facts_by_tier:
            info.facts_by_tier, info.storage_bytes = reply.facts_by_tier, reply.storage_bytes
        if reply.fallback is not None:
            info.fallback = reply.fallback
        self.cold.finished(p.ref, p.split, gen, info)
        self.metrics.observe(info, gen)
        yield Answer(gen, info)

    def _aborted(self, p: Prepared, exc: BaseException, tokens: int) -> None:
        said = exc.args[0] if isinstance(exc, asyncio.CancelledError) and exc.args else None
        reason = p.abort_reason or (said if said in ABORT_REASONS else "cancelled")
        mode = p.info.mode or "none"
        self.metrics.count_abort(mode, reason, tokens)
        log.info("a %s request of user %s was aborted (%s) after %d generated tokens", mode,
                 p.info.user, reason, tokens)

    async def answer(self, request: AnswerRequest) -> Answer:
        """Memory, retrieve, compose, generate: the :class:`Answer` (the generation, and
        its :class:`~inferscale.serve.backend.AnswerInfo`)."""
        started = time.perf_counter()
        p = await self.prepare(request)
        async for item in self.answer_stream(p, started):
            if isinstance(item, Answer):
                return item
        raise RuntimeError("the answer finished without a result")

    async def status(self) -> dict:
        """``/admin/status``: the mode, the users and versions held, their bytes, the
        compute-or-load split's state (``kv`` mode) and the engine's status (workers'
        residents, paths, counters)."""
        split = self.cold.status() if self.mode == "kv" else None
        return {"mode": self.mode, "users": sorted(self.users), "versions": self.users,
                "memory_bytes": self.memories.nbytes, "cold_split": split,
                "engine": await self.engine.status()}

    async def hydrate(self, user: str, *, version: str = "latest",
                      tier: HydrateTarget = "gpu") -> dict:
        """Load ``user``'s facts (for retrieval; an explicit version pins the user to it)
        and KV (into the engine's ``tier``; ``facts``: none, it stays in storage and its
        requests read or compute it, while their lookups find the facts held and, in
        ``kv`` mode, the workers its chunk index: ``index_primed``)."""
        mem = await self.memories.load(user, version)
        if tier == "facts":
            primed = self.mode == "kv" and self.engine is not None and \
                await self.engine.prime_index(user, mem.version)
            return {"user": user, "version": mem.version, "tier": "facts", "bytes": 0,
                    "facts": len(mem.fact_ids), "memory_bytes": mem.nbytes,
                    "index_primed": primed}
        result = await self.engine.hydrate(user, version=mem.version, tier=tier)
        self.cold.seen(user, True)
        return {**result, "facts": len(mem.fact_ids)}

    async def evict(self, user: str) -> bool:
        self.memories.drop(user)
        self.cold.seen(user, False)
        return await self.engine.evict(user)

    async def render_metrics(self) -> bytes:
        self.metrics.loop_probe.start()
        return await self.metrics.render(self.engine)

    def close(self) -> None:
        """Stop the memory cache's loads and shut the engine down (it unlinks its shared
        memory)."""
        self.metrics.loop_probe.stop()
        self.memories.close()
        if self.engine is not None:
            self.engine.shutdown()


def build_server(engine: MemoryEngine | None, tokenizer: Any, embedder: Any, store: Any,
                 config: ServerConfig | None = None, *,
                 fingerprint: str | None = None) -> MemoryServer:
    """A memory server: the one way one is made (:func:`start_server`, the replicas, the
    benchmarks, the tests).

    ``engine``: a running engine (several servers may share one), or None: retrieval and
    composition only, nothing generated, ``fingerprint`` naming the model (the load
    benchmark composes stock vLLM's prompts so). ``tokenizer``: the model's, or the
    checkpoint directory to load it from. ``store``: the artifact store's config."""
    if engine is None and not fingerprint:
        raise ValueError("a server without an engine needs the model's fingerprint")
    if engine is not None and fingerprint not in (None, engine.config.model_fingerprint):
        raise ValueError("fingerprint differs from the engine's model fingerprint")
    if isinstance(tokenizer, (str, PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return MemoryServer(engine, tokenizer, embedder, store, config or ServerConfig(),
                        fingerprint)


async def start_server(settings: Any, mode: Mode = "kv") -> tuple[MemoryServer, str]:
    """``inferscale serve``'s server: engine (with the connector), tokenizer, embedder
    and store from ``settings``; with the name it serves the model under."""
    import torch

    from inferscale.artifacts.layout import StoreConfig
    from inferscale.models import checkpoint_fingerprint, resolve_checkpoint
    from inferscale.serve.retrieval import Embedder

    ckpt = resolve_checkpoint(settings.model, settings.home)
    store = StoreConfig.from_settings(settings)
    connector = ConnectorConfig.from_store(
        store, model_fingerprint=checkpoint_fingerprint(ckpt, settings.home),
        gpu_budget_bytes=settings.gpu_budget_bytes, host_budget_bytes=settings.host_budget_bytes)
    engine = await MemoryEngine(EngineConfig.from_settings(settings, str(ckpt), connector)).start()
    cuda = settings.resolved_device().startswith("cuda")
    embedder = Embedder(settings.embedder, device="cuda" if cuda else "cpu",
                        dtype=torch.float16 if cuda else None)
    embedder.prewarm()
    return build_server(engine, ckpt, embedder, store,
                        ServerConfig.from_settings(settings, mode)), settings.model


async def serve_forever(settings: Any, mode: Mode, host: str, port: int) -> None:
    """``inferscale serve``: check the access policy first (before loading anything),
    then serve :func:`start_server`'s server until stopped."""
    from inferscale.serve.access import policy_from
    from inferscale.serve.api_models import RequestLimits
    from inferscale.serve.app import serve_app

    policy = policy_from(settings, host)
    server, name = await start_server(settings, mode)
    await serve_app(server, policy, name, host, port, RequestLimits.from_settings(settings))


def _row_bytes(kv: dict) -> int:
    """Stored KV bytes per memory token from a manifest's ``kv`` record (0: unknown)."""
    from storage_schemas.kv import ITEMSIZE

    try:
        return 2 * int(kv["layers"]) * int(kv["kv_heads"]) * int(kv["head_dim"]) * \
            ITEMSIZE[str(kv["dtype"])]
    except (KeyError, TypeError, ValueError):
        return 0
