"""The load benchmark's reading of the server's ``/metrics``
(``benchmarks.lib.load.scrapes``): histogram quantiles within buckets, and what changed
between two real scrapes of the CPU server, with and without the connector's worker
metrics."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.lib.load.scrapes import (
    parse, quantile, step_metrics, step_time, summarize_histogram,
)


def _worker_families(step_buckets: dict[str, list[float]], scheduler_s: float, worker_s: float,
                     facts: dict[str, int], read_bytes: int) -> str:
    """The worker metrics the connector adds, rendered by prometheus_client the way the
    server's collector renders its worker families (one sample per rank)."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    class Families:
        def collect(self):
            hist = HistogramMetricFamily("inferscale_engine_step_seconds", "busy steps",
                                         labels=["rank"])
            for rank, counts in step_buckets.items():
                bounds = ["0.005", "0.01", "0.02", "0.05", "+Inf"]
                running, buckets = 0.0, []
                for bound, n in zip(bounds, counts):
                    running += n
                    buckets.append((bound, running))
                hist.add_metric([rank], buckets, sum_value=running * 0.01)
            yield hist
            side = CounterMetricFamily("inferscale_connector_seconds", "hooks",
                                       labels=["rank", "side"])
            side.add_metric(["0", "scheduler"], scheduler_s)
            side.add_metric(["0", "worker"], worker_s)
            yield side
            tier = CounterMetricFamily("inferscale_memory_facts", "facts", labels=["rank", "tier"])
            for t, n in facts.items():
                tier.add_metric(["0", t], n)
            yield tier
            read = CounterMetricFamily("inferscale_storage_read_bytes", "reads", labels=["rank"])
            read.add_metric(["0"], read_bytes)
            yield read

    return _rendered(Families())


