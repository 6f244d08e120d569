"""``inferscale serve``: an OpenAI-compatible server that answers from user memory.

Per request: authenticate -> the user whose memory it may use -> embed the query ->
exact top-k of that user's facts (on the GPU when there is one) -> compose
``[instruction prefix | facts | query]`` from stored token ids -> generate on the vLLM
engine with the memory KV injected by the connector (``--mode kv``), or with the facts
as text and a full prefill (``--mode prompt``, the Mem0-style baseline on the same engine
and the same retrieval).

Who may use whose memory: with ``INFERSCALE_API_KEYS`` (JSON ``{"key": "user"}``) a bearer
key decides the user (a ``user`` field naming someone else is refused); with
``INFERSCALE_TRUSTED_USER_HEADER`` a gateway's header decides; with neither, the body's
``user`` field decides, which is allowed only on a loopback address. Admin endpoints
(``/admin/hydrate``, ``/admin/evict``, ``/admin/status``) need ``INFERSCALE_ADMIN_KEY``
off loopback. Binding beyond loopback without keys refuses to start.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

# FastAPI resolves the endpoints' (string) annotations in this module's globals: without
# Request here, every ``req: Request`` parameter is taken for a required query parameter.
from fastapi import Request  # noqa: F401

from inferscale.compose import Composer, memory_layout
from inferscale.encode import PREFIX_ID
from inferscale.engine import MemoryEngine, MemoryRef

log = logging.getLogger("inferscale.serve")
Mode = Literal["kv", "prompt"]


class ServeError(RuntimeError):
    """A configuration the server refuses to start with."""


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class AccessPolicy:
    """Maps a request to the user whose memory it may use; checks admin access."""

    api_keys: dict[str, str]
    admin_key: str | None
    trusted_user_header: str | None
    loopback: bool

    def __post_init__(self) -> None:
        if not self.loopback and not (self.api_keys or self.trusted_user_header):
            raise ServeError("binding beyond loopback needs INFERSCALE_API_KEYS or "
                             "INFERSCALE_TRUSTED_USER_HEADER: refusing to start")
        if not self.loopback and not self.admin_key:
            raise ServeError("binding beyond loopback needs INFERSCALE_ADMIN_KEY: "
                             "refusing to start")

    def user_for(self, headers: dict[str, str], body_user: str | None) -> str | None:
        """The user, or raise PermissionError. ``None``: no user (answers without memory)."""
        if self.trusted_user_header:
            user = headers.get(self.trusted_user_header.lower())
            if not user:
                raise PermissionError(f"missing {self.trusted_user_header} header")
            return user
        if self.api_keys:
            key = _bearer(headers)
            user = self.api_keys.get(key or "")
            if user is None:
                raise PermissionError("unknown API key")
            if body_user and body_user != user:
                raise PermissionError("this API key may not use another user's memory")
            return user
        return body_user

    def check_admin(self, headers: dict[str, str]) -> None:
        if self.admin_key is None:
            if not self.loopback:
                raise PermissionError("admin endpoints are closed")
            return
        if _bearer(headers) != self.admin_key:
            raise PermissionError("admin key required")


def _bearer(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


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
        from inferscale.artifacts import read_facts, read_manifest
        from inferscale.retrieval import FactIndex

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

    async def hydrate(self, user: str, tier: str = "gpu", version: str = "latest") -> dict:
        mem = self.load_user(user, version)
        result = await self.engine.hydrate(user, mem.version, tier)
        return {**result, "facts": len(mem.fact_ids)}

    async def evict(self, user: str) -> bool:
        self.users.pop(user, None)
        return await self.engine.evict(user)


# ---------------------------------------------------------------------------- HTTP


def create_app(server: MemoryServer, policy: AccessPolicy, model_name: str):
    """The FastAPI app: OpenAI chat completions (streaming too) and admin endpoints."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="InferScale", version="0.1.0")

    def headers_of(req: Request) -> dict[str, str]:
        return {k.lower(): v for k, v in req.headers.items()}

    def user_of(req: Request, body: dict) -> str | None:
        try:
            return policy.user_for(headers_of(req), body.get("user"))
        except PermissionError as exc:
            raise HTTPException(status_code=401, detail=str(exc)) from exc

    def admin(req: Request) -> None:
        try:
            policy.check_admin(headers_of(req))
        except PermissionError as exc:
            raise HTTPException(status_code=401, detail=str(exc)) from exc

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "owned_by": "inferscale"}]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "mode": server.mode}

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        body = await req.json()
        user = user_of(req, body)
        messages = body.get("messages") or []
        question = next((m.get("content") for m in reversed(messages)
                         if m.get("role") == "user" and isinstance(m.get("content"), str)), None)
        if not question or not question.strip():
            raise HTTPException(status_code=400, detail="messages need a non-empty user message")
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens")
                         or server.max_tokens)
        temperature = float(body.get("temperature") or 0.0)
        options = body.get("inferscale") or {}
        k = options.get("top_k") or body.get("top_k")
        mode = options.get("mode")
        if mode not in (None, "kv", "prompt"):
            raise HTTPException(status_code=400, detail="inferscale.mode must be 'kv' or 'prompt'")
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.get("stream"):
            return StreamingResponse(
                _sse(server, user, question, k, mode, max_tokens, temperature, rid, created,
                     model_name),
                media_type="text/event-stream")
        out = await server.answer(user, question, k=k, max_tokens=max_tokens,
                                  temperature=temperature, mode=mode)
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
        admin(req)
        body = await req.json()
        if not body.get("user"):
            raise HTTPException(status_code=400, detail="'user' is required")
        tier = body.get("tier", "gpu")
        if tier not in ("gpu", "host"):
            raise HTTPException(status_code=400, detail="tier must be 'gpu' or 'host'")
        try:
            return await server.hydrate(body["user"], tier, body.get("version", "latest"))
        except FileNotFoundError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - surfaced to the admin with its reason
            raise HTTPException(status_code=409, detail=f"{type(exc).__name__}: {exc}") from exc

    @app.post("/admin/evict")
    async def evict(req: Request) -> dict:
        admin(req)
        body = await req.json()
        return {"user": body.get("user"), "evicted": await server.evict(str(body.get("user")))}

    @app.get("/admin/status")
    async def status(req: Request) -> dict:
        admin(req)
        return {"mode": server.mode, "users": sorted(server.users),
                "engine": await server.engine.status()}

    return app


