"""Helpers for tests that run the real vLLM engine (SmolLM2, float32, eager, CPU).

One engine per test session (it takes ~20 s to start and several GB of memory); an
asyncio loop in a background thread drives it for synchronous tests.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks/

# the limiting-case memory builders live in benchmarks/memory_setup.py (the equivalence
# benchmark uses them too); re-exported for the tests
from benchmarks.memory_setup import facts_table, limiting_memory, memory_prompt  # noqa: E402,F401


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


def artifact_root(tmp: Path) -> str:
    return str(tmp / "artifacts")
