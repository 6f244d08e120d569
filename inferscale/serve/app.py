"""``inferscale serve``: an OpenAI-compatible server that answers from user memory.

Per request: authenticate (headers only: :mod:`inferscale.serve.access` decides who may
use whose memory) -> read and validate the body (:mod:`inferscale.serve.api_models`:
``INFERSCALE_MAX_REQUEST_BYTES``, ``..._MAX_QUESTION_CHARS``, ``..._MAX_OUTPUT_TOKENS``,
``..._MAX_TOP_K``; a malformed or out-of-bounds field is a 400 naming it, an oversized
body a 413, never a 500) -> the user whose memory it may use -> the backend (a
:class:`~inferscale.serve.backend.MemoryBackend`, the app's only view of what answers:
the single-engine :class:`~inferscale.serve.server.MemoryServer` or the Ray gateway's
replica set; retrieve, compose, generate with the memory KV injected, ``--mode kv``, or
the Mem0-style prompt baseline, ``--mode prompt``).
Admin endpoints (``/admin/hydrate``, ``/admin/evict``, ``/admin/status``) check the admin
key first, then validate their bodies the same way.

``GET /metrics`` is open, like vLLM's own (it names no user): vLLM's engine metrics and
the server's, in the Prometheus text format (:mod:`inferscale.serve.metrics`).
``GET /v1/models`` wants a chat request's credentials, less the user
(:meth:`~inferscale.serve.access.AccessPolicy.check_client`).

Beyond the OpenAI fields, a chat request may carry ``inferscale: {"mode", "top_k"}``,
``ignore_eos`` (as vLLM's server: generate exactly ``max_tokens``) and, when streaming,
``stream_options: {"include_usage": true}``. Streams send the first chunk (role and
text) when the first token is out, and the ``inferscale`` extras (facts, tokens,
fallback, timings) with the last.

A client that goes stops its request in the engine: a unary answer is cancelled by a
watch for the disconnect, a stream's whole generator chain is closed by its response
(:mod:`inferscale.serve.streaming`), whatever it was doing; either way vLLM aborts the
request and the server counts the abort (``client_disconnected``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable

# FastAPI resolves the endpoints' (string) annotations in this module's globals: without
# Request here, every ``req: Request`` parameter is taken for a required query parameter.
from fastapi import Request  # noqa: F401

from inferscale.serve.access import AccessPolicy, DuplicateHeader
from inferscale.serve.api_models import (
    EvictRequest, HydrateRequest, RequestError, RequestLimits, chat_model, read_body, validate,
)
from inferscale.serve.backend import Answer, MemoryBackend, PromptTooLong
from inferscale.serve.streaming import ClosingStream


# ---------------------------------------------------------------------------- HTTP


def create_app(server: MemoryBackend, policy: AccessPolicy, model_name: str,
               limits: RequestLimits | None = None):
    """The FastAPI app: OpenAI chat completions (streaming too) and admin endpoints.

    Each endpoint checks the credentials first (headers only), then reads the body
    within ``limits`` and validates it; every refusal is a 4xx with its reason."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse, Response

    from inferscale.types import InvalidUserIdError

    limits = limits or RequestLimits()
    ChatRequest = chat_model(limits)
    app = FastAPI(title="InferScale", version="0.1.0")

    @app.exception_handler(RequestError)
    async def refused(req: Request, exc: RequestError):
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    def headers_of(req: Request) -> dict[str, str]:
        """Lower-cased headers; 400 when an identity header comes twice."""
        try:
            return policy.single_headers(req.headers.items())
        except DuplicateHeader as exc:
            raise RequestError(400, str(exc)) from exc

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
    async def models(req: Request) -> dict:
        checked(policy.check_client, headers_of(req))  # a key when keys are set, as vLLM's
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "owned_by": "inferscale"}]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "mode": server.mode}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await server.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        identity = checked(policy.identify, headers_of(req))
        body = await body_of(req, ChatRequest)
        user = checked(identity.resolve, body.user)
        # an API key's user is never shed under load
        request = body.answer_request(user, shed=not identity.authenticated)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        try:
            if body.stream:
                started = time.perf_counter()
                prepared = await server.prepare(request)
                answer = server.answer_stream(prepared, started)
                usage = bool(body.stream_options and body.stream_options.include_usage)

                def gone() -> None:
                    prepared.abort_reason = "client_disconnected"

                return ClosingStream(_sse(answer, rid, created, model_name, usage),
                                     media_type="text/event-stream", on_disconnect=gone)
            out = await _unless_disconnected(req, server.answer(request))
        except PromptTooLong as exc:
            raise RequestError(400, str(exc)) from exc
        if out is None:  # the client went away: its request was aborted in the engine
            return Response(status_code=499)
        gen = out.generation
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text},
                         "finish_reason": gen.finish_reason or "stop"}],
            "usage": {"prompt_tokens": gen.prompt_tokens,
                      "completion_tokens": len(gen.token_ids),
                      "total_tokens": gen.prompt_tokens + len(gen.token_ids),
                      "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}},
            "inferscale": out.info.to_json(),
        })

    @app.post("/admin/hydrate")
    async def hydrate(req: Request) -> dict:
        checked(policy.check_admin, headers_of(req))
        body = await body_of(req, HydrateRequest)
        try:
            return await server.hydrate(body.user, version=body.version, tier=body.tier)
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
        return await server.status()

    return app


