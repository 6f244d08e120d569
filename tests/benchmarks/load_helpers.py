"""Inputs of the load benchmark's tests: its command line's values as a namespace
(:func:`load_args`) and a step's row of results (:func:`step_row`)."""

from __future__ import annotations

from types import SimpleNamespace


def load_args(**kw) -> SimpleNamespace:
    """``benchmarks.load``'s resolved arguments, the ones the planner and the summaries
    read, with ``kw`` changed."""
    base = dict(modes=["prompt", "kv"], rates=[2.0, 4.0, 8.0, 16.0], kv_rates="adaptive",
                kv_rate_multipliers=[1, 2, 3, 4, 5], requests=400, settle_s=1.0,
                warmup_requests=64, warmup_rate=64.0, estimate_hydrate_s=1.0,
                prompt_goodput=None, objective_ms=250.0)
    return SimpleNamespace(**{**base, **kw})


def step_row(mode, rate, met, p99, step=(10.0, 12.0)) -> dict:
    """A measured step's row: whether it met the objective, its p99 TTFT, the engine's
    busy-step p50/p99 (``step``; None: a server without the histogram)."""
    return {"mode": mode, "rate": rate, "meets_objective": met, "ttft_p99_ms": p99,
            "requests": 400, "over_objective": 0 if met else 9,
            "step_p50_ms": step[0] if step else None, "step_p99_ms": step[1] if step else None,
            "step_p99_over_p50": round(step[1] / step[0], 3) if step else None}
