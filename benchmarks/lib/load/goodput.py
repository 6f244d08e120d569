"""The load benchmark's statistics (``benchmarks.load``): per step (one mode at one
arrival rate) the latency percentiles, throughput, fallbacks and memory sources of its
requests (and its slowest few, with what each cold one's split saw), and per mode the goodput: the highest rate whose p99 TTFT met the objective,
before the first rate that missed it (a request that failed or did not finish counts as
missing it). ``python -m benchmarks.lib.load.goodput RESULT.json ...`` prints a run's
progress.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from benchmarks.lib.load.plan import GIB, MODES

TIERS = ("gpu", "host", "storage")


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


def served_from(facts_by_tier: dict | None) -> str:
    """The tier a request's memory came from: ``storage`` if any fact was read from
    storage, else ``host`` if any from the host tier, else ``gpu``; ``none`` when nothing
    was injected (prefilled instead, or no memory)."""
    counts = facts_by_tier or {}
    return next((t for t in ("storage", "host", "gpu") if int(counts.get(t, 0)) > 0), "none")


def memory_check(records: list[dict], users: dict[str, dict] | None) -> dict | None:
    """Whose memory each answer used, against the user asked for: ``foreign`` counts the
    answers whose info names another user or a version other than the asked user's own
    (published for that user alone: users who share facts still have versions of their
    own); ``without_memory`` those answered without any. ``users``: user -> ``{"version",
    "tier"}`` (None: not checked). Also the requests by the tier their user started the
    scenario in (``by_starting_tier``)."""
    if users is None:
        return None
    ok = [r for r in records if "error" not in r]
    foreign = [r for r in ok if r.get("memory_version") is not None and (
        r.get("memory_user") != r["user"] or r["memory_version"] != users[r["user"]]["version"])]
    starting: dict[str, int] | None = dict.fromkeys(TIERS, 0)
    for r in records:
        tier = users[r["user"]].get("tier")
        if tier in starting:
            starting[tier] += 1
    if not any(u.get("tier") for u in users.values()):
        starting = None  # no tiers (stock vLLM)
    return {"answers": len(ok), "foreign": len(foreign),
            "foreign_examples": [{k: r.get(k) for k in ("user", "memory_user", "memory_version")}
                                 for r in foreign[:3]],
            "without_memory": sum(r.get("memory_version") is None for r in ok),
            "by_starting_tier": starting}


def step_summary(records: list[dict], mode: str, rate: float, objective_ms: float,
                 users: dict[str, dict] | None = None) -> dict:
    """One step's figures (see the module doc); ``users`` (user -> ``{"version",
    "tier"}``): check whose memory each answer used (:func:`memory_check`)."""
    ok = [r for r in records if "error" not in r]
    inf = math.inf
    ttft = [r.get("ttft_ms", inf) if "error" not in r else inf for r in records]
    e2e = [r.get("e2e_ms", inf) if "error" not in r else inf for r in records]
    q2ft = [r["q2ft_ms"] for r in ok if "q2ft_ms" in r]  # InferScale's server reports them
    engine = [r["engine_ttft_ms"] for r in ok if "engine_ttft_ms" in r]
    memory = [r["memory_ms"] for r in ok if r.get("memory_ms") is not None]
    lookup = [r["lookup_ms"] for r in ok if r.get("lookup_ms") is not None]
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
        # the server's time before the engine: the user's memory looked up (a first load
        # reads its facts table), the question embedded, the top-k, the prompt composed
        "memory_p50_ms": finite(percentile(memory, 50)),
        "memory_p99_ms": finite(percentile(memory, 99)),
        "lookup_p99_ms": finite(percentile(lookup, 99)),  # of it, the lookup alone
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
        "served_from": {t: sum(served_from(r.get("facts_by_tier")) == t for r in ok)
                        for t in (*TIERS, "none")} if mode == "kv" and ok else None,
        "memory_check": memory_check(records, users),
        "cold_decisions": cold_decisions(ok),
        "latency_by_source": latency_by_source(ok) if mode == "kv" else None,
        "slowest": slowest(records),
        "meets_objective": bool(p99 <= objective_ms),
    }


SPLIT_KEYS = ("chunks", "read_ms", "compute_ms", "wait_ms", "prefill_ahead_ms", "overhead_ms",
              "load_excess_ms", "prefill_busy", "deadline_ms")


def slowest(records: list[dict], n: int = 5) -> list[dict]:
    """The step's ``n`` slowest requests by TTFT (a failed one first), each with when it
    was scheduled in the step, its TTFT, the engine's (of it, the engine core's queue and
    prefill, as vLLM timed them) and the server's memory time, where
    its memory came from and, for a user in no tier, its split and the estimates behind
    it: a p99 of 400 requests is its fourth slowest, so these are the ones that set it."""
    def key(r: dict) -> float:
        return math.inf if "error" in r else r.get("ttft_ms", math.inf)

    out = []
    for r in sorted(records, key=key, reverse=True)[:n]:
        row = {"at_s": round(r["scheduled"], 3), "ttft_ms": finite(key(r)),
               **{k: r[k] for k in ("engine_ttft_ms", "engine_queued_ms", "engine_prefill_ms",
                                    "memory_ms", "fallback_reason", "storage_bytes", "error")
                  if r.get(k) is not None}}
        if "facts_by_tier" in r:
            row["served_from"] = served_from(r.get("facts_by_tier"))
        cold = r.get("cold")
        if isinstance(cold, dict):
            split = cold.get("split") if isinstance(cold.get("split"), dict) else {}
            row["cold"] = {"facts_loaded": cold.get("facts_loaded"),
                           "facts_computed": cold.get("facts_computed"),
                           **{k: split[k] for k in SPLIT_KEYS if split.get(k) is not None}}
        out.append(row)
    return out


def latency_by_source(ok: list[dict]) -> dict | None:
    """Which requests set the step's tail: per :func:`served_from` class (``none``: all
    memory prefilled, as a cold request's computed split is) the requests and their TTFT
    p50/p99 (over a class of fewer than 100 requests the p99 is about its largest), the
    server's memory phase p99 (and of it the lookup's: a user's first load reads its
    facts from storage) and the engine's TTFT p99; None without any."""
    groups: dict[str, list[dict]] = {}
    for r in ok:
        groups.setdefault(served_from(r.get("facts_by_tier")), []).append(r)

    def p(rs: list[dict], key: str, q: float) -> float | None:
        return finite(percentile([r[key] for r in rs if r.get(key) is not None], q))

    return {src: {"requests": len(rs), "ttft_p50_ms": p(rs, "ttft_ms", 50),
                  "ttft_p99_ms": p(rs, "ttft_ms", 99), "memory_p99_ms": p(rs, "memory_ms", 99),
                  "lookup_p99_ms": p(rs, "lookup_ms", 99),
                  "engine_ttft_p99_ms": p(rs, "engine_ttft_ms", 99)}
            for src, rs in sorted(groups.items())} or None


