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
each, ``step_rate`` of them a second) and their requests' own cost (``request_s`` each,
``request_rate`` a second) counted in: on an H100 at 25 requests/s over 2,000
users the steps' ~6 ms bases filled a quarter of the time on top of the prompt tokens'
half, the engine was saturated and ``token_rate x c`` alone still read ~0.5
(``benchmarks/results/load-h100-llama31-8b-run5-u2000.json``, its scrapes), so no cold
request loaded (:meth:`~PrefillBacklog.base_share`). The split takes the larger of the two.

What a prompt token costs is measured here too (``token_s``): a least-squares fit of the
wall time between the scheduler's calls against the prompt tokens of the last two steps
scheduled and the requests whose prompt tokens they scheduled (exponentially forgetting
with ``fit_tau_s``), once the steps spread enough (``min_steps``, ``min_spread`` tokens of
standard deviation) and the tokens vary apart from the requests, the two token slopes
summed (``token_s``) and the two request slopes (``request_s``: what a request's prefill
costs besides its tokens: its memory copied in, written and attended to). Without the
requests, a resident's few tokens (a ~50-token query beside ~2,500 injected ones) carry
its request's cost: on an H100 the 24 users' warm-up (residents only) fitted 165-170 us a
token, five times a token's cost, as ~7 ms a request over its ~50 tokens would
(``benchmarks/results/load-h100-llama31-8b-run8-u200.json``; the steps themselves were
not logged); with the requests, residents alone (tokens in near lockstep with them)
solve nothing, and cold requests' long prompts tell the two apart.
Two, because under vLLM's asynchronous scheduling (on by default on CUDA) a step is
scheduled while the one before it runs, so the time between two calls is the earlier
step's; without it (the CPU) it is the later one's; the other slope fits ~0. A request's
own prefill time fitted against its tokens (what the split used alone before) reads about
half of it under load, since a request's prefill time is its step's, shared with the
others in it: on an H100 at 7-35 requests/s
the steps gave ~6.3 ms plus ~33 us a prompt token, the requests' fit ~18 us
(``benchmarks/results/load-h100-llama31-8b-run4-u200.json``, its scrapes), and the
utilization ``token_rate x c`` read 0.3 where prefill took two thirds of the time.
The fit holds only ``fit_tau_s`` after its last solution (:meth:`PrefillBacklog.fitted`),
then reads 0 (not known) until the steps spread again: in that run the warm-up's price
was kept through five minutes of resident traffic (which never solved the fit again) into
200 users' cold requests, every one of which then loaded (computing looked five times
dearer than it was) and so kept the steps too narrow to correct it: their p99 TTFT was
357 ms at 5 requests/s.
Engine-core thread only.
"""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import numpy as np

RIDGE = 1e-3  # requests^2 added to the requests' variances in the fit (see _fit_step)
SOLVE_EVERY = 4  # steps between solutions of the fit (~50 us each on a slow CPU)


class StepFit(NamedTuple):
    """What a busy step costs, by the fit (module doc); all 0 while not known."""

    token_s: float  # seconds a prompt token adds to a busy step
    base_s: float  # a busy step's seconds without prompt tokens
    request_s: float  # seconds a request's prefill adds besides its tokens


UNKNOWN = StepFit(0.0, 0.0, 0.0)


class PrefillBacklog:
    """Prompt tokens the scheduled requests have left, and the share of time with some."""

    def __init__(self, tau_s: float = 2.0, fit_tau_s: float = 30.0, min_steps: int = 32,
                 min_spread: float = 64.0):
        if not (tau_s > 0 and fit_tau_s > 0 and min_steps >= 2 and min_spread > 0):
            raise ValueError("need tau_s > 0, fit_tau_s > 0, min_steps >= 2, min_spread > 0")
        self.tau_s, self.fit_tau_s = tau_s, fit_tau_s
        self.min_steps, self.min_spread = min_steps, min_spread
        # decayed sums of z z^T and z y, z = (1, x1, x2, r1, r2): the prompt tokens and the
        # requests with prompt tokens of the last two steps scheduled; y the seconds since
        # the last call
        self._zz = np.zeros((5, 5))
        self._zy = np.zeros(5)
        self._count = 0  # steps fitted
        self._before: tuple[int, int] | None = None  # (tokens, requests) of the one before
        self.token_s = 0.0  # seconds a prompt token adds to a busy step; 0: not known yet
        self.request_s = 0.0  # seconds a request's prefill adds besides its tokens
        self.base_s = 0.0  # a busy step's seconds without prompt tokens (the intercept)
        self._solved_at: float | None = None  # when the fit last had a solution
        self._prompt: dict[str, int] = {}  # request id -> prompt tokens
        self._left: dict[str, int] = {}  # request id -> prompt tokens left after its step
        self._behind = False  # the last step left prompt tokens over
        self._at: float | None = None  # when busy was last updated
        self._scheduled = 0  # prompt tokens the last step scheduled (computed since then)
        self._requests = 0  # requests whose prompt tokens the last step scheduled
        self.busy = 0.0
        self.token_rate = 0.0  # prompt tokens scheduled per second, recent
        self.step_rate = 0.0  # steps that scheduled prompt tokens, per second, recent
        self.request_rate = 0.0  # requests with prompt tokens scheduled, per second, recent

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
            self.request_rate = self.request_rate * decay + (self._requests / dt) * (1 - decay)
            if previous_s is not None and self._before is not None:
                self._fit_step((self._scheduled, self._requests), self._before, previous_s,
                               dt, now)
        last = (self._scheduled, self._requests)
        self._before = last if previous_s is not None else None  # a busy chain
        self._at = now
        self._scheduled = self._requests = 0
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
                tokens = max(0, min(n, prompt - computed[req_id]))
                self._scheduled += tokens
                self._requests += tokens > 0
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

    def base_share(self, now: float | None = None) -> float:
        """The share of recent time spent in the bases of steps that scheduled prompt
        tokens and in their requests' own costs (``step_rate x base_s + request_rate x
        request_s``; 0 while the fit is not known): added to ``token_rate x c``, the
        share of time prefill takes."""
        fit = self.fitted(now)
        return self.step_rate * fit.base_s + self.request_rate * fit.request_s

    def fitted(self, now: float | None = None) -> StepFit:
        """The fit while it solved within the last ``fit_tau_s``, else :data:`UNKNOWN`
        (module doc)."""
        now = time.monotonic() if now is None else now
        if self._solved_at is None or now - self._solved_at > self.fit_tau_s:
            return UNKNOWN
        return StepFit(self.token_s, self.base_s, self.request_s)

    def _fit_step(self, last: tuple[int, int], before: tuple[int, int], seconds: float,
                  dt: float, now: float) -> None:
        """``seconds`` between the last two calls, ``dt`` after the one before, with
        ``last`` and ``before`` the (prompt tokens, requests with prompt tokens) of the
        last two steps scheduled: the sums forget with ``fit_tau_s``; ``token_s``,
        ``request_s`` and ``base_s`` follow once the steps are many and their tokens
        spread enough, and vary apart from each other and from the requests, to tell."""
        keep = math.exp(-dt / self.fit_tau_s)
        z = np.array([1.0, last[0], before[0], last[1], before[1]])
        self._zz = self._zz * keep + np.outer(z, z)
        self._zy = self._zy * keep + z * float(seconds)
        self._count += 1
        if self._count % SOLVE_EVERY:
            return
        n = self._zz[0, 0]
        mean, my = self._zz[0, 1:] / n, self._zy[0] / n
        cov = self._zz[1:, 1:] / n - np.outer(mean, mean)  # x1, x2, r1, r2
        cy = self._zy[1:] / n - mean * my
        spread = self.min_spread ** 2
        if self._count < self.min_steps or cov[0, 0] < spread or cov[1, 1] < spread:
            return
        # a small ridge on the requests: steps in lockstep (requests every other step, so
        # r1 + r2 constant) or requests that never vary leave their slopes ~0, not wild
        c = cov + np.diag([0.0, 0.0, RIDGE, RIDGE])
        try:
            inverse = np.linalg.inv(c)
        except np.linalg.LinAlgError:  # the token counts in lockstep: nothing to tell
            return
        # each token count must vary apart from the others: its variance left once they
        # are known at least a quarter of its own (for two counts: det >= vaa vbb / 4)
        if not all(inverse[i, i] > 0 and 1.0 / inverse[i, i] >= 0.25 * c[i, i]
                   for i in (0, 1)):
            return
        k = inverse @ cy
        if not np.all(np.isfinite(k)):
            return
        self.token_s = max(0.0, float(k[0] + k[1]))
        self.request_s = max(0.0, float(k[2:].sum()))
        self.base_s = max(0.0, float(my - k @ mean))
        self._solved_at = now

    def finished(self, req_id: str) -> None:
        self._prompt.pop(req_id, None)
        self._left.pop(req_id, None)
