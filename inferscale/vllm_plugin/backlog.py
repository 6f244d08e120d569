"""How congested the engine's prefill is, for the server's compute-or-load split.

Under chunked prefill vLLM admits a request at once (its queue time stays ~0) but gives
each step's token budget (``max_num_batched_tokens``) to the running requests first, so
a request's chunks wait whenever the running requests have more prompt tokens left than a
step computes. vLLM's ``queued_time`` does not see that wait: on an H100 at 20 requests/s
it stayed ~0 ms while the p99 TTFT passed 370 ms
(``benchmarks/results/load-h100-llama31-8b-u200.json``).

:class:`PrefillBacklog` follows, from each step's ``SchedulerOutput``, the prompt tokens
each scheduled request has left after the step (requests leave when vLLM finishes or
preempts them), and keeps ``busy``: the share of recent wall time (time constant
``tau_s``) spent in steps after which prompt tokens were left over, i.e. in which a
request arriving would have waited for the budget. For a single-server queue that share is
the utilization ρ (the probability that an arrival waits), which prices a computed token
in the split (:mod:`inferscale.serve.cold_split`). Under a large budget (8,192 tokens: a
~2,500-token prefill fits one step) steps rarely leave prompt tokens over while the GPU
is far from idle, so it also keeps ``token_rate``, the prompt tokens scheduled per second
of recent wall time (the same ``tau_s``): times the seconds a computed token costs, that
is the share of time spent prefilling, the utilization by the queue's own definition
(λ x service time), with the base of the steps that carry prompt tokens (``base_s``
each, ``step_rate`` of them a second) counted in: on an H100 at 25 requests/s over 2,000
users the steps' ~6 ms bases filled a quarter of the time on top of the prompt tokens'
half, the engine was saturated and ``token_rate x c`` alone still read ~0.5
(``benchmarks/results/load-h100-llama31-8b-run5-u2000.json``, its scrapes), so no cold
request loaded (:attr:`base_share`). The split takes the larger of the two.

What a prompt token costs is measured here too (``token_s``): a least-squares fit of the
wall time between the scheduler's calls against the prompt tokens of the last two steps
scheduled (exponentially forgetting with ``fit_tau_s``), once the steps spread enough
(``min_steps``, ``min_spread`` tokens of standard deviation), the two slopes summed.
Two, because under vLLM's asynchronous scheduling (on by default on CUDA) a step is
scheduled while the one before it runs, so the time between two calls is the earlier
step's; without it (the CPU) it is the later one's; the other slope fits ~0. A request's
own prefill time fitted against its tokens (what the split used alone before) reads about
half of it under load, since a request's prefill time is its step's, shared with the
others in it: on an H100 at 7-35 requests/s
the steps gave ~6.3 ms plus ~33 us a prompt token, the requests' fit ~18 us
(``benchmarks/results/load-h100-llama31-8b-run4-u200.json``, its scrapes), and the
utilization ``token_rate x c`` read 0.3 where prefill took two thirds of the time.
Engine-core thread only.
"""

from __future__ import annotations

import math
import time
from typing import Any


