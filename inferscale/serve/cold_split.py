"""Compute or load, or both: how a request of a user in neither tier splits its facts.

Reading a fact's KV is not always cheaper than computing it (a token of an 8B model's
bf16 KV is 128 KiB: ~85 us from a 1.5 GB/s disk, ~25 us of H200 prefill), so a request
whose user is in no tier reads some of its facts from storage and prefills the others as
text, split so that both finish together (Jin et al. 2024, "Compute Or Load KV Cache? Why
Not Both?"). vLLM's connector API lets externally loaded tokens be only a *prefix* of
what a request computes, so the split is sequential: the first ``n`` memory chunks (the
instruction prefix, then the facts in the served order) are read and injected, and every
later chunk is prefilled as part of the prompt (its token ids are the prompt's either
way: exact KV). The read overlaps the request's wait in the engine's queue, not its own
compute.

**The rule** (:func:`split`). With ``W`` the expected wait in vLLM's queue before the
engine starts computing the request, ``c`` the engine's seconds per computed prompt token,
``ρ`` how congested prefill is (below), ``B`` the storage bandwidth (bytes/s, aggregate
while busy), ``Q`` the bytes of reads already queued ahead, ``b`` the bytes per memory
token, ``o`` a read's time besides its rows (the version's chunk index, staging memory,
checking and placing the rows) and ``D`` the fixed cost of an asynchronous load (the
request is scheduled a step after its read is handed over), the request loads the
largest ``n`` (whole leading chunks, ``T(n)`` tokens) with::

    max(o + (Q + T(n) b) / B, W) + D + E <= W + c T(n) / (1 - ρ)

A computed token costs its own time ``c`` and, when prefill is congested, the time it
makes the requests behind it wait: in a single-server queue at utilization ``ρ``, work
``x`` added delays the later arrivals by ``x ρ / (1 - ρ)`` in all, so a token's whole
cost is ``c / (1 - ρ)`` (``ρ`` capped at ``busy_cap``). An idle engine (``ρ = 0``) keeps
the rule per request: the first token comes no later than if everything were prefilled
(``W + c T``). A congested one gives prefill time to the others with every token loaded,
at the request's own latency: under chunked prefill a request waiting for its read does
not keep its place behind the running prefills (vLLM admits it after the read), so its
read never hides in that wait, and on an H100 a bf16 token read at the 2.3 GB/s measured
(~56 us) costs three times its computing (~19 us): without the congestion term nothing
was ever loaded and the GPU saturated at about the peer's goodput over the share of
requests in storage (``benchmarks/results/load-h100-llama31-8b-u200.json``). The feasible ``T``
form an interval, so: storage faster per token than the priced compute loads everything
once that pays for ``o + D``; a congested engine loads more; slow or busy storage (small
``B``, large ``Q``) loads less; ``n = 0`` prefills everything (no fallback). The read
may take ``deadline_factor * (W + c T / (1 - ρ))`` from its start before it is given up
and the tokens recomputed. ``E``: what loads cost lately beyond this formula, against
computing, near today's ``ρ`` and ``W`` (:mod:`inferscale.serve.load_excess`; 0 unmeasured).

**The estimates** (:class:`LoadEstimator`), all measured while serving, from priors
before any data: ``W`` a moving average of vLLM's own ``queued_time`` of finished
requests that did not wait for a read (theirs includes the read), decaying to the prior
while nothing finishes, 0 while vLLM's latest scheduler stats (at most ``queue_fresh_s``
old) say no request waits (on an H100 reads chosen to hide in a past burst's wait were
the slowest answers of the step after a warm-up burst), and at least the prefill the
server handed the engine that is still ahead
(:class:`~inferscale.serve.prefill_queue.PrefillQueue`): a request arriving during
another's long prefill step waits out the rest of it, a wait vLLM's counts never show;
``c`` what a prompt token adds to a busy engine step (the scheduler's fit of step times,
:class:`~inferscale.vllm_plugin.backlog.PrefillBacklog`, the largest over ranks), and
while no rank's fit is solved (recently) the slope of a windowed least-squares fit of
vLLM's ``prefill_time`` against the tokens each request computed, pulled towards the
prior by ``prior_sxx`` (the intercept, the fixed part, reported apart): a request's
prefill time is its step's, shared with the others, so it read ~18 us a token on an
H100 where the steps said ~33 (``benchmarks/results/load-h100-llama31-8b-run4-u200.json``);
``ρ`` the larger of the share of recent time in which a step left prompt tokens over (a
request arriving would wait for the token budget) and prefill's share of time: prompt
tokens scheduled per second times ``c``, plus the bases of the steps that scheduled them
and their requests' own costs (the busiest rank's
:class:`~inferscale.vllm_plugin.backlog.PrefillBacklog`, decaying with ``busy_tau_s``;
on an H100 under an 8,192-token budget the first read ~0 while prefill took ~0.4 of the
time, and without the bases the second ~0.5 on a saturated engine); ``B`` and ``o``
moving averages of the workers' bytes read per second of reader busy time and seconds
per read outside the rows (a user's first read includes its chunk index), the slowest
rank's; ``Q`` the workers' bytes not read yet, drained at ``B`` since they reported, at
least the reads the server itself asked for whose requests have not come back (a burst's
prefetches are sent faster than the workers report: the warm-up's split saw none queued);
``D`` = ``overhead_steps`` busy engine steps (the workers' moving average). Nothing here
touches the engine: the server (:mod:`inferscale.serve.server`) feeds it and applies it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from inferscale.serve.load_excess import Branch, ExcessConfig, LoadExcess

MODES = ("off", "auto", "pinned")


@dataclass(frozen=True)
class ColdSplitConfig:
    """``mode``: ``auto`` (the rule), ``pinned`` (always ``pinned_chunks`` leading chunks;
    for tests and benchmarks) or ``off`` (every chunk read from storage when the engine
    schedules the request, no prefetch: the behaviour before the split). Priors before
    any measurement: storage ``bandwidth_prior`` bytes/s, ``compute_prior_s`` per computed
    token, ``wait_prior_s``, ``step_prior_s`` per busy engine step."""

    mode: str = "auto"
    pinned_chunks: int = 0
    bandwidth_prior: float = 1e9
    compute_prior_s: float = 25e-6
    wait_prior_s: float = 0.0
    step_prior_s: float = 0.02
    overhead_steps: float = 1.5  # D in engine steps (handed over, then scheduled)
    deadline_factor: float = 2.0  # a read may take this times (W + c T / (1 - ρ))
    busy_cap: float = 0.9  # ρ at most this: a computed token costs at most 10 c
    busy_tau_s: float = 2.0  # ρ's time constant, as the scheduler's (backlog.py)
    window: int = 64  # finished requests in the fit of c
    window_s: float = 60.0  # ... none older than this
    prior_sxx: float = 4e6  # the compute prior's weight in that fit, in tokens^2
    wait_half_life_s: float = 5.0  # W decays to its prior while no request finishes
    alpha: float = 0.2  # weight of a new sample in the moving averages of W and B
    poll_s: float = 0.5  # the workers' storage statistics are read at most this often
    queue_fresh_s: float = 1.0  # vLLM's waiting count older than this is not used
    excess: ExcessConfig = field(default_factory=ExcessConfig)  # E (load_excess.py)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"cold split mode must be one of {MODES}, got {self.mode!r}")
        for name in ("bandwidth_prior", "compute_prior_s", "prior_sxx", "wait_half_life_s",
                     "poll_s", "window_s", "busy_tau_s", "queue_fresh_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("pinned_chunks", "wait_prior_s", "step_prior_s", "overhead_steps"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")
        if self.deadline_factor < 1 or self.window < 2 or not 0 < self.alpha <= 1 \
                or not 0 <= self.busy_cap < 1:
            raise ValueError("need deadline_factor >= 1, window >= 2, 0 < alpha <= 1 and "
                             f"0 <= busy_cap < 1, got busy_cap={self.busy_cap}")

    @classmethod
    def from_settings(cls, s: Any) -> "ColdSplitConfig":
        return cls(mode=s.cold_split, pinned_chunks=s.cold_split_chunks,
                   bandwidth_prior=s.cold_bandwidth_prior, compute_prior_s=s.cold_compute_prior_s,
                   step_prior_s=s.cold_step_prior_s, overhead_steps=s.cold_overhead_steps,
                   deadline_factor=s.cold_deadline_factor)


@dataclass(frozen=True)
class Estimates:
    """What the rule reads: ``W``, ``c``, ``B``, ``Q``, ``D``, ``ρ`` and ``o`` (module
    doc); reported only: the fixed part of a request's prefill time, the requests' own
    fit of ``c``, and the step fit's base and a request's own cost beside ``c``."""

    wait_s: float
    compute_s_per_token: float
    bandwidth: float  # bytes/s
    queued_bytes: float
    overhead_s: float
    fixed_s: float = 0.0
    prefill_busy: float = 0.0  # ρ, already capped
    read_overhead_s: float = 0.0  # o: a read's time besides its rows
    request_fit_s_per_token: float | None = None  # the requests' fit of c (reported only)
    step_s: float = 0.0  # a busy engine step (a request's prefill costs one besides c T)
    prefill_ahead_s: float = 0.0  # the server's own prefill queue ahead (in wait_s)
    load_excess_s: float = 0.0  # E: what loads cost lately beyond the formula
    step_base_s: float = 0.0
    request_cost_s: float = 0.0

    @property
    def priced_s_per_token(self) -> float:
        """A computed token's whole cost: ``c / (1 - ρ)``."""
        return self.compute_s_per_token / (1.0 - self.prefill_busy)

    def info(self) -> dict:
        return {"wait_ms": self.wait_s * 1e3, "compute_us_per_token":
                self.compute_s_per_token * 1e6, "bandwidth_bytes_per_s": self.bandwidth,
                "queued_bytes": self.queued_bytes, "overhead_ms": self.overhead_s * 1e3,
                "fixed_ms": self.fixed_s * 1e3, "prefill_busy": self.prefill_busy,
                "read_overhead_ms": self.read_overhead_s * 1e3,
                "step_ms": self.step_s * 1e3, "prefill_ahead_ms": self.prefill_ahead_s * 1e3,
                "load_excess_ms": self.load_excess_s * 1e3, "step_base_ms":
                self.step_base_s * 1e3, "request_cost_ms": self.request_cost_s * 1e3,
                "request_fit_us_per_token": None if self.request_fit_s_per_token is None
                else self.request_fit_s_per_token * 1e6}


