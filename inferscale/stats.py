"""A fixed-bucket latency histogram, kept where the time is measured (the connector's
worker half, the loader) and exposed as a Prometheus histogram by the server's /metrics.
Thread-safe; observing is a few arithmetic operations."""

from __future__ import annotations

import bisect
import threading


def geometric(first: float, last: float, factor: float) -> tuple[float, ...]:
    """Bucket bounds ``first, first*factor, ...`` up to and including ``last``."""
    out, b = [], first
    while b < last * (1 + 1e-9):
        out.append(round(b, 9))
        b *= factor
    return tuple(out)


# 0.25 ms .. ~12 s in steps of 1.1x: fine enough to tell a p99 from 1.5x its p50
STEP_BUCKETS_S = geometric(0.00025, 12.0, 1.1)


class Histogram:
    """Counts per bucket (upper bounds ``buckets``; one more for +Inf) and their sum."""

    def __init__(self, buckets: tuple[float, ...] = STEP_BUCKETS_S):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        with self._lock:
            self.counts[i] += 1
            self.sum += value

    def snapshot(self) -> dict:
        """``{"buckets", "counts", "sum"}``, what the server's collector renders."""
        with self._lock:
            return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum}
