"""The load benchmark's statistics (``benchmarks/load.py``): per step (one mode at one
arrival rate) the latency percentiles, throughput and fallbacks of its requests, and per
mode the goodput: the highest rate whose p99 TTFT met the objective, before the first
rate that missed it (a request that failed or did not finish counts as missing it)."""

from __future__ import annotations

import math
import os

MODES = ("prompt", "kv")
GIB = 1 << 30


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile; ``inf`` entries (failed requests) count as the
    largest values."""
    if not values:
        return math.nan
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    if math.isinf(xs[hi]) and rank > lo or math.isinf(xs[lo]):
        return math.inf
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def finite(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 2)


def step_summary(records: list[dict], mode: str, rate: float, objective_ms: float) -> dict:
    ok = [r for r in records if "error" not in r]
    inf = math.inf
    ttft = [r.get("ttft_ms", inf) if "error" not in r else inf for r in records]
    e2e = [r.get("e2e_ms", inf) if "error" not in r else inf for r in records]
    q2ft = [r["q2ft_ms"] for r in ok]
    engine = [r["engine_ttft_ms"] for r in ok]
    span = (max(r["end"] for r in ok) - min(r["sent"] for r in records)) if ok else math.nan
    tokens = sum(r["tokens"] for r in ok)
    reasons: dict[str, int] = {}
    for r in ok:
        if r.get("fallback_reason"):
            reasons[r["fallback_reason"]] = reasons.get(r["fallback_reason"], 0) + 1
    p99 = percentile(ttft, 99)
    return {
        "mode": mode, "rate": rate, "requests": len(records), "completed": len(ok),
        "errors": sorted({r["error"] for r in records if "error" in r})[:5],
        "ttft_p50_ms": finite(percentile(ttft, 50)), "ttft_p99_ms": finite(p99),
        "q2ft_p50_ms": finite(percentile(q2ft, 50)), "q2ft_p99_ms": finite(percentile(q2ft, 99)),
        "engine_ttft_p50_ms": finite(percentile(engine, 50)),
        "engine_ttft_p99_ms": finite(percentile(engine, 99)),
        "e2e_p50_ms": finite(percentile(e2e, 50)), "e2e_p99_ms": finite(percentile(e2e, 99)),
        "output_tokens_per_s": finite(tokens / span) if span and span > 0 else None,
        "achieved_rate": finite(len(records) / max(1e-9, max(r["scheduled"] for r in records))),
        "dispatch_lag_p99_ms": finite(percentile([r["lag_ms"] for r in records], 99)),
        "memory_tokens_p50": finite(percentile([r.get("memory_tokens", 0) for r in ok], 50)),
        "injected_share": finite(sum(r.get("injected", 0) > 0 for r in ok) / len(ok))
        if ok and mode == "kv" else None,
        "fallbacks": reasons,
        "meets_objective": bool(p99 <= objective_ms),
    }


def machine() -> dict:
    load1, load5, _ = os.getloadavg()
    out = {"loadavg_1m": round(load1, 2), "loadavg_5m": round(load5, 2),
           "cpus": os.cpu_count()}
    try:
        import psutil

        out["cpu_busy_percent"] = psutil.cpu_percent(interval=1.0)
        out["mem_available_gib"] = round(psutil.virtual_memory().available / GIB, 1)
    except ImportError:
        pass
    return out


def goodput(rows: list[dict], mode: str, rates: list[float]) -> dict:
    """The highest rate whose p99 TTFT met the objective, before the first that did not."""
    mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["rate"])
    best, failed_at = 0.0, None
    for r in mine:
        if not r["meets_objective"]:
            failed_at = r["rate"]
            break
        best = r["rate"]
    return {"goodput_rps": best, "first_miss_rps": failed_at,
            "lower_bound": failed_at is None,  # never missed within the rates run
            "below_lowest_rate": bool(mine) and best == 0.0}


def summarize(rows: list[dict], args) -> dict:
    """Both modes' goodput and ``goodput_vs_prompt`` (KV's over the prompt baseline's),
    with what the ratio is when a goodput is only bounded: ``goodput_vs_prompt_is``
    ``"measured"``, ``"a lower bound"`` (KV never missed within the rates run),
    ``"an upper bound"`` (the baseline never did) or ``"unbounded"``; when the baseline
    missed at the lowest rate run, the ratio exceeds KV's goodput over that rate
    (``goodput_vs_prompt_above``)."""
    good = {m: goodput(rows, m, args.rates) for m in MODES}
    kv, prompt = good["kv"]["goodput_rps"], good["prompt"]["goodput_rps"]
    out = {"objective": f"p99 TTFT <= {args.objective_ms:g} ms",
           "goodput_kv_rps": kv, "goodput_prompt_rps": prompt,
           "goodput_vs_prompt": round(kv / prompt, 2) if prompt else None}
    if prompt and kv:
        kind = {(False, False): "measured", (True, False): "a lower bound",
                (False, True): "an upper bound", (True, True): "unbounded"}
        out["goodput_vs_prompt_is"] = kind[good["kv"]["lower_bound"],
                                           good["prompt"]["lower_bound"]]
    elif kv and good["prompt"]["first_miss_rps"]:
        out["goodput_vs_prompt_above"] = round(kv / good["prompt"]["first_miss_rps"], 2)
    return {**out, "kv": good["kv"], "prompt": good["prompt"]}
