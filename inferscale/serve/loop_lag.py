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

What held it: with ``on_stall`` a watchdog thread checks the probe's heartbeat every
``stall_s / 4`` and, once per stall, when the loop has not woken for ``stall_s``, hands
over how long so far and the loop thread's Python stack (``sys._current_frames``): a
callback that computes shows itself there. A stall the watchdog did not see (it looks
every ``stall_s / 4``, so one of 100-125 ms was mostly missed, and a thread holding the
GIL keeps it out) is reported by the probe itself once the loop wakes, with its whole
length and no stack: every stall is counted once. A thread holding the GIL in C (a garbage
collection among them) keeps the watchdog out too, so with ``on_gc`` every collection
that takes ``stall_s`` or more is reported with its generation (``gc.callbacks``).
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
import traceback
from typing import Callable

INTERVAL_S = 0.01
STALL_S = 0.1  # a loop not woken for this long is a stall


class LoopLagProbe:
    """Measures the loop it is started on (:meth:`start`) until :meth:`stop`; with
    ``on_stall(seconds, stack)`` and ``on_gc(seconds, generation)``, says what held it."""

    def __init__(self, observe: Callable[[float], None], interval_s: float = INTERVAL_S,
                 on_stall: Callable[[float, str], None] | None = None,
                 on_gc: Callable[[float, int], None] | None = None, stall_s: float = STALL_S):
        if interval_s <= 0 or not stall_s > interval_s:
            raise ValueError(f"need interval_s > 0 and stall_s > interval_s, got "
                             f"{interval_s}, {stall_s}")
        self.observe, self.interval_s, self.stall_s = observe, interval_s, stall_s
        self.on_stall, self.on_gc = on_stall, on_gc
        self._task: asyncio.Task | None = None
        self._beat: tuple[float, int] | None = None  # last wake-up, the loop's thread id
        self._stopped = threading.Event()  # the running watchdog's (one per start)
        self._gc_at: float | None = None
        self._claim = threading.Lock()  # a stall is reported by the watchdog or the probe
        self._reported: tuple[float, int] | None = None  # the heartbeat last reported

    def start(self) -> None:
        """Probe the running loop; a no-op while a probe runs there already (so every
        request may call it), a new probe when the earlier loop has gone (tests run one
        server on several loops)."""
        loop = asyncio.get_running_loop()
        task = self._task
        if task is not None and not task.done() and task.get_loop() is loop:
            return
        self._task = loop.create_task(self._run(), name="inferscale-loop-lag")
        if self.on_stall is not None:
            self._stopped.set()  # an earlier loop's watchdog, if any
            self._stopped = threading.Event()
            threading.Thread(target=self._watchdog, args=(self._stopped,), daemon=True,
                             name="inferscale-loop-watchdog").start()
        if self.on_gc is not None and self._gc not in gc.callbacks:
            gc.callbacks.append(self._gc)

    @property
    def running(self) -> bool:
        """Probing a loop that runs: a loop stopped or closed without :meth:`stop` (a
        test's server thread at exit) leaves its task pending, and is not."""
        task = self._task
        return task is not None and not task.done() and task.get_loop().is_running()

    def stop(self) -> None:
        """Stop probing (from the loop's thread, or once its loop has closed)."""
        task, self._task = self._task, None
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.cancel()
        self._stopped.set()
        self._beat = None
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)

    async def _run(self) -> None:
        clock, interval = time.perf_counter, self.interval_s
        me = threading.get_ident()
        while True:
            due = clock() + interval
            self._beat = beat = (due - interval, me)
            await asyncio.sleep(interval)
            lag = max(0.0, clock() - due)
            self.observe(lag)
            if self.on_stall is not None and lag >= self.stall_s and self._first(beat):
                self.on_stall(lag, "")  # the watchdog missed it: no stack to give

    def _first(self, beat: tuple[float, int]) -> bool:
        """Whether ``beat``'s stall is reported by this caller (it was not yet)."""
        with self._claim:
            if self._reported == beat:
                return False
            self._reported = beat
            return True

    def _watchdog(self, stopped: threading.Event) -> None:
        while not stopped.wait(self.stall_s / 4):
            if not self.running:  # its loop ended without stop()
                return
            beat = self._beat
            if beat is None:
                continue
            held = time.perf_counter() - beat[0] - self.interval_s
            if held >= self.stall_s and self._reported != beat:
                frame = sys._current_frames().get(beat[1])
                stack = "".join(traceback.format_stack(frame, limit=12)) if frame else ""
                if self._first(beat):
                    self.on_stall(held, stack)

    def _gc(self, phase: str, info: dict) -> None:
        if not self.running:  # its loop ended without stop(): stop() or start() removes it
            return
        if phase == "start":
            self._gc_at = time.perf_counter()
        elif self._gc_at is not None:
            took, self._gc_at = time.perf_counter() - self._gc_at, None
            if took >= self.stall_s:
                self.on_gc(took, int(info.get("generation", -1)))
