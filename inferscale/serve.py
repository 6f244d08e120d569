"""``inferscale serve``: an OpenAI-compatible server that answers from user memory.

Per request: authenticate (headers only) -> read and validate the body -> the user whose
memory it may use -> the user's memory (:mod:`inferscale.memory_cache`: loaded off the
event loop, refreshed from LATEST every ``INFERSCALE_SERVE_REFRESH_S``) -> embed the
query -> exact top-k of that user's facts (on the GPU when there is one) -> compose
``[instruction prefix | facts | query]`` from stored token ids -> generate on the vLLM
engine with the memory KV injected by the connector (``--mode kv``), or with the facts
as text and a full prefill (``--mode prompt``, the Mem0-style baseline on the same engine
and the same retrieval). Every request carries a ``cache_salt`` derived from its user,
its memory's version and the mode, so no two users share prefix-cache blocks.

Who may use whose memory: :mod:`inferscale.access`. Input limits: :class:`RequestLimits`
(``INFERSCALE_MAX_REQUEST_BYTES``, ``..._MAX_QUESTION_CHARS``, ``..._MAX_OUTPUT_TOKENS``,
``..._MAX_TOP_K``); a malformed or out-of-bounds field is a 400 naming it, an oversized
body a 413, never a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

# FastAPI resolves the endpoints' (string) annotations in this module's globals: without
# Request here, every ``req: Request`` parameter is taken for a required query parameter.
from fastapi import Request  # noqa: F401

from inferscale.access import AccessPolicy, ServeError, is_loopback  # noqa: F401 (re-exported)
from inferscale.api_models import (
    EvictRequest, HydrateRequest, RequestError, RequestLimits, chat_model, read_body, validate,
)
from inferscale.compose import Composer, memory_layout
from inferscale.encode import PREFIX_ID
from inferscale.engine import MemoryEngine, MemoryRef, request_salt
from inferscale.memory_cache import MemoryCache, MemoryCacheConfig, UserMemory  # noqa: F401

log = logging.getLogger("inferscale.serve")
Mode = Literal["kv", "prompt"]


class PromptTooLong(ValueError):
    """A composed prompt plus ``max_tokens`` beyond the engine's ``max_model_len``."""


@dataclass
class Prepared:
    """One request ready for the engine: prompt ids, memory to inject, salt, info."""

    ids: list[int]
    ref: MemoryRef | None
    salt: str
    info: dict