def cold_decisions(ok: list[dict]) -> dict | None:
    """What the compute-or-load split saw when it decided the step's cold requests (the
    estimates each answer's ``cold.split`` carries, taken before the request ran, unlike
    the scrape's ``metrics.cold.estimates_at_end``): how many, their facts loaded and
    computed, and the median and largest congestion ``ρ`` (``prefill_busy``), queue wait
    (and of it the server's own prefill queue ahead, ``prefill_ahead_ms``), compute per
    token (the one used, and the requests' own fit), storage bandwidth,
    a read's overhead and what loads cost lately beyond the rule (``load_excess_ms``);
    None when no answer reports a split."""
    cold = [r["cold"] for r in ok if isinstance(r.get("cold"), dict)]
    splits = [c["split"] for c in cold if isinstance(c.get("split"), dict)]
    if not cold:
        return None

    def stat(name: str) -> dict | None:
        xs = [float(s[name]) for s in splits if s.get(name) is not None]
        return {"p50": finite(percentile(xs, 50)), "max": finite(max(xs))} if xs else None

    return {"requests": len(cold),
            "facts_loaded": sum(int(c.get("facts_loaded") or 0) for c in cold),
            "facts_computed": sum(int(c.get("facts_computed") or 0) for c in cold),
            "requests_loading": sum(int(c.get("facts_loaded") or 0) > 0 for c in cold),
            "prefill_busy": stat("prefill_busy"), "wait_ms": stat("wait_ms"),
            "prefill_ahead_ms": stat("prefill_ahead_ms"),
            "compute_us_per_token": stat("compute_us_per_token"),
            "request_fit_us_per_token": stat("request_fit_us_per_token"),
            "bandwidth_bytes_per_s": stat("bandwidth_bytes_per_s"),
            "read_overhead_ms": stat("read_overhead_ms"),
            "load_excess_ms": stat("load_excess_ms"),
            "step_base_ms": stat("step_base_ms"), "request_cost_ms": stat("request_cost_ms")}


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
    """The highest rate whose p99 TTFT met the objective, before the first that did not;
    None when ``mode`` ran no step (not 0: a scenario the deadline stopped before its first
    step measured nothing)."""
    mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["rate"])
    if not mine:
        return {"goodput_rps": None, "first_miss_rps": None, "lower_bound": False,
                "below_lowest_rate": False}
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


