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

**Per congestion.** Each residual keeps the prefill congestion ``ρ`` of its split or of
its finish, the larger (a request decided at the quiet start of a burst finishes inside
it), and ``E`` at ``ρ`` counts only residuals within ``busy_band`` of it: what loads cost
in an overload says little about a quiet engine. On an H100 with 200 users
(``benchmarks/results/load-h100-llama31-8b-run8-u200-refit.json``) the load benchmark's
warm-up burst (64 requests at 64 rps, p50 TTFT 735 ms: 8 cold requests loaded, 6
computed) left ``E`` at 326 ms; at 5 rps (ρ 0.07-0.2) the split then loaded nothing, and
a burst of four cold requests, each computing all its facts behind the others, held the
step's slowest answers (169-230 ms, a resident user's among them). With the band the
ninth run (``load-h100-llama31-8b-run9-u200.json``) still had ``E`` at 100-155 ms at
5 rps, and 225-455 ms under a 2,048-token budget: residuals near that ``ρ`` held it (the
warm-up's split ``ρ`` are not recorded). Those loads were late for a reason of their own:
the bandwidth estimate read up to 12 GB/s on a disk of ~1.7 (the workers' statistics
counted a read's time before its bytes; fixed in
:mod:`inferscale.vllm_plugin.storage_reads`), so reads were predicted several times
faster than they ran, and ``E`` rightly priced that.

**Per wait.** ``ρ`` alone did not tell a burst apart: the workers' congestion report lags
a three-second burst, so the warm-up's residuals still counted at ``ρ`` 0.01-0.03. The
eleventh H100 run (``benchmarks/results/load-h100-llama31-8b-run11-u200.json``) kept nine
from the warm-up (64 requests at 64 rps; the cold ones' splits saw ``W`` p50 481 ms, up
to 1,019), late by up to 385 ms, and ``E`` stood at 88-149 ms through the 5 rps step;
its three slowest answers were cold requests that had 46-70 ms of prefill ahead, in
which the rule would have read 820-1,540 of their ~2,500 tokens, and computed all (each
214-219 ms; vLLM's queue and prefill 167-199 ms of it). At 2,000 users the second
warm-up (``W`` p50 502 ms) held ``E`` at 115-226 ms the same way. A read hides in
``W``, so what a load cost behind a second of prefill says little about one hidden in
50 ms: a residual also keeps its split's ``W``, and ``E`` at ``W`` counts only residuals
whose ``W'`` is within ``wait_ratio`` of it, up to ``wait_floor_s`` either way
(``max(W, W') <= wait_ratio * min(W, W') + wait_floor_s``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# a finished cold request: loaded; the rule's seconds besides c T; the ρ it counts at;
# the W its split saw
Branch = tuple[bool, float, float, float]


@dataclass(frozen=True)
class ExcessConfig:
    """``window`` residuals kept per branch, the ``quantile`` (0..1) compared, the
    ``min_samples`` each branch needs (within the bands), ``half_life_s`` of the decay
    without loads, ``busy_band``: how far from today's ``ρ`` a residual's may be;
    ``wait_ratio`` and ``wait_floor_s``: how far from today's ``W`` its split's may be."""

    window: int = 32
    quantile: float = 0.9
    min_samples: int = 3
    half_life_s: float = 60.0
    busy_band: float = 0.25
    wait_ratio: float = 2.0
    wait_floor_s: float = 0.025

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.min_samples <= self.window:
            raise ValueError("need window >= 1 and 1 <= min_samples <= window")
        if not 0.0 <= self.quantile <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {self.quantile}")
        if not self.half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {self.half_life_s}")
        if not self.busy_band >= 0:
            raise ValueError(f"busy_band must be >= 0, got {self.busy_band}")
        if not (self.wait_ratio >= 1 and self.wait_floor_s >= 0):
            raise ValueError("need wait_ratio >= 1 and wait_floor_s >= 0, got "
                             f"{self.wait_ratio}, {self.wait_floor_s}")

    def near(self, busy: float, wait_s: float, busy_at: float, wait_at: float) -> bool:
        """Whether a residual at ``ρ`` ``busy_at`` and ``W`` ``wait_at`` counts for a split
        at ``busy`` and ``wait_s`` (the bands, module doc)."""
        lo, hi = sorted((max(0.0, wait_s), max(0.0, wait_at)))
        return abs(busy_at - busy) <= self.busy_band and \
            hi <= self.wait_ratio * lo + self.wait_floor_s


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
        # (ρ it counts at, residual s, when it finished, its split's W), the newest last
        self._loaded: deque[tuple[float, float, float, float]] = \
            deque(maxlen=self.config.window)
        self._computed: deque[tuple[float, float, float, float]] = \
            deque(maxlen=self.config.window)

    def observe(self, loaded: bool, residual_s: float, now: float, busy: float = 0.0,
                wait_s: float = 0.0) -> None:
        """One finished cold request: ``loaded`` whether its split read any chunk, its
        ``residual_s`` (engine time to first token less the prediction), ``busy`` the
        ``ρ`` it counts at (its split's or its finish's, the larger: the estimator's
        choice), ``wait_s`` its split's ``W``; non-finite residuals are dropped."""
        if not all(map(math.isfinite, (residual_s, busy, wait_s))):
            return
        (self._loaded if loaded else self._computed).append((busy, residual_s, now, wait_s))

    def excess(self, now: float, busy: float = 0.0, wait_s: float = 0.0) -> float:
        """``E`` in seconds at ``now`` for a split at congestion ``busy`` and wait
        ``wait_s``: 0 until both branches have ``min_samples`` within the bands of it."""
        cfg = self.config
        loaded = [s for s in self._loaded if cfg.near(busy, wait_s, s[0], s[3])]
        computed = [s[1] for s in self._computed if cfg.near(busy, wait_s, s[0], s[3])]
        if len(loaded) < cfg.min_samples or len(computed) < cfg.min_samples:
            return 0.0
        e = quantile([s[1] for s in loaded], cfg.quantile) - quantile(computed, cfg.quantile)
        age = max(0.0, now - max(s[2] for s in loaded))
        return max(0.0, e) * 0.5 ** (age / cfg.half_life_s)

    def snapshot(self, now: float) -> dict:
        """The residuals held, per branch, oldest first: ``[ρ, residual ms, age s, W ms]``
        each (``/admin/status``: what ``E`` stands on, for a run's record)."""
        def rows(held: deque) -> list[list[float]]:
            return [[round(b, 3), round(r * 1e3, 1), round(now - t, 1), round(w * 1e3, 1)]
                    for b, r, t, w in held]
        return {"loaded": rows(self._loaded), "computed": rows(self._computed)}

    def counts(self) -> tuple[int, int]:
        """Residuals held: (loaded, computed)."""
        return len(self._loaded), len(self._computed)