async def _unless_disconnected(req: Any, work: Awaitable[Any]) -> Any:
    """``await work``, unless the client disconnects first: then ``work`` is cancelled,
    saying ``client_disconnected`` (the engine aborts its request: vLLM's ``generate``
    aborts on cancellation; the server counts the abort with that reason) and None is
    returned. The body has been read: the next ASGI message is the disconnect."""
    async def disconnected() -> None:
        while (await req.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel("client_disconnected")
            # a cancel is only requested: wait until the work has taken it (the engine has
            # aborted), or task.result() below would find it still running
            await asyncio.wait({task})
    if task.cancelled():
        return None
    return task.result()


async def _sse(answer: AsyncIterator[str | Answer], rid: str, created: int, model_name: str,
               include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events of one answer: the first chunk (role and text) when the first
    token is out, one per new text, the last with the finish reason and the
    ``inferscale`` extras, then usage if asked for, then ``[DONE]``."""
    def chunk(delta: dict, finish: str | None = None, extra: dict | None = None) -> str:
        payload = {"id": rid, "object": "chat.completion.chunk", "created": created,
                   "model": model_name,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if extra:
            payload["inferscale"] = extra
        return f"data: {json.dumps(payload)}\n\n"

    started = False
    async with aclosing(answer) as items:  # closing the events closes the answer
        async for item in items:
            if isinstance(item, Answer):
                gen = item.generation
                if not started:  # no token at all (max_tokens reached at once)
                    yield chunk({"role": "assistant", "content": ""})
                yield chunk({}, gen.finish_reason or "stop", item.info.to_json())
                if include_usage:
                    completion = len(gen.token_ids)
                    yield "data: " + json.dumps({
                        "id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": model_name, "choices": [],
                        "usage": {"prompt_tokens": gen.prompt_tokens,
                                  "completion_tokens": completion,
                                  "total_tokens": gen.prompt_tokens + completion,
                                  "prompt_tokens_details": {
                                      "cached_tokens": gen.cached_tokens}},
                    }) + "\n\n"
            elif not started:
                started = True
                yield chunk({"role": "assistant", "content": item})
            elif item:
                yield chunk({"content": item})
            await asyncio.sleep(0)
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------- start-up


def freeze_startup_heap() -> int:
    """Collect, then move every object alive after start-up (vLLM, torch, the tokenizer,
    the engine's client) into the permanent generation, which no collection traverses
    again; returns how many. A full collection over what the server's process imports
    (vLLM, torch: ~740,000 objects) takes ~290 ms on a CPU core (``gc-pause-cpu.json``),
    every request in flight waiting it out
    (``inferscale_gc_pauses_total``); stock ``vllm serve`` freezes its start-up heap the
    same way (``freeze_gc_heap``)."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def serve_app(server: MemoryBackend, policy: AccessPolicy, model_name: str, host: str,
                    port: int, limits: RequestLimits | None = None,
                    log_level: str = "info") -> None:
    """Serve :func:`create_app` on ``host:port`` until stopped, then close the backend (it
    shuts its engine down) (``inferscale serve``; the load benchmark's server process).

    uvicorn re-raises SIGTERM once it has stopped serving; the default action would end
    the process before the engine shuts down, leaving vLLM's engine-core process and its
    workers behind. So a SIGTERM ends this coroutine with ``SystemExit`` instead, through
    the shutdown below (main thread only: a thread cannot set signal handlers)."""
    import signal
    import sys
    import threading

    import uvicorn

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        app = create_app(server, policy, model_name, limits)
        freeze_startup_heap()
        await uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                            log_level=log_level)).serve()
    finally:
        server.close()