@dataclass(frozen=True)
class Split:
    """A request's split: its first ``chunks`` chunks (``tokens``, ``bytes``) read from
    storage, predicted to take ``read_s`` (the reads queued ahead included); the memory
    tokens left to prefill predicted to take ``compute_s``; the read's ``deadline_s``
    (None: the connector's default)."""

    chunks: int
    tokens: int
    bytes: int
    read_s: float
    compute_s: float
    deadline_s: float | None
    estimates: Estimates

    def info(self) -> dict:
        return {"chunks": self.chunks, "tokens": self.tokens, "bytes": self.bytes,
                "read_ms": self.read_s * 1e3, "compute_ms": self.compute_s * 1e3,
                "deadline_ms": None if self.deadline_s is None else self.deadline_s * 1e3,
                **self.estimates.info()}


def split(lengths: Sequence[int], row_bytes: int, est: Estimates,
          deadline_factor: float = 2.0, pinned: int | None = None) -> Split:
    """The split of memory chunks of ``lengths`` tokens (served order) at ``row_bytes``
    per token: the largest feasible leading run by the rule (module doc), or the first
    ``pinned`` chunks."""
    if row_bytes <= 0:
        raise ValueError(f"row_bytes must be > 0, got {row_bytes}")
    w, c, d = est.wait_s, est.priced_s_per_token, est.overhead_s + est.load_excess_s

    def read_s(tokens: int) -> float:
        return est.read_overhead_s + (est.queued_bytes + tokens * row_bytes) / est.bandwidth \
            if est.bandwidth > 0 else math.inf

    if pinned is not None:
        n = min(pinned, len(lengths))
    else:
        n, total = 0, 0
        for k, length in enumerate(lengths, 1):
            total += length
            # max(R, W) + D + E <= W + c T / (1 - ρ), written so rounding keeps it monotonic
            if max(read_s(total) - w, 0.0) + d <= c * total:
                n = k
    tokens = sum(lengths[:n])
    memory = sum(lengths)
    deadline = None if pinned is not None or not tokens else deadline_factor * (w + c * tokens)
    return Split(n, tokens, tokens * row_bytes, read_s(tokens) if tokens else 0.0,
                 est.compute_s_per_token * (memory - tokens), deadline, est)


