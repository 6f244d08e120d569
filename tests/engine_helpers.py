"""Helpers for tests that run the real vLLM engine (SmolLM2, float32, eager, CPU).

One engine per test session (it takes ~20 s to start and several GB of memory); an
asyncio loop in a background thread drives it for synchronous tests.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

# the limiting-case memory builders live in benchmarks/memory_setup.py (the equivalence
# benchmark uses them too); re-exported for the tests. conftest.py puts the repository
# (benchmarks/) on sys.path.
from benchmarks.memory_setup import facts_table, limiting_memory, memory_prompt  # noqa: F401


class LoopThread:
    """An event loop in a daemon thread; ``run(coro)`` waits for the result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 900):
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def start_engine(loop: LoopThread, engine, log: Path):
    """Start ``engine`` (a MemoryEngine) on ``loop``; its processes write their stdout and
    stderr into ``log`` (they inherit fds 1 and 2 when spawned)."""
    with open(log, "ab") as f:
        saved = os.dup(1), os.dup(2)
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            loop.run(engine.start())
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    return engine


def artifact_root(tmp: Path) -> str:
    return str(tmp / "artifacts")


@contextmanager
def served_app(loop: LoopThread, server, policy, model_name: str = "smollm2", limits=None):
    """``inferscale.serve``'s app for ``server`` (request ``limits``: the default
    RequestLimits when None) on 127.0.0.1 and a free port, run by uvicorn on ``loop``
    (the engine's loop); yields the base URL."""
    with serving(loop, server, policy, model_name, limits) as (url, _):
        yield url


@contextmanager
def serving(loop: LoopThread, server, policy, model_name: str = "smollm2", limits=None):
    """:func:`served_app`, yielding ``(url, uvicorn.Server)`` (its connections' flow
    control tells whether a send is paused)."""
    import socket
    import time

    import httpx
    import uvicorn

    from inferscale.serve.app import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = uvicorn.Server(uvicorn.Config(create_app(server, policy, model_name, limits),
                                        host="127.0.0.1", port=port, log_level="warning"))
    done = asyncio.run_coroutine_threadsafe(web.serve(), loop.loop)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    try:
        yield url, web
    finally:
        web.should_exit = True
        done.result(30)