class PrefillBacklog:
    """Prompt tokens the scheduled requests have left, and the share of time with some."""

    def __init__(self, tau_s: float = 2.0, fit_tau_s: float = 30.0, min_steps: int = 32,
                 min_spread: float = 64.0):
        if not (tau_s > 0 and fit_tau_s > 0 and min_steps >= 2 and min_spread > 0):
            raise ValueError("need tau_s > 0, fit_tau_s > 0, min_steps >= 2, min_spread > 0")
        self.tau_s, self.fit_tau_s = tau_s, fit_tau_s
        self.min_steps, self.min_spread = min_steps, min_spread
        # decayed sums of 1, x1, x2, y, x1^2, x2^2, x1 x2, x1 y, x2 y: x1, x2 the prompt
        # tokens of the last two steps scheduled, y the seconds since the last call
        self._sums = [0.0] * 9
        self._count = 0  # steps fitted
        self._before: int | None = None  # prompt tokens of the step before the last
        self.token_s = 0.0  # seconds a prompt token adds to a busy step; 0: not known yet
        self.base_s = 0.0  # a busy step's seconds without prompt tokens (the intercept)
        self._prompt: dict[str, int] = {}  # request id -> prompt tokens
        self._left: dict[str, int] = {}  # request id -> prompt tokens left after its step
        self._behind = False  # the last step left prompt tokens over
        self._at: float | None = None  # when busy was last updated
        self._scheduled = 0  # prompt tokens the last step scheduled (computed since then)
        self.busy = 0.0
        self.token_rate = 0.0  # prompt tokens scheduled per second, recent
        self.step_rate = 0.0  # steps that scheduled prompt tokens, per second, recent

    @property
    def tokens(self) -> int:
        return sum(self._left.values())

    def step(self, scheduler_output: Any, previous_s: float | None,
             now: float | None = None) -> None:
        """One step's schedule at ``now``; ``previous_s``: the wall time of the step
        before it (None when that step was not busy), which counts as congested if that
        step left prompt tokens over; the rest of the time since the last call does not."""
        now = time.monotonic() if now is None else now
        if self._at is not None and now > self._at:
            dt = now - self._at
            congested = min(previous_s or 0.0, dt) if self._behind else 0.0
            decay = math.exp(-dt / self.tau_s)
            self.busy = self.busy * decay + (congested / dt) * (1 - decay)
            self.token_rate = self.token_rate * decay + (self._scheduled / dt) * (1 - decay)
            self.step_rate = self.step_rate * decay + (bool(self._scheduled) / dt) * (1 - decay)
            if previous_s is not None and self._before is not None:
                self._fit_step(self._scheduled, self._before, previous_s, dt)
        self._before = self._scheduled if previous_s is not None else None  # a busy chain
        self._at = now
        self._scheduled = 0
        counts = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        computed: dict[str, int] = {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            self._prompt[new.req_id] = len(new.prompt_token_ids or ())
            computed[new.req_id] = new.num_computed_tokens
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, n in counts.items():
            prompt = self._prompt.get(req_id)
            if prompt is not None and req_id in computed:
                self._scheduled += max(0, min(n, prompt - computed[req_id]))
                left = prompt - computed[req_id] - n
                if left > 0:
                    self._left[req_id] = left
                else:
                    self._left.pop(req_id, None)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._left.pop(req_id, None)  # back to waiting: vLLM's queue time counts it
        for req_id in getattr(scheduler_output, "finished_req_ids", None) or ():
            self.finished(req_id)
        self._behind = bool(self._left)

    @property
    def base_share(self) -> float:
        """The share of recent time spent in the bases of steps that scheduled prompt
        tokens (``step_rate x base_s``; 0 until the fit knows ``base_s``): added to
        ``token_rate x c``, the share of time prefill takes."""
        return self.step_rate * self.base_s

    def _fit_step(self, last: int, before: int, seconds: float, dt: float) -> None:
        """``seconds`` between the last two calls, ``dt`` after the one before, with
        ``last`` and ``before`` prompt tokens in the last two steps scheduled: the sums
        forget with ``fit_tau_s``; ``token_s`` (the slopes summed) and ``base_s`` follow
        once the steps are many and spread enough, and not in lockstep, to tell them."""
        keep = math.exp(-dt / self.fit_tau_s)
        a, b, y = float(last), float(before), float(seconds)
        self._sums = [v * keep + add for v, add in zip(
            self._sums, (1.0, a, b, y, a * a, b * b, a * b, a * y, b * y))]
        self._count += 1
        _, sa, sb, sy, saa, sbb, sab, say, sby = (v / self._sums[0] for v in self._sums)
        vaa, vbb, vab = saa - sa * sa, sbb - sb * sb, sab - sa * sb
        cay, cby = say - sa * sy, sby - sb * sy
        det = vaa * vbb - vab * vab
        spread = self.min_spread ** 2
        if self._count >= self.min_steps and vaa >= spread and vbb >= spread \
                and det >= 0.25 * vaa * vbb:
            ka, kb = (cay * vbb - cby * vab) / det, (cby * vaa - cay * vab) / det
            self.token_s = max(0.0, ka + kb)
            self.base_s = max(0.0, sy - ka * sa - kb * sb)

    def finished(self, req_id: str) -> None:
        self._prompt.pop(req_id, None)
        self._left.pop(req_id, None)
