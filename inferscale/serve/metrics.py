"""The server's Prometheus metrics: ``GET /metrics`` in the Prometheus text format.

One scrape is three parts, in this order:

- vLLM's own engine metrics (``vllm:*``: requests running and waiting, KV-cache usage,
  prompt tokens by source, TTFT, ...), which ``AsyncLLM``'s stat loggers keep in the
  API process (:func:`inferscale.vllm_plugin.compat.engine_metrics_registry`), with the
  Python process collectors of that registry;
- the server's per-request counters and histograms (:class:`ServingMetrics`), updated
  in the API process when a request finishes, from what came back with it (the
  connector's ``kv_transfer_params``: injected tokens, the fallback and its reason; the
  memory lookup's fallback), or when it is aborted;
- the server's memory cache (:class:`CacheCollector`: users and bytes held, entries
  without memory, storage lookups shed or delayed by the rate limit, failed loads,
  refused versions), read from :meth:`~inferscale.serve.memory_cache.MemoryCache.stats` at
  scrape time;
- the workers' counters and residency (:class:`WorkerCollector`), read from every
  worker through the engine's collective RPC at scrape time
  (:meth:`~inferscale.serve.engine.MemoryEngine.worker_metrics`), labelled by rank.

Names (all ``inferscale_*``; ``_total`` counters, ``_seconds`` histograms)::

    requests_total{mode}                    answered requests; mode kv | prompt | none
    memory_tokens_total{mode}               memory tokens composed into prompts
    injected_memory_tokens_total            memory tokens the connector injected
    text_tail_tokens_total                  facts prefilled as text after injected memory
    completion_tokens_total{mode}           tokens generated
    fallbacks_total{reason}                 kv requests whose memory was prefilled
    memory_fallbacks_total{reason}          requests answered without the user's memory:
                                            shed | load_failed | refused
    requests_aborted_total{mode,reason}     requests aborted before they finished:
                                            client_disconnected | cancelled
    aborted_completion_tokens_total{mode}   tokens those had generated
    retrieval_seconds                       query embedding + exact top-k
    composition_seconds                     prompt composition from stored token ids
    query_to_first_token_seconds{mode}      request start -> first token
    event_loop_lag_seconds                  how late the server's event loop woke a probe
                                            sleeping 10 ms (:mod:`~inferscale.serve.loop_lag`)
    event_loop_stalls_total                 times it did not wake for 100 ms (each logged with
                                            the loop thread's stack, the first 20)
    gc_pauses_total{generation}             garbage collections of 100 ms or more
    memory_users, memory_bytes              users whose facts the server holds, their bytes
    memory_negative_entries                 users remembered without usable memory
    memory_negative_evictions_total         of those, forgotten under max_negative
    memory_storage_lookups_total            loads of users the server held nothing for
    memory_lookups_limited_total            such lookups shed by the rate limit
    memory_lookups_delayed_total            such lookups that waited for their turn
    memory_load_failures_total              loads that failed (tried again after a back-off)
    memory_refused_total{reason}            versions refused at load (embedding_dim, layout)
    memory_load_seconds_total{phase}        first loads' time: queued | latest | read |
                                            handback (memory_cache.LOAD_PHASES)
    resident_users{rank,tier}, resident_bytes{rank,tier}, tier_budget_bytes{rank,tier}
    worker_loaded_tokens_total{rank}        tokens written into the paged cache
    worker_load_failures_total{rank}        loads refused or failed (recomputed)
    worker_scheduler_errors_total{rank}     scheduler-hook errors (request prefilled)
    reloads_total{rank}, reload_failures_total{rank}, reload_seconds{rank}
    reload_yielded_seconds_total{rank}      reloads waiting for requests' reads of facts
    promotions_declined_total{rank}         misses that did not promote their user
    engine_step_seconds{rank}               busy engine steps, timed by the connector
    inject_kernel_seconds{rank}             each step's injection (GPU time on CUDA)
    connector_seconds_total{rank,side}      time in the connector's hooks (scheduler|worker)
    memory_facts_total{rank,tier}           injected facts by source tier (gpu|host|storage)
    storage_read_bytes_total{rank}, fetch_seconds{rank}, fetch_failures_total{rank}
                                            reads of facts from storage for requests
    fetch_phase_seconds_total{rank,phase}   their time by phase: index, stage, rows, place
    prefetches_total{rank,outcome}          reads started ahead of their requests: started,
                                            adopted, dropped, resident (not started)
    cold_requests_total                     kv requests whose user was in neither tier
    cold_facts_total{source}                their facts: storage (loaded) | prefill (computed)
    cold_read_bytes_total                   bytes read from storage for them
    cold_split_fraction                     facts loaded / facts, per such request
    storage_bandwidth_bytes_per_second      the split's storage bandwidth estimate (B)
    cold_split_estimate{quantity}           its other estimates: wait_seconds (W),
                                            compute_seconds_per_token (c), overhead_seconds
                                            (D), queued_bytes (Q), fixed_seconds,
                                            prefill_busy (ρ), read_overhead_seconds (o),
                                            load_excess_seconds (E); reported only: the
                                            step fit's step_base_seconds and
                                            request_cost_seconds (backlog.py)

"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from inferscale.serve.loop_lag import LoopLagProbe
from inferscale.serve.memory_cache import MemoryFallbackReason
from inferscale.types import TIERS
from inferscale.vllm_plugin.failures import FallbackReason

log = logging.getLogger(__name__)
STALL_STACKS = 20  # stalls whose stack is logged; later ones are counted only

if TYPE_CHECKING:
    from inferscale.serve.backend import AnswerInfo
    from inferscale.serve.cold_split import LoadEstimator
    from inferscale.serve.engine import Generation, MemoryEngine
    from inferscale.serve.memory_cache import MemoryCache

MODES = ("kv", "prompt", "none")
# why a request was aborted: its client went (the HTTP layer saw it), or its caller
# cancelled it for another reason or without saying (a gateway, a timeout, a shutdown)
ABORT_REASONS = ("client_disconnected", "cancelled")
_FAST_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_TTFT_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LAG_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class WorkerCollector:
    """Exposes the workers' last counters (set by :meth:`ServingMetrics.render` just
    before each scrape) as Prometheus families, one sample per worker rank."""

    def __init__(self) -> None:
        self.snapshots: list[dict] = []

    def collect(self) -> Iterator[Any]:
        snaps = list(enumerate(self.snapshots))

        def family(kind, name: str, doc: str, value, labels=("rank",)):
            fam = kind(f"inferscale_{name}", doc, labels=list(labels))
            for rank, snap in snaps:
                for extra, v in value(snap):
                    fam.add_metric([str(rank), *extra], v)
            return fam

        def per_tier(key):
            return lambda s: [([t], s["tiers"][t][key]) for t in TIERS]

        yield family(GaugeMetricFamily, "resident_users", "Users resident in a tier",
                     per_tier("users"), ("rank", "tier"))
        yield family(GaugeMetricFamily, "resident_bytes", "Bytes of resident memory KV per tier",
                     per_tier("bytes"), ("rank", "tier"))
        yield family(GaugeMetricFamily, "tier_budget_bytes", "Byte budget of a tier",
                     lambda s: [([t], s["budgets"][t]) for t in TIERS], ("rank", "tier"))
        for name, key, doc in (
                ("worker_loaded_tokens", "loaded_tokens",
                 "Memory tokens written into vLLM's paged cache"),
                ("worker_load_failures", "load_failures",
                 "Memory loads refused or failed in the worker (recomputed by vLLM)"),
                ("worker_scheduler_errors", "scheduler_errors",
                 "Errors in the connector's scheduler hooks (the request was prefilled)")):
            yield family(CounterMetricFamily, name, doc, lambda s, k=key: [([], s[k])])
        yield family(CounterMetricFamily, "reloads", "Background reloads of users from storage",
                     lambda s: [([], s["reload"]["reloads"])])
        yield family(CounterMetricFamily, "reload_failures", "Background reloads that failed",
                     lambda s: [([], s["reload"]["failures"])])
        yield family(CounterMetricFamily, "reload_yielded_seconds", "Time background reloads "
                     "waited for reads of facts for waiting requests",
                     lambda s: [([], s["reload"].get("yielded_s", 0.0))])
        yield family(CounterMetricFamily, "promotions_declined", "Requests of a user in no "
                     "tier that did not promote it: asked for less than the residents",
                     lambda s: [([], s.get("promotions_declined", 0))])
        yield _histogram("reload_seconds", "Latency of successful background reloads (read, "
                         "verify, place)", [(str(r), s["reload"]) for r, s in snaps])
        yield _histogram("engine_step_seconds", "Wall time of busy engine steps (from one "
                         "schedule to the next while requests run), timed by the connector",
                         [(str(r), s["step"]) for r, s in snaps if "step" in s])
        yield _histogram("inject_kernel_seconds", "Time of each step's memory injection (GPU "
                         "time on CUDA)", [(str(r), s["kernel"]) for r, s in snaps if "kernel" in s])
        yield _histogram("fetch_seconds", "Reads of a request's facts from storage (user in "
                         "neither tier), admission to ready",
                         [(str(r), s["fetch"]) for r, s in snaps if "fetch" in s])
        yield family(CounterMetricFamily, "connector_seconds", "Time spent in the connector's "
                     "hooks, by side", lambda s: [([k], v) for k, v in s.get("hook_seconds",
                                                                           {}).items()],
                     ("rank", "side"))
        yield family(CounterMetricFamily, "memory_facts", "Injected facts by the tier they "
                     "were read from", lambda s: [([k], v) for k, v in s.get("facts_by_tier",
                                                                           {}).items()],
                     ("rank", "tier"))
        yield family(CounterMetricFamily, "storage_read_bytes", "Bytes of facts read from "
                     "storage for requests (users in neither tier)",
                     lambda s: [([], s["fetch"]["bytes"])] if "fetch" in s else [])
        yield family(CounterMetricFamily, "fetch_phase_seconds", "Time of the reads of facts "
                     "handed over (fetch_seconds' reads) by phase: index, stage, rows, place",
                     lambda s: [([k], v) for k, v in s.get("fetch", {}).get(
                         "phase_seconds", {}).items()], ("rank", "phase"))
        yield family(CounterMetricFamily, "fetch_failures", "Reads of facts from storage that "
                     "failed or timed out (the request was recomputed)",
                     lambda s: [([], s["fetch"]["failures"])] if "fetch" in s else [])
        yield family(CounterMetricFamily, "prefetches", "Reads of facts started ahead of "
                     "their requests, by outcome", lambda s: [([k], v) for k, v in s.get(
                         "prefetch", {}).items()], ("rank", "outcome"))


def _histogram(name: str, doc: str, per_rank: list[tuple[str, dict]]) -> HistogramMetricFamily:
    """A Prometheus histogram family from ``{"buckets", "counts", "sum"}`` per rank
    (:meth:`inferscale.stats.Histogram.snapshot`)."""
    hist = HistogramMetricFamily(f"inferscale_{name}", doc, labels=["rank"])
    for rank, h in per_rank:
        running, buckets = 0, []
        for bound, count in zip([*h["buckets"], float("inf")], h["counts"]):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        hist.add_metric([rank], buckets, h["sum"])
    return hist


# why a version is refused at load (MemoryRefused.reason, serve/server.py): every one
# shows from the first scrape, at 0
REFUSAL_REASONS = ("embedding_dim", "layout", "instruction")


class CacheCollector:
    """The memory cache's counters (:meth:`MemoryCache.stats`) as Prometheus families."""

    def __init__(self, cache: "MemoryCache") -> None:
        self.cache = cache

    def collect(self) -> Iterator[Any]:
        stats = self.cache.stats()
        for name, key, doc in (
                ("memory_users", "users", "Users whose facts and index the server holds"),
                ("memory_bytes", "bytes", "Bytes of the facts and indexes the server holds"),
                ("memory_negative_entries", "negative_entries",
                 "Users remembered without usable memory (nothing published, refused, failed)")):
            yield GaugeMetricFamily(f"inferscale_{name}", doc, value=stats[key])
        for name, key, doc in (
                ("memory_negative_evictions", "negative_evictions",
                 "Entries without memory forgotten under the entry bound"),
                ("memory_storage_lookups", "storage_lookups",
                 "Loads of users the server held nothing for"),
                ("memory_lookups_limited", "lookups_limited",
                 "Lookups of unauthenticated users the server held nothing for shed by the "
                 "rate limit (answered without memory, fallback shed)"),
                ("memory_lookups_delayed", "lookups_delayed",
                 "Such lookups that waited for their turn under the rate limit"),
                ("memory_load_failures", "load_failures",
                 "Memory loads that failed (answered without memory, tried again)")):
            yield CounterMetricFamily(f"inferscale_{name}", doc, value=stats[key])
        refused = CounterMetricFamily("inferscale_memory_refused",
                                      "Versions refused at load (answered without memory)",
                                      labels=["reason"])
        for reason in sorted({*REFUSAL_REASONS, *stats["refused"]}):
            refused.add_metric([reason], stats["refused"].get(reason, 0))
        yield refused
        load = CounterMetricFamily("inferscale_memory_load_seconds", "First loads of users' "
                                   "memory: seconds queued for a load thread, reading LATEST, "
                                   "reading the version, handing the result back",
                                   labels=["phase"])
        for phase, seconds in stats["load_seconds"].items():
            load.add_metric([phase], seconds)
        yield load


