"""The load benchmark's reading of the server's ``/metrics`` (``benchmarks.load``).

A scrape is parsed into ``{(sample name, sorted labels): value}`` (:func:`parse`, with
prometheus_client's parser). Per rate step, the benchmark scrapes at the step's start and
again once it drained; :func:`step_metrics` turns the two into what changed:

- counters: reloads and failures, promotions declined, seconds reloads yielded to
  requests' reads, fallbacks by reason, preemptions, the connector's time
  per side, injected facts by the tier they were read from, bytes read from storage and
  those reads' mean time per read by phase (``fetch_phase_ms_per_read``: the chunk index,
  staging memory, the rows, checking and placing them), and the server's first loads of
  users' memory, mean time per storage lookup by phase (``memory_load_ms_per_lookup``:
  queued for a load thread, LATEST, the version, the hand-back to the event loop);
- the compute-or-load split (``cold``): requests of users in neither tier, their facts
  loaded and computed, bytes read, and the split's estimates at the step's end;
- histograms (bucket counts subtracted, summed over every label but ``le``): count, mean,
  p50 and p99 of the engine's busy step time, the injection per step, per-request fetches
  from storage, and vLLM's own per-request queue time, prefill time, TTFT and inter-token
  latency (queueing against prefill), and the server's event-loop lag (how late a probe
  sleeping 10 ms woke: :func:`loop_lag`, with the largest lag's bucket). Percentiles are **interpolated linearly within
  buckets** as Prometheus' ``histogram_quantile`` does: exact only to a bucket's width, and a
  quantile in the ``+Inf`` bucket is reported as the largest finite bound (``capped``).

A metric the server does not export gives None: older servers and the CPU build lack some.
"""

from __future__ import annotations

import math

HISTOGRAM_METHOD = (
    "per step: bucket counts of the server's /metrics histograms at the step's end minus "
    "its start, summed over labels; p50/p99 interpolated linearly within buckets "
    "(Prometheus histogram_quantile), so exact to a bucket's width; 'capped' when the "
    "quantile lies in the +Inf bucket (reported as the largest finite bound)")

# result key -> histogram name(s), the first present wins
HISTOGRAMS = {
    "engine_step": ("inferscale_engine_step_seconds",),
    "inject_kernel": ("inferscale_inject_kernel_seconds",),
    "storage_fetch": ("inferscale_fetch_seconds",),
    "reload": ("inferscale_reload_seconds",),
    "vllm_queue": ("vllm:request_queue_time_seconds",),
    "vllm_prefill": ("vllm:request_prefill_time_seconds",),
    "vllm_ttft": ("vllm:time_to_first_token_seconds",),
    "vllm_inter_token": ("vllm:inter_token_latency_seconds",
                         "vllm:time_per_output_token_seconds"),
    "event_loop_lag": ("inferscale_event_loop_lag_seconds",),
}
LOOP_LAG = "inferscale_event_loop_lag_seconds"


def parse(text: str) -> dict:
    """Prometheus text -> ``{(sample name, sorted (label, value) pairs): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(m: dict, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when absent)."""
    return sum(v for (n, lab), v in m.items()
               if n == name and all(dict(lab).get(k) == str(x) for k, x in labels.items()))


def present(m: dict, name: str) -> bool:
    return any(n == name for n, _ in m)


def counter_delta(before: dict, after: dict, name: str, **labels) -> float | None:
    """How much a counter moved; None when the server does not export it."""
    if not present(after, name):
        return None
    return metric(after, name, **labels) - metric(before, name, **labels)


def histogram_delta(before: dict, after: dict, name: str) -> dict | None:
    """``{"count", "sum", "buckets": [(upper bound, cumulative count), ...]}`` of what was
    observed between two scrapes, summed over every label but ``le``; None when absent."""
    def buckets(m: dict) -> dict[float, float]:
        out: dict[float, float] = {}
        for (n, lab), v in m.items():
            if n == f"{name}_bucket":
                le = float(dict(lab)["le"])
                out[le] = out.get(le, 0.0) + v
        return out

    after_b = buckets(after)
    if not after_b:
        return None
    before_b = buckets(before)
    cumulative = [(le, after_b[le] - before_b.get(le, 0.0)) for le in sorted(after_b)]
    return {"count": metric(after, f"{name}_count") - metric(before, f"{name}_count"),
            "sum": metric(after, f"{name}_sum") - metric(before, f"{name}_sum"),
            "buckets": cumulative}


