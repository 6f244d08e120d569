"""What loading costs a cold request beyond what the compute-or-load rule predicted.

The rule (:mod:`inferscale.serve.cold_split`) loads the largest leading run whose read,
by its estimates, ends no later than computing it would: at the margin, loading and
computing are predicted to tie. Errors of the estimates then all land on the loaded
requests: a read queued behind other reads on the disk, a read that ends just after a
step began (the request waits for the next), the step the load is handed over in. On an
H200 with 2,000 users (``benchmarks/results/load-h200-llama31-8b-u2000.json``, 5 rps)
the 11 requests that loaded, each predicted no slower than computing everything, took
p50 171 ms and 237 ms at most (p99 of 11), while the 127 cold requests that computed
took p99 99 ms: the step's p99 was the loaders'.

So the server measures the error: each finished cold request's engine time to its first
token (vLLM's queued plus prefill time) less what the rule's formula predicts for its
branch besides the tokens it computed (``max(R, W) + D`` when it loaded, ``W`` when it
did not; the computed tokens at ``c``): a residual per request, kept per branch over the
last ``window``. The excess ``E`` is the loaded residuals' ``quantile`` less the
computed ones' (errors both branches share cancel; never below 0), counted once each
branch has ``min_samples``; the rule adds ``E`` to a load's side. When loads stop paying,
``E`` grows until few requests load; as no loaded request then finishes, ``E`` halves
every ``half_life_s`` since the last one, so the split tries loading again when the
storage may have become faster.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class ExcessConfig:
    """``window`` residuals kept per branch, the ``quantile`` (0..1) compared, the
    ``min_samples`` each branch needs, ``half_life_s`` of the decay without loads."""

    window: int = 32
    quantile: float = 0.9
    min_samples: int = 3
    half_life_s: float = 60.0

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.min_samples <= self.window:
            raise ValueError("need window >= 1 and 1 <= min_samples <= window")
        if not 0.0 <= self.quantile <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {self.quantile}")
        if not self.half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {self.half_life_s}")


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by linear interpolation (numpy's default)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class LoadExcess:
    """Residuals per branch and the excess ``E`` of loading (module doc). Not
    thread-safe: the server's event loop feeds and reads it."""

    def __init__(self, config: ExcessConfig | None = None):
        self.config = config or ExcessConfig()
        self._loaded: deque[float] = deque(maxlen=self.config.window)
        self._computed: deque[float] = deque(maxlen=self.config.window)
        self._loaded_at: float | None = None  # when the last loaded request finished

    def observe(self, loaded: bool, residual_s: float, now: float) -> None:
        """One finished cold request: ``loaded`` whether its split read any chunk, its
        ``residual_s`` (engine time to first token less the prediction); non-finite
        residuals are dropped."""
        if not math.isfinite(residual_s):
            return
        if loaded:
            self._loaded.append(residual_s)
            self._loaded_at = now
        else:
            self._computed.append(residual_s)

    def excess(self, now: float) -> float:
        """``E`` in seconds at ``now``: 0 until both branches have ``min_samples``."""
        n = self.config.min_samples
        if len(self._loaded) < n or len(self._computed) < n or self._loaded_at is None:
            return 0.0
        q = self.config.quantile
        e = quantile(list(self._loaded), q) - quantile(list(self._computed), q)
        age = max(0.0, now - self._loaded_at)
        return max(0.0, e) * 0.5 ** (age / self.config.half_life_s)

    def counts(self) -> tuple[int, int]:
        """Residuals held: (loaded, computed)."""
        return len(self._loaded), len(self._computed)