def _rendered(collector) -> str:
    """``collector``'s families as prometheus_client renders a /metrics page."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_histogram_quantiles_interpolate_within_buckets():
    buckets = [(0.01, 0.0), (0.02, 50.0), (0.05, 99.0), (0.1, 100.0), (math.inf, 100.0)]
    assert quantile(0.5, buckets) == (pytest.approx(0.02), False)
    assert quantile(0.99, buckets) == (pytest.approx(0.05), False)
    assert quantile(0.25, buckets) == (pytest.approx(0.015), False)  # halfway in (0.01, 0.02]
    assert quantile(0.5, [(0.1, 1.0), (math.inf, 100.0)]) == (0.1, True)  # past the last bound
    assert quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) == (None, False)
    s = summarize_histogram({"count": 100.0, "sum": 2.5, "buckets": buckets})
    assert s == {"count": 100, "mean_ms": 25.0, "p50_ms": 20.0, "p99_ms": 50.0,
                 "p50_within_ms": [10.0, 20.0], "p99_within_ms": [20.0, 50.0]}
    capped = summarize_histogram({"count": 100.0, "sum": 9.0,
                                  "buckets": [(0.1, 1.0), (math.inf, 100.0)]})
    assert capped["p99_ms"] == 100.0 and capped["p99_capped"] is True
    assert capped["p99_within_ms"] == [100.0, None]
    assert summarize_histogram(None) is None


def test_step_metrics_from_a_real_scrape_and_the_worker_metrics():
    """Two scrapes of the CPU server around a KV step of 4 requests (one for a user not
    resident, who was reloaded), trimmed to the families the benchmark reads; then the
    same with the connector's worker metrics added, as a server exporting them renders
    them."""
    data = Path(__file__).parents[2] / "data"
    start = (data / "load-scrape-cpu-start.prom").read_text()
    end = (data / "load-scrape-cpu-end.prom").read_text()
    m = step_metrics(parse(start), parse(end))
    h = m["histograms"]
    assert [h[k]["count"] for k in ("vllm_ttft", "vllm_queue", "vllm_prefill")] == [4, 4, 4]
    assert h["vllm_inter_token"]["count"] == 12  # 3 more tokens per request
    assert h["vllm_prefill"]["mean_ms"] > h["vllm_queue"]["mean_ms"] > 0
    assert h["vllm_ttft"]["p50_ms"] <= h["vllm_ttft"]["p99_ms"]
    lo, hi = h["vllm_ttft"]["p99_within_ms"]
    assert lo <= h["vllm_ttft"]["p99_ms"] <= hi
    assert m["reloads"] == 1 and m["fallbacks"] == {"not_resident": 1.0}
    assert h["reload"]["count"] == 1 and m["preemptions"] == 0
    assert m["resident_users"] == {"gpu": 1.0, "host": 1.0}
    # what this server does not export: None, never an error
    assert h["engine_step"] is None and h["inject_kernel"] is None and h["storage_fetch"] is None
    assert m["connector_seconds"] is None and m["connector_ms_per_busy_step"] is None
    assert m["memory_facts"] is None and m["storage_read_bytes"] is None
    assert m["cold"] is None
    assert step_time(m) == {"step_p50_ms": None, "step_p99_ms": None, "engine_steps": None,
                            "step_p99_over_p50": None, "queue_mean_ms": h["vllm_queue"]["mean_ms"],
                            "prefill_mean_ms": h["vllm_prefill"]["mean_ms"]}

    before = start + _worker_families({"0": [10, 0, 0, 0, 0], "1": [5, 0, 0, 0, 0]}, 1.0, 2.0,
                                      {"gpu": 10, "host": 0, "storage": 0}, 0)
    after = end + _worker_families({"0": [70, 30, 10, 0, 0], "1": [45, 40, 9, 1, 0]}, 1.5, 3.0,
                                   {"gpu": 100, "host": 30, "storage": 15}, 5 << 20)
    m = step_metrics(parse(before), parse(after))
    # both ranks' steps, this step's only: per bucket 100, 70, 19, 1 -> 190 steps
    step = m["histograms"]["engine_step"]
    assert step["count"] == 190 and step["mean_ms"] == pytest.approx(10.0)
    assert step["p50_ms"] == pytest.approx(4.75)  # rank 95 of 100 in (0, 5 ms]
    assert step["p99_ms"] == pytest.approx(10 + 10 * 18.1 / 19, abs=1e-3)  # in (10, 20 ms]
    assert m["connector_seconds"] == {"scheduler": 0.5, "worker": 1.0}
    assert m["connector_ms_per_busy_step"] == {"scheduler": pytest.approx(2.6316, abs=1e-4),
                                               "worker": pytest.approx(5.2632, abs=1e-4)}
    assert m["memory_facts"] == {"gpu": 90, "host": 30, "storage": 15}
    assert m["storage_read_bytes"] == 5 << 20
    assert m["cold"] is None  # a server without the split's families
    t = step_time(m)
    assert (t["step_p50_ms"], t["engine_steps"]) == (4.75, 190)
    assert t["step_p99_over_p50"] == pytest.approx(t["step_p99_ms"] / 4.75, abs=1e-3)


def _cold_families(requests: int, facts: dict[str, int], read: int, busy: float) -> str:
    """The split's families as the server's collector renders them."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Families:
        def collect(self):
            yield CounterMetricFamily("inferscale_cold_requests", "cold", value=requests)
            f = CounterMetricFamily("inferscale_cold_facts", "facts", labels=["source"])
            for source, n in facts.items():
                f.add_metric([source], n)
            yield f
            yield CounterMetricFamily("inferscale_cold_read_bytes", "bytes", value=read)
            yield GaugeMetricFamily("inferscale_storage_bandwidth_bytes_per_second", "B",
                                    value=2.1e9)
            g = GaugeMetricFamily("inferscale_cold_split_estimate", "est", labels=["quantity"])
            g.add_metric(["compute_seconds_per_token"], 18.7e-6)
            g.add_metric(["prefill_busy"], busy)
            yield g

    return _rendered(Families())


def test_each_step_reports_the_split_facts_bytes_and_estimates():
    before = _cold_families(10, {"storage": 0, "prefill": 450}, 0, 0.2)
    after = _cold_families(25, {"storage": 300, "prefill": 900}, 6 << 30, 0.8)
    m = step_metrics(parse(before), parse(after))
    assert m["cold"] == {"requests": 15, "facts": {"storage": 300, "prefill": 450},
                         "read_bytes": 6 << 30,
                         "estimates_at_end": {"compute_seconds_per_token": 18.7e-6,
                                              "prefill_busy": 0.8,
                                              "bandwidth_bytes_per_second": 2.1e9}}


def _lag_family(counts: list[float], total: float) -> str:
    """The server's event-loop lag histogram, as prometheus_client renders it."""
    from prometheus_client.core import HistogramMetricFamily

    class Families:
        def collect(self):
            hist = HistogramMetricFamily("inferscale_event_loop_lag_seconds", "lag")
            bounds = ["0.001", "0.01", "0.1", "1.0", "+Inf"]
            running, buckets = 0.0, []
            for bound, n in zip(bounds, counts):
                running += n
                buckets.append((bound, running))
            hist.add_metric([], buckets, sum_value=total)
            yield hist

    return _rendered(Families())