def step_ratio_below(rows: list[dict], goodput_rps: float | None) -> dict:
    """KV's largest engine step-time p99 / p50 at the rates below its goodput (reported,
    not a target: stock vLLM's own prefix-cached steps have the same shape); None when
    no such rate ran or the server does not export step times."""
    below = [r for r in rows if r["mode"] == "kv" and r["rate"] < (goodput_rps or 0.0)]
    ratios = [r.get("step_p99_over_p50") for r in below]
    known = bool(below) and all(x is not None for x in ratios)
    return {"kv_step_p99_over_p50_max_below_goodput": max(ratios) if known else None,
            "kv_step_rates_checked": [r["rate"] for r in below]}


def memory_checks(rows: list[dict]) -> dict | None:
    """Every step's :func:`memory_check` added up: ``no_foreign_memory`` is True when no
    answer of the scenario used another user's memory (None: not checked)."""
    checks = [r["memory_check"] for r in rows if r.get("memory_check")]
    if not checks:
        return None
    total = {k: sum(c[k] for c in checks) for k in ("answers", "foreign", "without_memory")}
    return {**total, "no_foreign_memory": total["foreign"] == 0}


def shares(counts: list[dict | None]) -> dict | None:
    """Summed counts -> shares of their total (None when nothing was counted)."""
    summed: dict[str, int] = {}
    for c in counts:
        for k, v in (c or {}).items():
            summed[k] = summed.get(k, 0) + v
    n = sum(summed.values())
    return {k: round(v / n, 4) for k, v in summed.items()} if n else None


def versus(kv: dict, base: dict, base_rps: float | None, name: str) -> dict:
    """KV's goodput over a baseline's (``goodput_vs_<name>``), with what the ratio is
    when a goodput is only bounded (``goodput_vs_<name>_is``) or, when the baseline missed
    at its lowest rate, the bound above (``goodput_vs_<name>_above``)."""
    out: dict = {f"goodput_vs_{name}": round(kv["goodput_rps"] / base_rps, 2)
                 if base_rps and kv["goodput_rps"] is not None else None}
    if base_rps and kv["goodput_rps"]:
        kind = {(False, False): "measured", (True, False): "a lower bound",
                (False, True): "an upper bound", (True, True): "unbounded"}
        out[f"goodput_vs_{name}_is"] = kind[kv["lower_bound"], base["lower_bound"]]
    elif kv["goodput_rps"] and base.get("first_miss_rps"):
        out[f"goodput_vs_{name}_above"] = round(kv["goodput_rps"] / base["first_miss_rps"], 2)
    return out


def kv_at(rows: list[dict], rate: float | None, name: str) -> dict:
    """KV's p99 TTFT at a baseline's goodput, and whether it met the objective there."""
    at = [r for r in rows if r["mode"] == "kv" and rate and math.isclose(r["rate"], rate)]
    return {f"kv_p99_ttft_at_{name}_goodput_ms": at[0].get("ttft_p99_ms") if at else None,
            f"kv_meets_objective_at_{name}_goodput": at[0]["meets_objective"] if at else None}


def summarize(rows: list[dict], args, prompt_goodput: float | None = None,
              prompt_source: str = "another run (--prompt-goodput)") -> dict:
    """Each mode's goodput; KV's against the prompt baseline (``goodput_vs_prompt``) and
    against stock vLLM (``goodput_vs_peer``: ``args.peer_goodput``, measured by the peer
    run, ``args.peer_source``), each with what the ratio is when a goodput is only bounded
    (:func:`versus`), and KV's p99 TTFT at each baseline's goodput. ``prompt_goodput``:
    the baseline's goodput measured elsewhere (``prompt_source`` says where), used instead
    of these rows. Also the step times per mode and rate, whose answers used whose memory
    (:func:`memory_checks`), and KV's requests by the tier their user started in and the
    tier their memory was served from."""
    good = {m: goodput(rows, m) for m in ("peer", *MODES)}
    if prompt_goodput is not None:
        good["prompt"] = {"goodput_rps": prompt_goodput, "first_miss_rps": None,
                          "lower_bound": False, "below_lowest_rate": False,
                          "given": f"measured in {prompt_source}"}
    if "peer" in getattr(args, "modes", ()):  # the peer's own run
        return {"objective": f"p99 TTFT <= {args.objective_ms:g} ms",
                "goodput_peer_rps": good["peer"]["goodput_rps"], "peer": good["peer"],
                "memory": memory_checks(rows), "step_time_ms": step_times(rows)}
    peer_rps = getattr(args, "peer_goodput", None)
    peer = {"goodput_rps": peer_rps, "first_miss_rps": getattr(args, "peer_first_miss", None),
            "lower_bound": getattr(args, "peer_lower_bound", False),
            "given": getattr(args, "peer_source", None)}
    kv, prompt = good["kv"]["goodput_rps"], good["prompt"]["goodput_rps"]
    out = {"objective": f"p99 TTFT <= {args.objective_ms:g} ms",
           "goodput_kv_rps": kv, "goodput_prompt_rps": prompt, "goodput_peer_rps": peer_rps,
           **versus(good["kv"], good["prompt"], prompt, "prompt"),
           **versus(good["kv"], peer, peer_rps, "peer"),
           **kv_at(rows, prompt, "prompt"), **kv_at(rows, peer_rps, "peer")}
    out.update(step_ratio_below(rows, kv))
    kv_rows = [r for r in rows if r["mode"] == "kv"]
    out["memory"] = memory_checks(rows)
    out["kv_requests_by_starting_tier"] = shares(
        [(r.get("memory_check") or {}).get("by_starting_tier") for r in kv_rows])
    out["kv_requests_served_from"] = shares([r.get("served_from") for r in kv_rows])
    profiled = sorted((r for r in kv_rows if r.get("profile")), key=lambda r: r["rate"])
    if profiled:  # the py-spy files of KV's highest passing rate and of its first miss
        out["kv_profiles"] = {
            "at_goodput": next((r["profile"].get("files") for r in profiled
                                if r["rate"] == kv), None),
            "at_first_miss": next((r["profile"].get("files") for r in profiled
                                   if r["rate"] == good["kv"]["first_miss_rps"]), None)}
    out["step_time_ms"] = step_times(rows)
    return {**out, "kv": good["kv"], "prompt": good["prompt"], "peer": peer}


