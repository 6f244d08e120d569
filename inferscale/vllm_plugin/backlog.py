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
(λ x service time). The split takes the larger of the two.

What a prompt token costs is measured here too (``token_s``): the slope of a least-squares
fit of each busy step's wall time against the prompt tokens it scheduled (exponentially
forgetting with ``fit_tau_s``), once the steps spread enough (``min_steps``, ``min_spread``
tokens of standard deviation). A request's own prefill time fitted against its tokens
(what the split used alone before) reads about half of it under load, since a request's
prefill time is its step's, shared with the others in it: on an H100 at 7-35 requests/s
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
        self._sums = [0.0] * 5  # decayed weight, x, y, x^2, xy of (prompt tokens, step s)
        self._count = 0  # steps fitted
        self.token_s = 0.0  # seconds a prompt token adds to a busy step; 0: not known yet
        self.base_s = 0.0  # a busy step's seconds without prompt tokens (the intercept)
        self._prompt: dict[str, int] = {}  # request id -> prompt tokens
        self._left: dict[str, int] = {}  # request id -> prompt tokens left after its step
        self._behind = False  # the last step left prompt tokens over
        self._at: float | None = None  # when busy was last updated
        self._scheduled = 0  # prompt tokens the last step scheduled (computed since then)
        self.busy = 0.0
        self.token_rate = 0.0  # prompt tokens scheduled per second, recent

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
            if previous_s is not None:
                self._fit_step(self._scheduled, previous_s, dt)
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

    def _fit_step(self, tokens: int, seconds: float, dt: float) -> None:
        """One busy step of ``tokens`` prompt tokens that took ``seconds``, ``dt`` after
        the last: the fit's sums forget with ``fit_tau_s``; ``token_s`` and ``base_s``
        follow once the steps are many and spread enough to tell the slope."""
        keep = math.exp(-dt / self.fit_tau_s)
        x, y = float(tokens), float(seconds)
        self._sums = [v * keep + add for v, add in zip(self._sums, (1.0, x, y, x * x, x * y))]
        self._count += 1
        w, sx, sy, sxx, sxy = self._sums
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if self._count >= self.min_steps and var >= self.min_spread ** 2:
            self.token_s = max(0.0, (sxy / w - mx * my) / var)
            self.base_s = max(0.0, my - self.token_s * mx)

    def finished(self, req_id: str) -> None:
        self._prompt.pop(req_id, None)
        self._left.pop(req_id, None)