class LoadEstimator:
    """``W``, ``c``, ``ρ``, ``B``, ``Q``, ``o`` and ``D`` from what the engine reports
    (module doc): each answered request (:meth:`finished`) and the workers' storage
    statistics (:meth:`storage`). Not thread-safe: the server calls it from its event
    loop."""

    def __init__(self, config: ColdSplitConfig | None = None):
        self.config = config or ColdSplitConfig()
        self._samples: deque[tuple[float, int, float]] = deque(maxlen=self.config.window)
        self._wait: float | None = None
        self._wait_at = 0.0
        self._waiting: tuple[int, float] | None = None  # vLLM's waiting requests, when
        self.excess = LoadExcess(self.config.excess)
        self._last: dict[int, tuple[float, float]] = {}  # rank -> bytes, busy seconds
        self._bandwidth: dict[int, float] = {}
        self._queued: dict[int, float] = {}
        self._step: dict[int, float] = {}
        self._busy: dict[int, tuple[float, float, float]] = {}  # rank -> share, tokens/s, when
        self._step_fit: dict[int, tuple[float, float, float]] = {}  # rank -> backlog.py's
        self._timed: dict[int, tuple[int, float]] = {}  # rank -> reads timed, overhead s
        self._read_overhead: dict[int, float] = {}  # rank -> moving average per read
        self.storage_at: float | None = None  # when the workers last reported

    # ------------------------------------------------------------------ requests

    def finished(self, queued_s: float, prefill_s: float, computed_tokens: int, read: bool,
                 branch: Branch | None = None, now: float | None = None) -> None:
        """One answered request by vLLM's own timestamps (its answer's
        :attr:`~inferscale.serve.engine.Generation.stages_s`): :meth:`observe`, and for a
        cold request its split's ``branch`` (:func:`~inferscale.serve.cold_requests.branch`)
        gives a residual for ``E``."""
        now = time.monotonic() if now is None else now
        self.observe(queued_s, prefill_s, computed_tokens, read, now)
        if branch is not None and queued_s >= 0 and prefill_s >= 0:
            c = self._compute_s(now)  # the residual's ρ: at its split or now, the larger
            self.excess.observe(branch[0], queued_s + prefill_s - branch[1] -
                                c * computed_tokens, now,
                                max(branch[2], self._busy_now(now, c)), branch[3])

    def observe(self, queued_s: float, prefill_s: float, computed_tokens: int, read: bool,
                now: float | None = None) -> None:
        """One finished request: its queue time counts for ``W`` unless it waited for a
        read; its prefill time and computed tokens are a sample of the fit of ``c``."""
        now = time.monotonic() if now is None else now
        if computed_tokens > 0 and prefill_s >= 0:
            self._samples.append((now, computed_tokens, prefill_s))
        if not read and queued_s >= 0:
            a = self.config.alpha
            self._wait = (1 - a) * self._wait_now(now) + a * queued_s
            self._wait_at = now

    def queue(self, waiting: int | None, at: float) -> None:
        """vLLM's count of waiting requests at ``at`` (monotonic; its scheduler stats)."""
        if waiting is not None:
            self._waiting = (waiting, at)

    def _wait_now(self, now: float) -> float:
        if self._waiting is not None and self._waiting[0] == 0 and \
                now - self._waiting[1] <= self.config.queue_fresh_s:
            return 0.0  # nothing waits now: a read has no wait to hide in
        prior = self.config.wait_prior_s
        if self._wait is None:
            return prior
        decay = 0.5 ** (max(0.0, now - self._wait_at) / self.config.wait_half_life_s)
        return prior + (self._wait - prior) * decay

    def _fit(self, now: float) -> tuple[float, float]:
        """(c, fixed seconds): prefill seconds against computed tokens, least squares
        over the window, the slope pulled towards the prior by ``prior_sxx``."""
        cfg = self.config
        pts = [(x, y) for t, x, y in self._samples if now - t <= cfg.window_s]
        if not pts:
            return cfg.compute_prior_s, 0.0
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        sxy = sum((x - mx) * (y - my) for x, y in pts)
        c = max(0.0, (sxy + cfg.prior_sxx * cfg.compute_prior_s) / (sxx + cfg.prior_sxx))
        return c, max(0.0, my - c * mx)

    # ------------------------------------------------------------------ storage

    def storage(self, reports: list[dict], now: float | None = None) -> None:
        """The workers' :meth:`~inferscale.vllm_plugin.worker.ConnectorWorker.
        storage_stats`, one per rank: cumulative ``bytes``, ``busy_s``, ``reads_timed`` and
        ``overhead_s``, ``queued_bytes``, ``step_s``, ``prefill_busy``, ``prefill_tokens_per_s``,
        ``prefill_base_share`` and their age ``prefill_busy_age_s``; the step fit:
        ``prefill_token_s`` (0: not known now), ``prefill_step_base_s``, ``prefill_request_s``."""
        now = time.monotonic() if now is None else now
        a = self.config.alpha
        for i, r in enumerate(reports):
            rank = int(r.get("tp_rank", i))
            nbytes, busy = float(r["bytes"]), float(r["busy_s"])
            last = self._last.get(rank)
            self._last[rank] = (nbytes, busy)
            if last is not None and nbytes > last[0] and busy - last[1] >= 1e-3:
                sample = (nbytes - last[0]) / (busy - last[1])
                old = self._bandwidth.get(rank)
                self._bandwidth[rank] = sample if old is None else (1 - a) * old + a * sample
            self._queued[rank] = float(r["queued_bytes"])
            if r.get("reads_timed") is not None:
                timed, spent = int(r["reads_timed"]), float(r.get("overhead_s") or 0.0)
                before = self._timed.get(rank)
                self._timed[rank] = (timed, spent)
                if before is not None and timed > before[0]:
                    sample = max(0.0, spent - before[1]) / (timed - before[0])
                    old = self._read_overhead.get(rank)
                    self._read_overhead[rank] = sample if old is None else \
                        (1 - a) * old + a * sample
            fit = [float(r.get(k) or 0.0) for k in ("prefill_token_s", "prefill_step_base_s",
                                                     "prefill_request_s")]  # 0: not known
            if 0.0 < fit[0] < math.inf:
                self._step_fit[rank] = tuple(v if 0.0 < v < math.inf else 0.0 for v in fit)
            elif "prefill_token_s" in r:
                self._step_fit.pop(rank, None)
            if r.get("step_s") is not None:
                self._step[rank] = float(r["step_s"])
            if r.get("prefill_busy") is not None:
                age = max(0.0, float(r.get("prefill_busy_age_s") or 0.0))
                rate = float(r.get("prefill_tokens_per_s") or 0.0)
                base = float(r.get("prefill_base_share") or 0.0)
                self._busy[rank] = (min(1.0, max(0.0, float(r["prefill_busy"]))),
                                    rate if 0.0 < rate < math.inf else 0.0,
                                    min(1.0, base) if 0.0 < base < math.inf else 0.0,
                                    now - age)
        self.storage_at = now

    # ------------------------------------------------------------------ now

    def estimates(self, now: float | None = None, ahead_s: float = 0.0,
                  reads_ahead_s: float = 0.0) -> Estimates:
        """The estimates of now; ``ahead_s``: the prefill the server handed the engine
        still ahead (:class:`~inferscale.serve.prefill_queue.PrefillQueue`), a floor of
        ``W`` (vLLM reports nothing waiting during a long step); ``reads_ahead_s``: the
        reads the server asked for still ahead, in seconds at ``B`` (a floor of ``Q``)."""
        now = time.monotonic() if now is None else now
        cfg = self.config
        bandwidth = min(self._bandwidth.values(), default=cfg.bandwidth_prior)
        queued = max(self._queued.values(), default=0.0)
        if self.storage_at is not None:  # drained at the bandwidth since reported
            queued = max(0.0, queued - bandwidth * (now - self.storage_at))
        if 0.0 < reads_ahead_s < math.inf:
            queued = max(queued, reads_ahead_s * bandwidth)
        step = max(self._step.values(), default=cfg.step_prior_s)
        fit, fixed = self._fit(now)
        c = self._compute_s(now, fit)
        busy = self._busy_now(now, c)
        ahead_s = ahead_s if 0.0 < ahead_s < math.inf else 0.0
        _, base, request = max(self._step_fit.values(), default=(0.0, 0.0, 0.0))  # c's rank
        wait = max(self._wait_now(now), ahead_s)
        return Estimates(wait, c, bandwidth, queued, cfg.overhead_steps * step, fixed, busy,
                         max(self._read_overhead.values(), default=0.0), fit, step, ahead_s,
                         self.excess.excess(now, busy, wait), base, request)

    def _busy_now(self, now: float, c: float) -> float:
        """``ρ`` at ``now`` with ``c`` a token, capped."""
        tau = self.config.busy_tau_s
        return min(self.config.busy_cap, max(
            (max(b, rate * c + base) * math.exp(-max(0.0, now - at) / tau)
             for b, rate, base, at in self._busy.values()), default=0.0))

    def _compute_s(self, now: float, fit: float | None = None) -> float:
        """``c``: the steps' fit once it has one, else the requests' (:meth:`_fit`)."""
        return max(self._step_fit.values(), default=(0.0,))[0] or \
            (self._fit(now)[0] if fit is None else fit)
