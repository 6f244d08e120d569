"""Helpers for tests that run the real vLLM engine (SmolLM2, float32, eager, CPU).

One engine per test session (it takes ~20 s to start and several GB of memory); an
asyncio loop in a background thread drives it for synchronous tests. Memories of a few
hand-written facts (:data:`FACTS`, asked :data:`QUESTIONS`): :func:`facts_of` their facts
table, :func:`limiting_memory` their limiting-case encoding (the K/V of one prefill of
the memory list: ``inferscale.encode.encoder.encode_limiting``), :func:`memory_prompt`
a prompt with every fact in stored order, :func:`publish_user` both published.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import torch

from inferscale.artifacts.publish import Lineage, publish
from inferscale.compose import Composer
from inferscale.encode.encoder import EncodedMemory, encode_limiting
from inferscale.facts.table import facts_table
from inferscale.types import PREFIX_ID

FACTS = [
    "Caroline adopted a golden retriever named Rex in March 2023.",
    "Caroline works as a night-shift nurse at Boston General Hospital.",
    "Caroline's sister Melanie lives in Lisbon and teaches piano.",
    "Caroline ran the Boston marathon in 3 hours and 41 minutes.",
    "Caroline is allergic to peanuts and shellfish.",
    "Caroline's favourite book is The Left Hand of Darkness.",
]
QUESTIONS = [
    "What is the name of Caroline's dog?", "Where does Caroline work?",
    "Where does Melanie live?", "What does Melanie teach?",
    "How long did Caroline's marathon take?", "What is Caroline allergic to?",
    "What is Caroline's favourite book?", "What breed is Rex?",
    "When did Caroline adopt her dog?", "Does Caroline work during the day?",
    "Who is Melanie?", "Summarize what you know about Caroline.",
]


def facts_of(user: str, texts: list[str], tokenizer, embedder) -> pa.Table:
    """``user``'s facts table: each text one fact, from turns ``t0``, ``t1``, ..."""
    turns = [{"turn_id": f"t{i}", "turn_index": i} for i in range(len(texts))]
    return facts_table(user, list(zip(turns, texts)), embedder.embed(texts).cpu().numpy(),
                       tokenizer)


def limiting_memory(model, tokenizer, user: str, texts: list[str], fingerprint: str,
                    embedder, dtype: torch.dtype = torch.float32
                    ) -> tuple[EncodedMemory, pa.Table]:
    """``texts`` as ``user``'s facts, encoded in the limiting case (each fact after the
    instruction prefix and the facts before it): (memory, facts table)."""
    table = facts_of(user, texts, tokenizer, embedder)
    facts = list(zip(table.column("fact_id").to_pylist(), table.column("token_ids").to_pylist()))
    return encode_limiting(model, Composer(tokenizer).prefix_ids(), facts, fingerprint,
                           dtype), table


def memory_prompt(tokenizer, table: pa.Table, question: str) -> tuple[list[int], tuple[str, ...]]:
    """Prompt ids with every fact in stored order, and the chunk list naming them."""
    composer = Composer(tokenizer)
    chunks = (PREFIX_ID, *table.column("fact_id").to_pylist())
    memory = [composer.prefix_ids()] + table.column("token_ids").to_pylist()
    return composer.compose(memory, question)[0], chunks


def publish_user(env, embedder, user, texts, *, lineage="log-1", dtype=torch.float32):
    """:func:`limiting_memory` of ``texts`` published for ``user`` in ``env``'s store
    (``engine_env``): (version, facts table)."""
    mem, table = limiting_memory(env.model.model, env.model.tokenizer, user, texts,
                                 env.model.fingerprint, embedder, dtype)
    res = publish(env.store, user, mem, table, Lineage(lineage, f"facts-{lineage}"),
                  embeddings=False)
    return res.version, table


def gen(env, ids, ref=None, max_tokens=24):
    """``env``'s engine's answer to prompt ``ids`` (with the memory ``ref`` names)."""
    return env.loop.run(env.engine.generate(ids, ref, max_tokens=max_tokens))


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
        """Cancel the tasks still on the loop (an engine's output handler, cancelled from
        this thread by its shutdown, would otherwise be destroyed pending), then stop."""
        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            if rest:
                await asyncio.wait(rest, timeout=5)

        if self.thread.is_alive():
            self.run(cancel_rest(), timeout=30)
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