class EstimateCollector:
    """The compute-or-load split's estimates now (:class:`~inferscale.serve.cold_split.
    LoadEstimator`), read at scrape time."""

    def __init__(self, estimator: "LoadEstimator") -> None:
        self.estimator = estimator

    def collect(self) -> Iterator[Any]:
        est = self.estimator.estimates()
        yield GaugeMetricFamily("inferscale_storage_bandwidth_bytes_per_second",
                                "Storage bandwidth estimate of the compute-or-load split",
                                value=est.bandwidth)
        fam = GaugeMetricFamily("inferscale_cold_split_estimate", "The compute-or-load "
                                "split's other estimates", labels=["quantity"])
        for name, v in (("wait_seconds", est.wait_s),
                        ("compute_seconds_per_token", est.compute_s_per_token),
                        ("overhead_seconds", est.overhead_s), ("queued_bytes", est.queued_bytes),
                        ("fixed_seconds", est.fixed_s), ("prefill_busy", est.prefill_busy),
                        ("read_overhead_seconds", est.read_overhead_s),
                        ("load_excess_seconds", est.load_excess_s),
                        ("step_base_seconds", est.step_base_s),
                        ("request_cost_seconds", est.request_cost_s)):
            fam.add_metric([name], v)
        yield fam


class ServingMetrics:
    """The server's metrics: per-request counters it updates (:meth:`observe`) and the
    workers' counters it reads at scrape time (:meth:`render`). Its own registry, so
    every server instance counts from zero."""

    def __init__(self, cache: "MemoryCache | None" = None,
                 estimator: "LoadEstimator | None" = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("inferscale_requests", "Answered chat requests by memory mode",
                                ["mode"], registry=r)
        self.memory_tokens = Counter("inferscale_memory_tokens",
                                     "Memory tokens composed into prompts", ["mode"], registry=r)
        self.injected = Counter("inferscale_injected_memory_tokens",
                                "Memory tokens injected by the connector (not prefilled)",
                                registry=r)
        self.text_tail = Counter("inferscale_text_tail_tokens",
                                 "Tokens of facts prefilled as text after the injected memory",
                                 registry=r)
        self.completion = Counter("inferscale_completion_tokens", "Tokens generated",
                                  ["mode"], registry=r)
        self.fallbacks = Counter("inferscale_fallbacks",
                                 "KV requests whose memory was prefilled instead of injected",
                                 ["reason"], registry=r)
        self.memory_fallbacks = Counter(
            "inferscale_memory_fallbacks", "Requests of a user with (possibly) memory answered "
            "without it: lookup shed under load, load failed, version refused", ["reason"],
            registry=r)
        self.aborted = Counter("inferscale_requests_aborted", "Chat requests aborted before "
                               "they finished (the engine's request aborted), by memory mode "
                               "and reason", ["mode", "reason"], registry=r)
        self.aborted_tokens = Counter("inferscale_aborted_completion_tokens",
                                      "Tokens generated for requests then aborted", ["mode"],
                                      registry=r)
        self.retrieval = Histogram("inferscale_retrieval_seconds",
                                   "Query embedding and exact top-k", buckets=_FAST_S, registry=r)
        self.composition = Histogram("inferscale_composition_seconds",
                                     "Prompt composition from stored token ids",
                                     buckets=_FAST_S, registry=r)
        self.q2ft = Histogram("inferscale_query_to_first_token_seconds",
                              "Request start (before retrieval) to the first token", ["mode"],
                              buckets=_TTFT_S, registry=r)
        self.loop_lag = Histogram("inferscale_event_loop_lag_seconds", "How late the "
                                  "server's event loop woke a probe sleeping 10 ms (every "
                                  "request waits so long on a stalled loop)",
                                  buckets=_LAG_S, registry=r)
        self.loop_stalls = Counter("inferscale_event_loop_stalls", "Times the event loop did "
                                   "not wake for 100 ms or more", registry=r)
        self._stalls = 0  # of them, seen by the watchdog's thread (the first are logged)
        self.gc_pauses = Counter("inferscale_gc_pauses", "Garbage collections of 100 ms or "
                                 "more", ["generation"], registry=r)
        for generation in range(3):  # exported as 0 before any (else absent: "unknown")
            self.gc_pauses.labels(str(generation))
        self.loop_probe = LoopLagProbe(self.loop_lag.observe, on_stall=self._stalled,
                                       on_gc=self._gc_paused)  # started by the server
        self.cold = Counter("inferscale_cold_requests", "KV requests whose user was in "
                            "neither tier (facts split between storage and prefill)",
                            registry=r)
        self.cold_facts = Counter("inferscale_cold_facts", "Facts of such requests: loaded "
                                  "from storage or prefilled", ["source"], registry=r)
        self.cold_bytes = Counter("inferscale_cold_read_bytes", "Bytes read from storage "
                                  "for such requests", registry=r)
        self.cold_fraction = Histogram("inferscale_cold_split_fraction", "Share of a cold "
                                       "request's facts loaded from storage",
                                       buckets=tuple(i / 10 for i in range(11)), registry=r)
        for source in ("storage", "prefill"):
            self.cold_facts.labels(source)
        for mode in MODES:  # every label value shows from the first scrape, at 0
            for metric in (self.requests, self.memory_tokens, self.completion, self.q2ft,
                           self.aborted_tokens):
                metric.labels(mode)
            for reason in ABORT_REASONS:
                self.aborted.labels(mode, reason)
        for reason in FallbackReason:
            self.fallbacks.labels(reason.value)
        for memory_reason in MemoryFallbackReason:
            self.memory_fallbacks.labels(memory_reason.value)
        self.workers = WorkerCollector()
        r.register(self.workers)
        if cache is not None:
            r.register(CacheCollector(cache))
        if estimator is not None:
            r.register(EstimateCollector(estimator))

    def _stalled(self, seconds: float, stack: str) -> None:  # the watchdog, or the loop
        self.loop_stalls.inc()
        self._stalls = n = self._stalls + 1
        if n <= STALL_STACKS:
            log.warning("event loop held for %.0f ms%s (stall %d; the first %d are "
                        "logged), in:\n%s", seconds * 1e3, " so far" if stack else "", n,
                        STALL_STACKS, stack or "(not sampled: the watchdog did not see it)")

    def _gc_paused(self, seconds: float, generation: int) -> None:
        self.gc_pauses.labels(str(generation)).inc()
        log.warning("a garbage collection (generation %d) held the process %.0f ms",
                    generation, seconds * 1e3)

    def observe(self, info: "AnswerInfo", gen: "Generation") -> None:
        """Count one finished request: ``info`` as the server composed and answered it
        (mode, memory and tail tokens, the fallback, timings in ms) and the engine's
        :class:`Generation` (with the connector's reply)."""
        mode, timings, reply = info.mode or "none", info.timings_ms, gen.reply
        self.requests.labels(mode).inc()
        self.memory_tokens.labels(mode).inc(info.memory_tokens or 0)
        self.completion.labels(mode).inc(len(gen.token_ids))
        self.injected.inc(reply.injected_tokens)
        self.text_tail.inc(info.text_tail_tokens or 0)
        if mode == "kv" and reply.fallback is not None:
            self.fallbacks.labels(reply.fallback.reason.value).inc()
        elif info.fallback is not None and isinstance(info.fallback.reason,
                                                      MemoryFallbackReason):
            self.memory_fallbacks.labels(info.fallback.reason.value).inc()
        cold = reply.cold
        if cold is not None:
            self.cold.inc()
            self.cold_facts.labels("storage").inc(cold.loaded)
            self.cold_facts.labels("prefill").inc(cold.computed)
            self.cold_bytes.inc(reply.storage_bytes)
            facts = cold.loaded + cold.computed
            if facts:
                self.cold_fraction.observe(cold.loaded / facts)
        if mode != "none":
            self.retrieval.observe(((timings.embed or 0.0) + (timings.retrieve or 0.0)) / 1e3)
            self.composition.observe((timings.compose or 0.0) / 1e3)
        if timings.query_to_first_token is not None:
            self.q2ft.labels(mode).observe(timings.query_to_first_token / 1e3)

    def count_abort(self, mode: str, reason: str, tokens: int) -> None:
        """Count one request aborted before it finished, with the tokens it had made."""
        self.aborted.labels(mode, reason).inc()
        self.aborted_tokens.labels(mode).inc(tokens)

    async def render(self, engine: "MemoryEngine") -> bytes:
        """One scrape: vLLM's engine metrics, then the server's, with the workers'
        counters read now."""
        from inferscale.vllm_plugin.compat import engine_metrics_registry

        self.workers.snapshots = await engine.worker_metrics()
        return generate_latest(engine_metrics_registry()) + generate_latest(self.registry)