class MemoryServer:
    """Retrieval + composition + the engine; the HTTP layer calls :meth:`answer`."""

    def __init__(self, engine: MemoryEngine, tokenizer: Any, embedder: Any, store: Any,
                 mode: Mode = "kv", top_k: int = 10, max_tokens: int = 128,
                 cache: MemoryCacheConfig | None = None):
        self.engine, self.tokenizer, self.embedder, self.store = engine, tokenizer, embedder, store
        self.mode, self.top_k, self.max_tokens = mode, top_k, max_tokens
        self.fp = engine.config.model_fingerprint
        self.memories = MemoryCache(self.read_user, self.latest_version, cache)
        self._composers: dict[str, Composer] = {}

    @property
    def users(self) -> dict[str, str | None]:
        """user -> version held (None: no usable memory)."""
        return self.memories.held()

    def _composer(self, instruction: str | None) -> Composer:
        key = instruction or ""
        if key not in self._composers:
            self._composers[key] = (Composer(self.tokenizer, instruction) if instruction
                                    else Composer(self.tokenizer))
        return self._composers[key]

    def read_user(self, user: str, version: str = "latest") -> UserMemory:
        """Read a user's facts (texts, token ids, embeddings) for retrieval and
        composition. Blocking: the cache runs it on its thread pool."""
        from inferscale.artifacts import read_facts, read_manifest
        from inferscale.retrieval import FactIndex

        manifest = read_manifest(self.store, user, self.fp, version)
        facts = read_facts(self.store, user, self.fp, manifest.version)
        fact_ids = facts.column("fact_id").to_pylist()
        token_ids = dict(zip(fact_ids, facts.column("token_ids").to_pylist()))
        composer = self._composer(manifest.encoder_config.get("instruction"))
        token_ids[PREFIX_ID] = composer.prefix_ids()
        enc = manifest.encoder_config
        return UserMemory(user, manifest.version, fact_ids, facts.column("text").to_pylist(),
                          token_ids, FactIndex.from_table(facts, device=self.embedder.device),
                          dict(zip(fact_ids, facts.column("source_index").to_pylist())),
                          enc.get("memory_order", "relevance"), int(enc.get("text_tail", 0)))

    def latest_version(self, user: str) -> str | None:
        from inferscale.artifacts import latest_version

        return latest_version(self.store, user, self.fp)

    def load_user(self, user: str, version: str = "latest") -> UserMemory:
        """Read and hold ``version`` now, in this thread (benchmarks); an explicit
        version is pinned."""
        memory = self.read_user(user, version)
        self.memories.put(memory, pinned=version != "latest")
        return memory

    def compose(self, mem: UserMemory | None, user: str | None, question: str,
                k: int | None = None, mode: Mode | None = None) -> Prepared:
        """Embed, retrieve and compose for ``user`` whose memory is ``mem``.

        ``mode`` overrides the server's mode for this request (A/B on one engine)."""
        mode = mode or self.mode
        t0 = time.perf_counter()
        composer = self._composer(None)
        info: dict[str, Any] = {"user": user, "mode": mode, "facts": [], "version": None}
        if mem is None:
            ids = composer.compose([composer.prefix_ids()], question)[0]
            info["timings_ms"] = {"retrieve": 0.0, "compose": (time.perf_counter() - t0) * 1e3}
            return Prepared(ids, None, request_salt(user, None, mode), info)
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
        # the version this server serves the user from: the workers replace an older one
        ref = MemoryRef(mem.user, mem.version, chunks, supersedes=True) if mode == "kv" else None
        salt = ref.cache_salt() if ref else request_salt(mem.user, mem.version, mode)
        t3 = time.perf_counter()
        info.update(facts=list(facts), version=mem.version, memory_tokens=m,
                    text_tail_tokens=sum(len(mem.token_ids[c]) for c in tail), timings_ms={
                        "embed": (t1 - t0) * 1e3, "retrieve": (t2 - t1) * 1e3,
                        "compose": (t3 - t2) * 1e3})
        return Prepared(ids, ref, salt, info)

    def prepare(self, user: str | None, question: str, k: int | None = None,
                mode: Mode | None = None) -> tuple[list[int], MemoryRef | None, dict]:
        """:meth:`compose` with the memory held now, read in this thread if it is not
        (benchmarks); serving uses :meth:`request`."""
        mem = None
        if user is not None:
            mem = self.memories.peek(user)
            if mem is None:
                try:
                    mem = self.load_user(user)
                except Exception as exc:  # noqa: BLE001 - no memory: answer without it
                    log.info("user %s has no usable memory (%s)", user, exc)
        p = self.compose(mem, user, question, k, mode)
        return p.ids, p.ref, p.info

    async def request(self, user: str | None, question: str, k: int | None = None,
                      mode: Mode | None = None, max_tokens: int | None = None) -> Prepared:
        """The user's memory (off the event loop), then :meth:`compose`; PromptTooLong
        when the prompt and ``max_tokens`` exceed the engine's context."""
        t0 = time.perf_counter()
        mem = await self.memories.get(user) if user is not None else None
        p = self.compose(mem, user, question, k, mode)
        p.info["timings_ms"]["memory"] = (time.perf_counter() - t0) * 1e3
        limit = self.engine.config.max_model_len
        if len(p.ids) + (max_tokens or self.max_tokens) > limit:
            raise PromptTooLong(f"the prompt is {len(p.ids)} tokens; with max_tokens "
                                f"{max_tokens or self.max_tokens} it exceeds the model's "
                                f"{limit}")
        return p

    async def answer(self, user: str | None, question: str, *, k: int | None = None,
                     max_tokens: int | None = None, temperature: float = 0.0,
                     mode: Mode | None = None) -> dict:
        t0 = time.perf_counter()
        max_tokens = max_tokens or self.max_tokens
        p = await self.request(user, question, k, mode, max_tokens)
        gen = await self.engine.generate(p.ids, p.ref, max_tokens=max_tokens,
                                         temperature=temperature, cache_salt=p.salt)
        info = p.info
        info["timings_ms"].update(engine_ttft=gen.ttft_s * 1e3,
                                  query_to_first_token=(time.perf_counter() - t0 - gen.total_s
                                                        + gen.ttft_s) * 1e3)
        info.update(injected_tokens=gen.injected_tokens, cached_tokens=gen.cached_tokens)
        return {"generation": gen, "info": info}

    async def hydrate(self, user: str, tier: str = "gpu", version: str = "latest") -> dict:
        mem = await self.memories.load(user, version)
        result = await self.engine.hydrate(user, mem.version, tier)
        return {**result, "facts": len(mem.fact_ids)}

    async def evict(self, user: str) -> bool:
        self.memories.drop(user)
        return await self.engine.evict(user)


