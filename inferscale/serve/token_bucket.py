"""A token bucket with bookings: the rate limit on the memory cache's storage lookups of
unauthenticated users (:class:`~inferscale.serve.memory_cache.MemoryCache`)."""

from __future__ import annotations

import time


class TokenBucket:
    """A token bucket (``burst`` tokens, ``rate`` a second) with bookings (event-loop
    thread only): :meth:`reserve` takes a token, or books the next one to come, in
    arrival order, if it comes within ``max_wait`` seconds."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), time.monotonic()

    def reserve(self, max_wait: float) -> float | None:
        """Seconds to wait for the token now taken (0: at once); None: none within
        ``max_wait`` (nothing taken)."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        wait = (1 - self.tokens) / self.rate if self.rate > 0 else float("inf")
        if wait > max_wait:
            return None
        self.tokens -= 1  # booked: below zero until the refill pays it back
        return wait