def test_each_step_reports_the_event_loop_lag():
    from benchmarks.lib.load.scrapes import loop_lag

    before = parse(_lag_family([100, 0, 0, 0, 0], 0.05))
    # this step: 97 samples under 1 ms, 2 in (1, 10 ms], 1 in (100 ms, 1 s]
    after = parse(_lag_family([197, 2, 0, 1, 0], 0.05 + 0.4))
    lag = loop_lag(before, after)
    assert lag["loop_lag_samples"] == 100 and lag["loop_lag_total_ms"] == pytest.approx(400.0)
    assert lag["loop_lag_max_ms"] == 1000.0 and lag["loop_lag_max_within_ms"] == [100.0, 1000.0]
    assert 1.0 < lag["loop_lag_p99_ms"] <= 10.0  # rank 99 of 100: the second (1, 10 ms] one
    assert step_metrics(before, after)["histograms"]["event_loop_lag"]["count"] == 100
    past = loop_lag(before, parse(_lag_family([100, 0, 0, 0, 1], 9.05)))
    assert past["loop_lag_max_ms"] == 1000.0 and past["loop_lag_max_within_ms"] == [1000.0, None]
    assert loop_lag(before, before)["loop_lag_max_ms"] is None  # nothing observed
    assert set(loop_lag({}, {}).values()) == {None}  # a server without the probe
    stalls = ("# TYPE inferscale_event_loop_stalls counter\n"
              "inferscale_event_loop_stalls_total {}\n"
              "# TYPE inferscale_gc_pauses counter\n"
              "inferscale_gc_pauses_total{{generation=\"2\"}} {}\n"
              "inferscale_gc_pauses_total{{generation=\"1\"}} {}\n")
    moved = loop_lag(parse(stalls.format(1, 2, 0)), parse(stalls.format(3, 4, 1)))
    assert (moved["loop_stalls"], moved["gc_pauses"]) == (2, 3)


def _fetch_families(reads: int, phases: dict[str, float]) -> str:
    """The worker's fetch histogram and its phase counter, as the server renders them."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    class Families:
        def collect(self):
            hist = HistogramMetricFamily("inferscale_fetch_seconds", "reads", labels=["rank"])
            hist.add_metric(["0"], [("0.1", reads), ("+Inf", reads)], sum_value=reads * 0.08)
            yield hist
            c = CounterMetricFamily("inferscale_fetch_phase_seconds", "phases",
                                    labels=["rank", "phase"])
            for phase, s in phases.items():
                c.add_metric(["0", phase], s)
            yield c

    return _rendered(Families())


def _lookup_families(lookups: int, phases: dict[str, float]) -> str:
    """The memory cache's storage lookups and first loads' phases, as the server renders
    them."""
    from prometheus_client.core import CounterMetricFamily

    class Families:
        def collect(self):
            yield CounterMetricFamily("inferscale_memory_storage_lookups", "lookups",
                                      value=lookups)
            c = CounterMetricFamily("inferscale_memory_load_seconds", "phases",
                                    labels=["phase"])
            for phase, s in phases.items():
                c.add_metric([phase], s)
            yield c

    return _rendered(Families())


@pytest.mark.parametrize("families, key, before, after, expected", [
    # the step's reads from storage (the fetch histogram's count) by phase, per read
    (_fetch_families, "fetch_phase_ms_per_read",
     (10, {"index": 0.1, "stage": 0.0, "rows": 0.9, "place": 0.05}),
     (14, {"index": 0.14, "stage": 0.002, "rows": 1.3, "place": 0.07}),
     {"index": 10.0, "stage": 0.5, "rows": 100.0, "place": 5.0}),
    # the step's first loads of users' memory (storage lookups) by phase, per lookup
    (_lookup_families, "memory_load_ms_per_lookup",
     (10, {"queued": 0.0, "latest": 0.01, "read": 0.05, "handback": 0.001}),
     (30, {"queued": 0.2, "latest": 0.03, "read": 0.65, "handback": 0.021}),
     {"queued": 10.0, "latest": 1.0, "read": 30.0, "handback": 1.0}),
])
def test_each_step_reports_a_mean_per_event_by_phase(families, key, before, after, expected):
    """The step's events and their phases' seconds: the mean per event of each phase;
    None without events in the step or from a server without the counter."""
    m = step_metrics(parse(families(*before)), parse(families(*after)))
    assert m[key] == {k: pytest.approx(v) for k, v in expected.items()}
    assert step_metrics(parse(families(*after)), parse(families(*after)))[key] is None
    data = Path(__file__).parents[2] / "data"
    plain = parse((data / "load-scrape-cpu-end.prom").read_text())
    assert step_metrics(plain, plain)[key] is None
