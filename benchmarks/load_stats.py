"""The load benchmark's statistics (``benchmarks/load.py``): per step (one mode at one
arrival rate) the latency percentiles, throughput, fallbacks and memory sources of its
requests, and per mode the goodput: the highest rate whose p99 TTFT met the objective,
before the first rate that missed it (a request that failed or did not finish counts as
missing it). ``python -m benchmarks.load_stats RESULT.json ...`` prints a run's progress.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from benchmarks.load_plan import GIB, MODES  # noqa: F401 - re-exported for load.py

TIERS = ("gpu", "host", "storage")
STEADY_RATIO = 1.5  # the bound on the engine's step time p99 / p50 under KV load


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
    by_tier = [r["facts_by_tier"] for r in ok if isinstance(r.get("facts_by_tier"), dict)]
    storage = [r["storage_bytes"] for r in ok if r.get("storage_bytes") is not None]
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
        "over_objective": sum(t > objective_ms for t in ttft),
        "facts_by_tier": {t: sum(int(b.get(t, 0)) for b in by_tier) for t in TIERS}
        if by_tier else None,
        "storage_bytes": sum(storage) if storage else None,
        "requests_reading_storage": sum(b > 0 for b in storage) if storage else None,
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


def goodput(rows: list[dict], mode: str, rates: list[float] | None = None) -> dict:
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


def step_times(rows: list[dict]) -> dict:
    """mode -> rate -> the engine's busy-step time p50/p99 (ms), their ratio, and vLLM's
    mean queue and prefill time per request (queueing against prefill)."""
    out: dict = {}
    for r in sorted(rows, key=lambda r: r["rate"]):
        if "step_p50_ms" in r:
            out.setdefault(r["mode"], {})[f"{r['rate']:g}"] = {
                "p50_ms": r["step_p50_ms"], "p99_ms": r["step_p99_ms"],
                "p99_over_p50": r["step_p99_over_p50"],
                "queue_mean_ms": r.get("queue_mean_ms"),
                "prefill_mean_ms": r.get("prefill_mean_ms")}
    return out


def steady_below(rows: list[dict], goodput_rps: float) -> dict:
    """Whether KV's step-time p99 stayed within :data:`STEADY_RATIO` x its p50 at every
    rate below KV's goodput (None: no such rate, or the server does not export step
    times)."""
    below = [r for r in rows if r["mode"] == "kv" and r["rate"] < goodput_rps]
    ratios = [r.get("step_p99_over_p50") for r in below]
    known = bool(below) and all(x is not None for x in ratios)
    return {"kv_step_p99_within_1_5x_p50_below_goodput":
            all(x <= STEADY_RATIO for x in ratios) if known else None,
            "kv_step_p99_over_p50_max_below_goodput": max(ratios) if known else None,
            "kv_step_rates_checked": [r["rate"] for r in below]}


def summarize(rows: list[dict], args, prompt_goodput: float | None = None,
              prompt_source: str = "another run (--prompt-goodput)") -> dict:
    """Both modes' goodput and ``goodput_vs_prompt`` (KV's over the prompt baseline's),
    with what the ratio is when a goodput is only bounded: ``goodput_vs_prompt_is``
    ``"measured"``, ``"a lower bound"`` (KV never missed within the rates run),
    ``"an upper bound"`` (the baseline never did) or ``"unbounded"``; when the baseline
    missed at the lowest rate run, the ratio exceeds KV's goodput over that rate
    (``goodput_vs_prompt_above``). ``prompt_goodput``: the baseline's goodput measured
    elsewhere (``prompt_source`` says where), used instead of these rows. Also KV's p99 TTFT at
    the baseline's goodput, the step times per mode and rate, and whether KV's stayed
    steady (:func:`steady_below`)."""
    good = {m: goodput(rows, m) for m in MODES}
    if prompt_goodput is not None:
        good["prompt"] = {"goodput_rps": prompt_goodput, "first_miss_rps": None,
                          "lower_bound": False, "below_lowest_rate": False,
                          "given": f"measured in {prompt_source}"}
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
    at_g = [r for r in rows if r["mode"] == "kv" and prompt and math.isclose(r["rate"], prompt)]
    out["kv_p99_ttft_at_prompt_goodput_ms"] = at_g[0].get("ttft_p99_ms") if at_g else None
    out["kv_meets_objective_at_prompt_goodput"] = at_g[0]["meets_objective"] if at_g else None
    out.update(steady_below(rows, kv))
    kv_rows = sorted((r for r in rows if r["mode"] == "kv" and r.get("profile")),
                     key=lambda r: r["rate"])
    if kv_rows:  # the py-spy files of KV's highest passing rate and of its first miss
        out["kv_profiles"] = {
            "at_goodput": next((r["profile"].get("files") for r in kv_rows
                                if r["rate"] == kv), None),
            "at_first_miss": next((r["profile"].get("files") for r in kv_rows
                                   if r["rate"] == good["kv"]["first_miss_rps"]), None)}
    out["step_time_ms"] = step_times(rows)
    return {**out, "kv": good["kv"], "prompt": good["prompt"]}


def progress(result: dict) -> list[str]:
    """A few lines on a (possibly unfinished) result: each step's p99 TTFT, whether it met
    the objective, and the step times; then the summary's goodputs."""
    lines = [f"users {result.get('users')}: {len(result.get('rows', []))} steps"
             + (" (finished)" if "total_seconds" in result else " (running)")]
    for r in result.get("rows", []):
        step = (f" step p50/p99 {r.get('step_p50_ms')}/{r.get('step_p99_ms')} ms"
                if r.get("step_p50_ms") is not None else "")
        lines.append(f"  {r['mode']:>6} {r['rate']:>7g} rps: p99 {r['ttft_p99_ms']} ms, "
                     f"over {r.get('over_objective')}/{r['requests']}, "
                     f"{'met' if r['meets_objective'] else 'MISSED'}{step}")
    s = result.get("summary") or {}
    if s:
        lines.append("  " + ", ".join(f"{k} {s.get(k)}" for k in (
            "goodput_prompt_rps", "goodput_kv_rps", "goodput_vs_prompt", "goodput_vs_prompt_is",
            "kv_p99_ttft_at_prompt_goodput_ms", "kv_step_p99_within_1_5x_p50_below_goodput")))
    return lines


if __name__ == "__main__":
    for path in sys.argv[1:]:
        try:
            print(path + "\n" + "\n".join(progress(json.loads(Path(path).read_text()))))
        except (OSError, ValueError, KeyError) as exc:
            print(f"{path}: unreadable ({exc})")
