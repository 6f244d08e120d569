"""The prefill work a server has handed its engine that has not come back yet.

vLLM reports how many requests wait at each step (``MemoryEngine.waiting_now``), but a
request that arrives while the engine runs one long prefill step (a cold request's
~2,500 tokens: ~60-70 ms on an H100) finds nothing waiting: the rest of that step is a
wait no statistic reports, and it is where two cold requests collide. The compute-or-load
split (:mod:`inferscale.serve.cold_split`) can hide a read in such a wait, so the server
keeps its own account: :class:`PrefillQueue` adds each request handed over with its
predicted prefill seconds, moving a virtual finish time on by them (from now, when
nothing was pending); when a request's first token comes (or it ends without one) its
work is done, and what is still pending is counted again from then, so a prediction's
error lasts only until the next first token. The server keeps a second one of the reads
it asks the workers for (:mod:`inferscale.serve.cold_requests`, seconds at the storage
bandwidth): a burst's prefetches go out faster than the workers report what is queued.
Event-loop thread only.
"""

from __future__ import annotations

import math
import time


class PrefillQueue:
    """Predicted seconds of prefill ahead of a request handed over now (:meth:`ahead`)."""

    def __init__(self) -> None:
        self._pending: dict[int, float] = {}  # handle -> predicted prefill seconds
        self._finish = 0.0  # monotonic: when the pending prefill is predicted done
        self._next = 0

    def submit(self, work_s: float, now: float | None = None) -> int:
        """A request handed to the engine with ``work_s`` seconds of prefill; its handle."""
        if not (math.isfinite(work_s) and work_s >= 0):
            raise ValueError(f"work_s must be finite and >= 0, got {work_s}")
        now = time.monotonic() if now is None else now
        handle, self._next = self._next, self._next + 1
        self._pending[handle] = work_s
        self._finish = max(self._finish, now) + work_s
        return handle

    def done(self, handle: int, now: float | None = None) -> None:
        """The request's first token came, or it ended without one (again: nothing)."""
        if self._pending.pop(handle, None) is None:
            return
        now = time.monotonic() if now is None else now
        self._finish = now + sum(self._pending.values())

    def ahead(self, now: float | None = None) -> float:
        """Seconds of prefill predicted before a request handed over at ``now`` starts."""
        if not self._pending:
            return 0.0
        now = time.monotonic() if now is None else now
        return max(0.0, self._finish - now)

    def __len__(self) -> int:
        return len(self._pending)
