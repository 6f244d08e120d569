"""Helpers for tests that run the real vLLM engine (SmolLM2, float32, eager, CPU).

One engine per test session (it takes ~20 s to start and several GB of memory); an
asyncio loop in a background thread drives it for synchronous tests.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import torch

from inferscale.compose import Composer
from inferscale.encode import PREFIX_ID, EncodedMemory, Segment, encode_segments
from inferscale.facts import fact_id
from storage_schemas import facts as facts_schema


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


def facts_table(user: str, texts: list[str], token_ids: list[list[int]], embedder) -> pa.Table:
    emb = embedder.embed(texts).cpu().numpy()
    return pa.table({
        "fact_id": [fact_id(user, f"t{i}", t) for i, t in enumerate(texts)],
        "user": [user] * len(texts),
        "source_turn_id": [f"t{i}" for i in range(len(texts))],
        "source_index": list(range(len(texts))),
        "text": texts,
        "token_ids": token_ids,
        "embedding": [list(map(float, e)) for e in emb],
    }, schema=facts_schema.schema(emb.shape[1]))


def limiting_memory(model, tokenizer, user: str, texts: list[str], fingerprint: str,
                    embedder, dtype: torch.dtype = torch.float32
                    ) -> tuple[EncodedMemory, pa.Table]:
    """The limiting case: each fact encoded with the whole memory before it (instruction
    prefix and the preceding facts) as its window -> exactly a joint prefill's KV."""
    composer = Composer(tokenizer)
    prefix = composer.prefix_ids()
    ids = [composer.fact_ids(t) for t in texts]
    table = facts_table(user, texts, ids, embedder)
    fids = table.column("fact_id").to_pylist()
    segments = [Segment((), ((PREFIX_ID, tuple(prefix)),))]
    before = list(prefix)
    for fid, f in zip(fids, ids):
        segments.append(Segment(tuple(before), ((fid, tuple(f)),)))
        before += f
    chunks = {c.chunk_id: c for c in encode_segments(model, segments, out_dtype=dtype,
                                                     batch_tokens=8192)}
    ordered = [chunks[PREFIX_ID]] + [chunks[f] for f in fids]
    return EncodedMemory(ordered, fingerprint, {"limiting_case": True, "dtype": str(dtype)}), table


def memory_prompt(tokenizer, table: pa.Table, question: str) -> tuple[list[int], tuple[str, ...]]:
    """Prompt ids with every fact in stored order, and the chunk list naming them."""
    composer = Composer(tokenizer)
    chunks = (PREFIX_ID, *table.column("fact_id").to_pylist())
    memory = [composer.prefix_ids()] + table.column("token_ids").to_pylist()
    return composer.compose(memory, question)[0], chunks


def artifact_root(tmp: Path) -> str:
    return str(tmp / "artifacts")


@contextmanager
def served_app(loop: LoopThread, server, policy, model_name: str = "smollm2"):
    """``inferscale.serve``'s app for ``server`` on 127.0.0.1 and a free port, run by
    uvicorn on ``loop`` (the engine's loop); yields the base URL."""
    import socket
    import time

    import httpx
    import uvicorn

    from inferscale.serve import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = uvicorn.Server(uvicorn.Config(create_app(server, policy, model_name),
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
        yield url
    finally:
        web.should_exit = True
        done.result(30)