# ---------------------------------------------------------------------------- HTTP


def create_app(server: MemoryServer, policy: AccessPolicy, model_name: str,
               limits: RequestLimits | None = None):
    """The FastAPI app: OpenAI chat completions (streaming too) and admin endpoints.

    Each endpoint checks the credentials first (headers only), then reads the body
    within ``limits`` and validates it; every refusal is a 4xx with its reason."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse, StreamingResponse

    from inferscale.user_ids import InvalidUserIdError

    limits = limits or RequestLimits()
    ChatRequest = chat_model(limits)
    app = FastAPI(title="InferScale", version="0.1.0")

    @app.exception_handler(RequestError)
    async def refused(req: Request, exc: RequestError):
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    def headers_of(req: Request) -> dict[str, str]:
        return {k.lower(): v for k, v in req.headers.items()}

    def checked(fn, *args):
        """``fn(*args)`` with PermissionError -> 401 and a malformed user id -> 400."""
        try:
            return fn(*args)
        except PermissionError as exc:
            raise HTTPException(status_code=401, detail=str(exc)) from exc
        except InvalidUserIdError as exc:
            raise RequestError(400, str(exc)) from exc

    async def body_of(req: Request, model: Any) -> Any:
        body = await read_body(req.stream(), req.headers.get("content-length"),
                               limits.max_body_bytes)
        return validate(model, body)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "owned_by": "inferscale"}]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "mode": server.mode}

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        identity = checked(policy.identify, headers_of(req))
        body = await body_of(req, ChatRequest)
        user = checked(identity.resolve, body.user)
        question = body.question()
        k, mode, max_tokens, temperature = body.options()
        max_tokens = max_tokens or server.max_tokens
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        try:
            if body.stream:
                prepared = await server.request(user, question, k, mode, max_tokens)
                return StreamingResponse(
                    _sse(server, prepared, max_tokens, temperature, rid, created, model_name),
                    media_type="text/event-stream")
            out = await server.answer(user, question, k=k, max_tokens=max_tokens,
                                      temperature=temperature, mode=mode)
        except PromptTooLong as exc:
            raise RequestError(400, str(exc)) from exc
        gen, info = out["generation"], out["info"]
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text},
                         "finish_reason": gen.finish_reason or "stop"}],
            "usage": {"prompt_tokens": gen.prompt_tokens,
                      "completion_tokens": len(gen.token_ids),
                      "total_tokens": gen.prompt_tokens + len(gen.token_ids),
                      "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}},
            "inferscale": info,
        })

    @app.post("/admin/hydrate")
    async def hydrate(req: Request) -> dict:
        checked(policy.check_admin, headers_of(req))
        body = await body_of(req, HydrateRequest)
        try:
            return await server.hydrate(body.user, body.tier, body.version)
        except FileNotFoundError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - surfaced to the admin with its reason
            raise HTTPException(status_code=409, detail=f"{type(exc).__name__}: {exc}") from exc

    @app.post("/admin/evict")
    async def evict(req: Request) -> dict:
        checked(policy.check_admin, headers_of(req))
        body = await body_of(req, EvictRequest)
        return {"user": body.user, "evicted": await server.evict(body.user)}

    @app.get("/admin/status")
    async def status(req: Request) -> dict:
        checked(policy.check_admin, headers_of(req))
        return {"mode": server.mode, "users": sorted(server.users),
                "versions": server.users, "memory_bytes": server.memories.nbytes,
                "engine": await server.engine.status()}

    return app


async def _sse(server: MemoryServer, prepared: Prepared, max_tokens: int, temperature: float,
               rid: str, created: int, model_name: str):
    def chunk(delta: dict, finish: str | None = None, extra: dict | None = None) -> str:
        payload = {"id": rid, "object": "chat.completion.chunk", "created": created,
                   "model": model_name,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if extra:
            payload["inferscale"] = extra
        return f"data: {json.dumps(payload)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    finish = None
    async for out in server.engine.stream(prepared.ids, prepared.ref, max_tokens=max_tokens,
                                          temperature=temperature, cache_salt=prepared.salt):
        comp = out.outputs[0]
        finish = comp.finish_reason or finish
        if comp.text:
            yield chunk({"content": comp.text})
        await asyncio.sleep(0)
    yield chunk({}, finish or "stop", prepared.info)
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------- start-up


async def start_server(settings: Any, mode: Mode = "kv") -> tuple[MemoryServer, str]:
    """Engine (with the connector), tokenizer, embedder and store from ``settings``."""
    import torch
    from transformers import AutoTokenizer

    from inferscale.engine import EngineConfig
    from inferscale.models import checkpoint_fingerprint, resolve_checkpoint
    from inferscale.retrieval import Embedder
    from inferscale.store import StoreConfig

    cuda = torch.cuda.is_available() and settings.device != "cpu"
    ckpt = resolve_checkpoint(settings.model, settings.home)
    store = StoreConfig.from_settings(settings)
    engine = await MemoryEngine(EngineConfig(
        model=str(ckpt), model_fingerprint=checkpoint_fingerprint(ckpt, settings.home),
        dtype="auto" if cuda else "float32",
        gpu_memory_utilization=settings.gpu_memory_utilization,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        max_model_len=settings.max_model_len,
        enforce_eager=settings.enforce_eager if settings.enforce_eager is not None else not cuda,
        artifact_root=store.root, storage_options=store.storage_options,
        gpu_budget_bytes=settings.gpu_budget_bytes, host_budget_bytes=settings.host_budget_bytes,
    )).start()
    embedder = Embedder(settings.embedder, device="cuda" if cuda else "cpu",
                        dtype=torch.float16 if cuda else None)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    server = MemoryServer(engine, tokenizer, embedder, store, mode=mode, top_k=settings.top_k,
                          cache=MemoryCacheConfig(settings.serve_refresh_s,
                                                  settings.serve_memory_budget_bytes))
    return server, settings.model


def policy_from(settings: Any, host: str) -> AccessPolicy:
    def secret(value: Any) -> str | None:
        return value.get_secret_value() if value else None

    return AccessPolicy(
        api_keys=dict(settings.api_keys), admin_key=secret(settings.admin_key),
        trusted_user_header=settings.trusted_user_header, loopback=is_loopback(host),
        gateway_secret=secret(settings.gateway_secret))


async def serve_forever(settings: Any, mode: Mode, host: str, port: int) -> None:
    """``inferscale serve``: check the access policy first (before loading anything)."""
    import uvicorn

    policy = policy_from(settings, host)
    server, name = await start_server(settings, mode)
    try:
        app = create_app(server, policy, name, RequestLimits.from_settings(settings))
        await uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info")).serve()
    finally:
        server.memories.close()
        server.engine.shutdown()