def progress(result: dict) -> list[str]:
    """A few lines on a (possibly unfinished) result: each step's p99 TTFT, whether it met
    the objective, and the step times; then the summary's goodputs."""
    lines = [f"users {result.get('users')}: {len(result.get('rows', []))} steps"
             + (" (finished)" if "total_seconds" in result else " (running)")]
    for sk in result.get("skipped_steps", []):
        lines.append(f"  {sk['mode']:>6} {sk['rate']:>7g} rps: SKIPPED, needs {sk['needs_s']} s, "
                     f"{sk['left_s']} s were left before --deadline-s")
    for r in result.get("rows", []):
        step = (f" step p50/p99 {r.get('step_p50_ms')}/{r.get('step_p99_ms')} ms"
                if r.get("step_p50_ms") is not None else "")
        if r.get("loop_lag_p99_ms") is not None:
            step += f" loop lag p99/max {r['loop_lag_p99_ms']}/{r.get('loop_lag_max_ms')} ms"
        if r.get("loop_stalls") or r.get("gc_pauses"):
            step += f" stalls {r.get('loop_stalls')}, gc pauses {r.get('gc_pauses')}"
        cold = r.get("cold_decisions")
        if cold:
            busy = cold.get("prefill_busy") or {}
            c = (cold.get("compute_us_per_token") or {}).get("p50")
            step += (f" cold {cold['requests']}: facts loaded/computed {cold['facts_loaded']}/"
                     f"{cold['facts_computed']}, rho p50/max {busy.get('p50')}/{busy.get('max')}"
                     f", c p50 {c} us")
        phases = (r.get("metrics") or {}).get("fetch_phase_ms_per_read")
        if phases:
            step += " read ms " + "/".join(f"{k} {v}" for k, v in phases.items())
        loads = (r.get("metrics") or {}).get("memory_load_ms_per_lookup")
        if loads:
            step += " first loads ms " + "/".join(f"{k} {v}" for k, v in loads.items())
        by = r.get("latency_by_source") or {}
        slowest = max(by, key=lambda k: by[k].get("ttft_p99_ms") or 0.0, default=None)
        if slowest is not None:
            step += (f" tail: {slowest} ({by[slowest]['requests']} requests, p99 "
                     f"{by[slowest]['ttft_p99_ms']} ms)")
        lines.append(f"  {r['mode']:>6} {r['rate']:>7g} rps: p99 {r['ttft_p99_ms']} ms, "
                     f"over {r.get('over_objective')}/{r['requests']}, "
                     f"{'met' if r['meets_objective'] else 'MISSED'}{step}")
    s = result.get("summary") or {}
    if s:
        lines.append("  " + ", ".join(f"{k} {s.get(k)}" for k in (
            "goodput_peer_rps", "goodput_prompt_rps", "goodput_kv_rps", "goodput_vs_peer",
            "goodput_vs_peer_is", "goodput_vs_prompt", "kv_p99_ttft_at_peer_goodput_ms",
            "kv_p99_ttft_at_prompt_goodput_ms", "kv_requests_by_starting_tier") if k in s))
        if s.get("memory"):
            lines.append(f"  memory: {s['memory']}")
    return lines


if __name__ == "__main__":
    for path in sys.argv[1:]:
        try:
            print(path + "\n" + "\n".join(progress(json.loads(Path(path).read_text()))))
        except (OSError, ValueError, KeyError) as exc:
            print(f"{path}: unreadable ({exc})")
