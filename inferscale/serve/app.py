"""``inferscale serve``: an OpenAI-compatible server that answers from user memory.

Per request: authenticate -> the user whose memory it may use -> the memory server
(:class:`~inferscale.serve.server.MemoryServer`: retrieve, compose, generate with the
memory KV injected, ``--mode kv``, or the Mem0-style prompt baseline, ``--mode prompt``).

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
import time
import uuid
from dataclasses import dataclass
from typing import Any

# FastAPI resolves the endpoints' (string) annotations in this module's globals: without
# Request here, every ``req: Request`` parameter is taken for a required query parameter.
from fastapi import Request  # noqa: F401

from inferscale.serve.server import MemoryServer, Mode, start_server
from inferscale.types import TIERS


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
        if tier not in TIERS:
            raise HTTPException(status_code=400, detail="tier must be 'gpu' or 'host'")
        try:
            return await server.hydrate(body["user"], version=body.get("version", "latest"),
                                        tier=tier)
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