def _locate(q: float, buckets: list[tuple[float, float]]) -> tuple[float, float, float, float]:
    """The bucket holding quantile ``q``: (lower bound, upper bound, cumulative count
    below it, cumulative count at its top), and the rank ``q x total`` is within."""
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > prev_count:
            return prev_le, le, prev_count, count
        prev_le, prev_count = le, count
    return prev_le, prev_le, prev_count, prev_count


def quantile(q: float, buckets: list[tuple[float, float]]) -> tuple[float | None, bool]:
    """``histogram_quantile``: (value, capped) from cumulative ``(upper bound, count)``
    pairs in rising order ending with ``+Inf``; (None, False) when nothing was observed."""
    if not buckets or buckets[-1][1] <= 0:
        return None, False
    lo, hi, below, top = _locate(q, buckets)
    if math.isinf(hi):  # beyond the largest finite bound
        return lo, True
    if top <= below:
        return hi, False
    return lo + (hi - lo) * (q * buckets[-1][1] - below) / (top - below), False


def summarize_histogram(h: dict | None, scale: float = 1e3) -> dict | None:
    """count, mean, p50 and p99 of a :func:`histogram_delta` (milliseconds by default),
    each percentile with the bucket it lies in (``p50_within_ms``: the resolution; vLLM's
    request-latency buckets are hundreds of ms wide, so there the mean says more)."""
    if h is None:
        return None
    out: dict = {"count": int(round(h["count"]))}
    if h["count"] <= 0:
        return {**out, "mean_ms": None, "p50_ms": None, "p99_ms": None}
    out["mean_ms"] = round(h["sum"] / h["count"] * scale, 3)
    for p in (50, 99):
        value, capped = quantile(p / 100, h["buckets"])
        out[f"p{p}_ms"] = None if value is None else round(value * scale, 3)
        if value is not None:
            lo, hi = _locate(p / 100, h["buckets"])[:2]
            out[f"p{p}_within_ms"] = [round(lo * scale, 3),
                                      None if math.isinf(hi) else round(hi * scale, 3)]
        if capped:
            out[f"p{p}_capped"] = True
    return out


def labelled(m: dict, name: str, label: str) -> dict[str, float]:
    return {dict(lab)[label]: v for (n, lab), v in m.items()
            if n == name and label in dict(lab)}


def step_metrics(before: dict, after: dict) -> dict:
    """What changed on the server during one step (see the module doc)."""
    def moved(name: str) -> float | None:
        return counter_delta(before, after, name)

    def by_label(name: str, label: str) -> dict | None:
        if not present(after, name):
            return None
        was = labelled(before, name, label)
        return {k: round(v - was.get(k, 0.0), 6) for k, v in labelled(after, name, label).items()}

    d: dict = {name: moved(f"inferscale_{name}_total")
               for name in ("reloads", "reload_failures", "worker_load_failures",
                            "promotions_declined", "reload_yielded_seconds")}
    d["fallbacks"] = {k: v for k, v in (by_label("inferscale_fallbacks_total", "reason")
                                        or {}).items() if v}
    d["resident_users"] = {t: metric(after, "inferscale_resident_users", tier=t)
                           for t in ("gpu", "host")}
    d["resident_users_at_start"] = {t: metric(before, "inferscale_resident_users", tier=t)
                                    for t in ("gpu", "host")}
    d["preemptions"] = moved("vllm:num_preemptions_total")
    d["histograms"] = {key: summarize_histogram(next(
        (h for h in (histogram_delta(before, after, n) for n in names) if h), None))
        for key, names in HISTOGRAMS.items()}
    d["connector_seconds"] = by_label("inferscale_connector_seconds_total", "side")
    steps = (d["histograms"]["engine_step"] or {}).get("count")
    d["connector_ms_per_busy_step"] = (
        {side: round(s / steps * 1e3, 4) for side, s in d["connector_seconds"].items()}
        if d["connector_seconds"] is not None and steps else None)
    d["memory_facts"] = by_label("inferscale_memory_facts_total", "tier")
    d["storage_read_bytes"] = moved("inferscale_storage_read_bytes_total")
    phases = by_label("inferscale_fetch_phase_seconds_total", "phase")
    reads = (d["histograms"]["storage_fetch"] or {}).get("count")
    d["fetch_phase_ms_per_read"] = (
        {phase: round(s / reads * 1e3, 3) for phase, s in phases.items()}
        if phases is not None and reads else None)
    loads = by_label("inferscale_memory_load_seconds_total", "phase")
    lookups = moved("inferscale_memory_storage_lookups_total")
    d["memory_load_ms_per_lookup"] = (
        {phase: round(s / lookups * 1e3, 3) for phase, s in loads.items()}
        if loads is not None and lookups else None)
    d["cold"] = cold_split(before, after, moved, by_label)
    return d