async def _sse(server: MemoryServer, user, question, k, mode, max_tokens, temperature, rid,
               created, model_name):
    def chunk(delta: dict, finish: str | None = None, extra: dict | None = None) -> str:
        payload = {"id": rid, "object": "chat.completion.chunk", "created": created,
                   "model": model_name,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if extra:
            payload["inferscale"] = extra
        return f"data: {json.dumps(payload)}\n\n"

    ids, ref, info = server.prepare(user, question, k, mode)
    yield chunk({"role": "assistant", "content": ""})
    finish = None
    async for out in server.engine.stream(ids, ref, max_tokens=max_tokens,
                                          temperature=temperature):
        comp = out.outputs[0]
        finish = comp.finish_reason or finish
        if comp.text:
            yield chunk({"content": comp.text})
        await asyncio.sleep(0)
    yield chunk({}, finish or "stop", info)
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
    server = MemoryServer(engine, tokenizer, embedder, store, mode=mode, top_k=settings.top_k)
    return server, settings.model


def policy_from(settings: Any, host: str) -> AccessPolicy:
    return AccessPolicy(
        api_keys=dict(settings.api_keys),
        admin_key=settings.admin_key.get_secret_value() if settings.admin_key else None,
        trusted_user_header=settings.trusted_user_header, loopback=is_loopback(host))


async def serve_forever(settings: Any, mode: Mode, host: str, port: int) -> None:
    """``inferscale serve``: check the access policy first (before loading anything)."""
    import uvicorn

    policy = policy_from(settings, host)
    server, name = await start_server(settings, mode)
    try:
        app = create_app(server, policy, name)
        await uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info")).serve()
    finally:
        server.engine.shutdown()
