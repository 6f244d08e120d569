"""How late the server's event loop runs what is due: a probe that sleeps and measures.

:class:`LoopLagProbe` sleeps ``interval_s`` on the running loop, again and again, and
hands each overshoot (woken minus due, seconds) to ``observe``: the server's
``inferscale_event_loop_lag_seconds`` histogram (:class:`~inferscale.serve.metrics.
ServingMetrics`), a benchmark's list. Anything that holds the loop (a callback that
computes, a thread that holds the GIL, a garbage collection) delays every request's
next step by as much, and shows here as one long sample; an idle loop overshoots by the
selector's timeout rounding (~0.1-1 ms). Time the HTTP layer waits on the loop before a
request's handler starts is outside the server's own timers (``q2ft``): this is how a
scrape sees it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

INTERVAL_S = 0.01


class LoopLagProbe:
    """Measures the loop it is started on (:meth:`start`) until :meth:`stop`."""

    def __init__(self, observe: Callable[[float], None], interval_s: float = INTERVAL_S):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.observe, self.interval_s = observe, interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Probe the running loop; a no-op while a probe runs there already (so every
        request may call it), a new probe when the earlier loop has gone (tests run one
        server on several loops)."""
        loop = asyncio.get_running_loop()
        task = self._task
        if task is not None and not task.done() and task.get_loop() is loop:
            return
        self._task = loop.create_task(self._run(), name="inferscale-loop-lag")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def stop(self) -> None:
        """Stop probing (from the loop's thread, or once its loop has closed)."""
        task, self._task = self._task, None
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.cancel()

    async def _run(self) -> None:
        clock, interval = time.perf_counter, self.interval_s
        while True:
            due = clock() + interval
            await asyncio.sleep(interval)
            self.observe(max(0.0, clock() - due))