def cold_split(before: dict, after: dict, moved, by_label) -> dict | None:
    """The step's requests of users in neither tier: how many, their facts loaded from
    storage and computed, bytes read, and the split's estimates at the step's end (the
    bandwidth ``B``, ``W``, ``c``, ``D``, ``Q``, the fixed part, ``ρ``)."""
    if not present(after, "inferscale_cold_requests_total"):
        return None
    gauges = labelled(after, "inferscale_cold_split_estimate", "quantity")
    if present(after, "inferscale_storage_bandwidth_bytes_per_second"):
        gauges["bandwidth_bytes_per_second"] = metric(
            after, "inferscale_storage_bandwidth_bytes_per_second")
    return {"requests": moved("inferscale_cold_requests_total"),
            "facts": by_label("inferscale_cold_facts_total", "source"),
            "read_bytes": moved("inferscale_cold_read_bytes_total"),
            "estimates_at_end": gauges or None}


def largest(h: dict | None) -> tuple[float, float] | None:
    """(lower, upper bound) of the highest bucket of a :func:`histogram_delta` that holds
    an observation: where its largest value lies (upper ``inf`` past the last bound);
    None when nothing was observed."""
    if h is None or not h["buckets"] or h["buckets"][-1][1] <= 0:
        return None
    prev_le, prev_count, found = 0.0, 0.0, None
    for le, count in h["buckets"]:
        if count > prev_count:
            found = (prev_le, le)
        prev_le, prev_count = le, count
    return found


def loop_lag(before: dict, after: dict) -> dict:
    """The row's event-loop keys: the lag's p99 (interpolated), its largest value's bucket
    (``loop_lag_max_ms``: the bucket's upper bound, the lower one when past the last; the
    bucket itself in ``loop_lag_max_within_ms``), the probe's samples and their total
    (time the loop was late in all), the stalls its watchdog saw (>= 100 ms; the server
    logs their stacks) and the garbage collections of 100 ms or more; None when the
    server does not export them."""
    h = histogram_delta(before, after, LOOP_LAG)
    s = summarize_histogram(h) or {}
    top = largest(h)
    return {"loop_lag_p99_ms": s.get("p99_ms"),
            "loop_lag_max_ms": None if top is None else round(
                (top[0] if math.isinf(top[1]) else top[1]) * 1e3, 3),
            "loop_lag_max_within_ms": None if top is None else [
                round(top[0] * 1e3, 3), None if math.isinf(top[1]) else round(top[1] * 1e3, 3)],
            "loop_lag_samples": s.get("count"),
            "loop_lag_total_ms": None if h is None else round(h["sum"] * 1e3, 3),
            "loop_stalls": counter_delta(before, after, "inferscale_event_loop_stalls_total"),
            "gc_pauses": None if not present(after, "inferscale_gc_pauses_total") else round(
                sum(labelled(after, "inferscale_gc_pauses_total", "generation").values())
                - sum(labelled(before, "inferscale_gc_pauses_total", "generation").values()))}


def step_time(metrics: dict) -> dict:
    """The row's step-time keys: the engine's busy-step p50/p99 (the connector's
    histogram) and vLLM's mean queue and prefill time per request; None when the server
    does not export them."""
    hists = metrics.get("histograms") or {}
    h = hists.get("engine_step") or {}
    p50, p99 = h.get("p50_ms"), h.get("p99_ms")
    return {"step_p50_ms": p50, "step_p99_ms": p99, "engine_steps": h.get("count"),
            "step_p99_over_p50": round(p99 / p50, 3) if p50 and p99 is not None else None,
            "queue_mean_ms": (hists.get("vllm_queue") or {}).get("mean_ms"),
            "prefill_mean_ms": (hists.get("vllm_prefill") or {}).get("mean_ms")}
