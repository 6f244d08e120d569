"""The connector's worker half (worker process): memory KV into the paged cache.

:class:`ConnectorWorker` owns the worker's resident store
(:class:`~inferscale.hydrate.store.ResidentStore`), its loader and its reads of
non-resident users' facts (:class:`~inferscale.vllm_plugin.storage_reads.StorageReads`).
Each step, :meth:`~ConnectorWorker.start_load_kv` starts the reloads and reads the
scheduler ordered, checks every load against the worker's own store (never trusting the
scheduler's view), and writes the rotated K and V of the step's loads and of the reads
that completed into every layer's paged blocks (:mod:`inferscale.vllm_plugin.inject`),
holding the store's read lock only while the writes are enqueued. A load that cannot be
served is reported through :meth:`~ConnectorWorker.get_block_ids_with_load_errors` and
vLLM recomputes those blocks (``kv_load_failure_policy="recompute"``): never wrong KV, and
nothing escapes into vLLM's step; a completed read is reported through
:meth:`~ConnectorWorker.get_finished`. Failures are logged once, counted and reported to
the scheduler (the answer then says ``fallback: memory load failed``). It also keeps the
histograms of busy steps (timed by the scheduler half) and injections /metrics reads.

Under tensor parallelism there is one :class:`ConnectorWorker` per rank: its store keeps
only the rank's KV heads of every slab (:class:`~inferscale.hydrate.resident.HeadShard`),
its loads write them into the rank's paged cache and its reports name its rank.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from inferscale.artifacts.direct_io import read_counts
from inferscale.hydrate.fact_reader import FactReader
from inferscale.hydrate.loader import ResidentLoader
from inferscale.hydrate.resident import HeadShard, Resident
from inferscale.hydrate.slab import READS
from inferscale.hydrate.store import ResidentStore
from inferscale.stats import Histogram
from inferscale.types import PREFIX_ID, TIERS
from inferscale.vllm_plugin.compat import (
    attention_layers, find_rotary, kv_head_shard, layer_head_size, layer_kv_heads,
    model_geometry, tensor_parallel_rank,
)
from inferscale.vllm_plugin.config import ConnectorConfig
from inferscale.vllm_plugin.failures import Failures
from inferscale.vllm_plugin.storage_reads import Fetched, StorageReads
from inferscale.vllm_plugin.inject import Job, Staging, StepLoad, verify_step
from inferscale.vllm_plugin.kernels.writer import FusedWriter
from inferscale.vllm_plugin.metadata import (
    FailedLoad, FailedReload, InferScaleMetadata, LoadSources, LoadSpec, ResidencyReport,
    ResidentAdded, ResidentInfo, ResidentRemoved,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

# Under vLLM's logger namespace, so its handlers print these in every engine process.
log = logging.getLogger("vllm.inferscale.connector")
PREFILL = ("prefill_busy", "prefill_tokens_per_s", "prefill_token_s", "prefill_base_share",
           "prefill_step_base_s", "prefill_request_s")  # backlog.py's, for the split


def worker_device(vllm_config: "VllmConfig") -> torch.device:
    """The device this worker computes on (its CUDA device, or the CPU)."""
    device = getattr(vllm_config.device_config, "device", None)
    if device is not None and torch.device(device).type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ConnectorWorker:
    """The worker half: resident store, loads into the paged cache, residency reports."""

    def __init__(self, config: ConnectorConfig, vllm_config: "VllmConfig"):
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        # the engine's model dtype: slabs are converted to it once, when hydrated
        self.model_dtype = vllm_config.model_config.dtype
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.tp_rank = tensor_parallel_rank() if tp_size > 1 else 0
        # the model's KV geometry: every slab is checked against it once, when it arrives
        self.geometry = model_geometry(vllm_config)
        total = self.geometry.kv_heads
        start, count = kv_head_shard(total, tp_size, self.tp_rank)
        # this rank's KV heads; None (all of them) without tensor parallelism
        self.heads = HeadShard(start, count, total) if tp_size > 1 else None
        # what this rank's slabs hold once placed: [T, 2, L, heads, D]
        self.kept = (self.geometry.layers, count, self.geometry.head_dim)
        self.store = ResidentStore(worker_device(vllm_config), config.gpu_budget_bytes,
                                   config.host_budget_bytes, self.model_dtype, self.heads,
                                   config.staging_bytes, config.device_staging_bytes,
                                   self.geometry)
        self.loader = ResidentLoader(  # its reloads wait while requests' facts are read
            self.store, config.model_fingerprint, config.artifact_root, config.storage_options,
            config.reload_workers, config.reload_bytes_per_s, direct_io=config.direct_io,
            yield_to=lambda: self.fetches.busy, reload_part_bytes=config.reload_part_bytes)
        reader = None if not config.artifact_root else FactReader(
            config.store(), config.model_fingerprint, config.fetch_workers, config.index_cache,
            geometry=self.geometry)
        self.fetches = StorageReads(self.store, reader, config.model_fingerprint,
                                    config.fetch_timeout_s, keep_s=config.prefetch_keep_s)
        self._received: set[str] = set()  # reads reported finished this step
        # for /metrics: busy engine steps (timed by the scheduler), injection (GPU time)
        self.step_time = Histogram()
        self.step_s: float | None = None  # moving average of the busy steps
        self.prefill, self.prefill_at = dict.fromkeys(PREFILL, 0.0), time.monotonic()
        self.kernel_time = Histogram()
        self._kernel_events: list[tuple[Any, Any]] = []
        self.hook_seconds = {"scheduler": 0.0, "worker": 0.0}
        self.promotions_declined = 0  # the scheduler's, for /metrics (promotion.py)
        self.facts_by_tier = dict.fromkeys(("gpu", "host", "storage"), 0)
        self._sources: list[LoadSources] = []
        self.rotary: torch.nn.Module | None = None
        self._invalid_blocks, self._failed_loads = set[int](), list[FailedLoad]()
        self.failures = Failures()
        self.scheduler_errors = 0  # the scheduler half's count, as its last metadata said
        self.loaded_tokens, self.inject_seconds, self.inject_calls = 0, 0.0, 0
        self._step: StepLoad | None = None
        self._staging = Staging()
        self._fused: FusedWriter | None = None
        self._layers: list[tuple[int, Any]] | None = None
        self.verify_next = False  # keep the next step's load for verify_last_load()
        self.last_step: StepLoad | None = None

    # ------------------------------------------------------------------ the model

    def attach_model(self, model: torch.nn.Module, layers: dict[str, Any] | None = None) -> None:
        """Called once by the worker extension after the KV cache exists: take the model's
        own rotary module and, given the engine's attention ``layers`` (its static
        forward context), build and check the fused injection kernel."""
        if self.rotary is None:
            self.rotary = find_rotary(model)
        self.store.allocate()  # the tiers' memory, once, now that vLLM has its KV cache
        if layers is not None and self._fused is None:
            self._layers = self._checked(attention_layers(layers))
            self._build_fused()

    def _checked(self, layers: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """``layers``, once their caches are seen to hold what this rank's slabs will:
        as many KV heads (a different sharding than :func:`kv_head_shard`'s raises), the
        model's head dim, and a layer index inside the model's layers."""
        L, heads, dim = self.kept
        for idx, layer in layers:
            have = (layer_kv_heads(layer), layer_head_size(layer))
            if have != (heads, dim) or not 0 <= idx < L:
                raise RuntimeError(
                    f"tensor-parallel rank {self.tp_rank}: layer {idx}'s cache holds "
                    f"{have[0]} KV heads of dim {have[1]}, but this rank's slabs hold "
                    f"{heads} of dim {dim} (the model's {self.geometry.describe()})")
        return layers

    def _build_fused(self) -> None:
        if not self._layers or self.rotary is None:
            return
        self._fused = FusedWriter.build(self._layers, self.rotary, self.model_dtype,
                                        place=lambda slab: self.store.place(
                                            slab, "gpu", all_heads=False))

    @property
    def inject_path(self) -> str:
        """``numba`` / ``triton`` (fused kernel) or ``generic: why``."""
        if self._fused is None:
            return "generic: not built yet"
        return self._fused.kind if self._fused.ok else f"generic: {self._fused.reason}"

    # ------------------------------------------------------------------ admin

    def load(self, user: str, version: str = "latest", tier: str = "gpu") -> Resident:
        """Admin hydration of ``user``'s ``version`` into ``tier``."""
        return self.loader.load(user, version, tier)

    def evict(self, user: str) -> bool:
        """Admin eviction: drop the user and do not reload it until hydrated again."""
        return self.loader.evict(user)

    def prefetch(self, user: str, version: str, chunks: list[str], deadline_s: float,
                 nbytes: int = 0) -> dict:
        """Start reading ``chunks`` for a request the scheduler will see next, unless this
        worker holds that version of the user (its own store decides) or has no store to
        read from; then :meth:`storage_stats` with ``resident`` and ``started``."""
        held = self.store.held(user)
        resident, started = held is not None and held.version == version, False
        if resident:
            self.fetches.prefetches["resident"] += 1
        elif started := self.fetches.reader is not None:
            self.fetches.prefetch(user, version, chunks, deadline_s, nbytes)
        return {**self.storage_stats(), "resident": resident, "started": started}

    def storage_stats(self) -> dict:
        """For the compute-or-load split (the keys: :meth:`LoadEstimator.storage`)."""
        return {**self.fetches.stats(), "step_s": self.step_s, **self.prefill,
                "prefill_busy_age_s": time.monotonic() - self.prefill_at, "tp_rank": self.tp_rank}

    def status(self) -> dict:
        store, heads = self.store, self.heads
        return {"tp_rank": self.tp_rank,
                "kv_heads": [heads.start, heads.count] if heads is not None else None,
                "residents": store.residents(), "loaded_tokens": self.loaded_tokens,
                "reloads": self.loader.reloads, "reload_failures": self.loader.reload_failures,
                "kv_reads": dict(READS),  # kv.arrow reads started (hydrations, reloads)
                # this process's local reads by reader: O_DIRECT, its fallback, buffered
                # (counted only where the store reads with direct I/O)
                "storage_reads": read_counts(),
                "load_failures": self.failures.count,  # loads recomputed instead (logged)
                "scheduler_errors": self.scheduler_errors,  # scheduler-hook errors (logged)
                "inject_calls": self.inject_calls, "inject_path": self.inject_path,
                "inject_ms_mean": self.inject_seconds * 1e3 / max(1, self.inject_calls),
                "fetches": self.fetches.status(),
                "budgets": store.budget, "used": {t: store.used(t) for t in TIERS}}

    def verify_last_load(self, hf_config: Any) -> dict:
        """Check the paged cache at the last kept load's slots (see
        :func:`inferscale.vllm_plugin.inject.verify_step`)."""
        if self.last_step is None:
            return {"checked": False, "reason": "no load kept"}
        return verify_step(self.last_step, hf_config, self.block_size)

    # ------------------------------------------------------------------ each step

    def start_load_kv(self, meta: InferScaleMetadata, forward_context: "ForwardContext") -> None:
        """Start the step's background reloads and reads from storage, and inject the
        step's loads and the reads that completed. Never raises: a load that fails for
        any reason is reported through :meth:`get_block_ids_with_load_errors`."""
        t0 = time.perf_counter()
        assert isinstance(meta, InferScaleMetadata)
        self.scheduler_errors = meta.scheduler_errors
        self.hook_seconds["scheduler"] += meta.scheduler_seconds
        self.promotions_declined += meta.promotions_declined
        self.prefill = {k: getattr(meta, k) for k in PREFILL}
        self.prefill_at = time.monotonic()
        for seconds in meta.step_seconds:
            self.step_time.observe(seconds)
            self.step_s = seconds if self.step_s is None else 0.9 * self.step_s + 0.1 * seconds
        self.collect_kernel_times()
        self._invalid_blocks.update(meta.failed_blocks)
        for order in meta.reloads:
            try:
                self.loader.reload_in_background(order.user, order.version, order.tier)
            except Exception as exc:  # noqa: BLE001 - reported to the scheduler
                cause = self.failures.record(f"starting the reload of user {order.user}", exc,
                                             "a later request orders it again")
                self.loader.record_failure(order.user, order.version, cause)
        for spec in meta.fetches:
            self.fetches.submit(spec)
        fetched = []
        for got in self.fetches.done():
            self._received.add(got.spec.req_id)
            if got.resident is not None:
                fetched.append(got)
            elif got.error != "cancelled":
                self._load_failed(got.spec, f"reading its facts from storage failed "
                                            f"({got.error})")
        if meta.loads or fetched:
            t1 = time.perf_counter()
            self._step = self._begin(meta.loads, fetched, forward_context)
            self.inject_seconds += time.perf_counter() - t1
            self.inject_calls += 1
        self.hook_seconds["worker"] += time.perf_counter() - t0

    def _begin(self, loads: list[LoadSpec], fetched: list[Fetched],
               forward_context: "ForwardContext") -> StepLoad | None:
        """Verify the step's loads against the store, then start them with the completed
        reads (see inject.py). Every load that is refused or raises is reported as failed
        (:meth:`_load_failed`); the reads' staging memory is given back afterwards."""
        try:
            layers = self._attention_layers(forward_context)
        except Exception as exc:  # noqa: BLE001 - every load of the step is recomputed
            for spec in loads:
                self._load_failed(spec, exc)
            for got in fetched:
                self._load_failed(got.spec, exc)
                self.store.release(got.resident.region)
            return None
        with self.store.reading():  # nothing read here is swapped or freed meanwhile
            jobs, specs, at = [], [], 0
            candidates = [(spec, None) for spec in loads] + [(g.spec, g) for g in fetched]
            for spec, got in candidates:
                try:
                    resident = got.resident if got else self.store.get(spec.user, spec.version)
                    problem = self._check(spec, resident)
                except Exception as exc:  # noqa: BLE001
                    self._load_failed(spec, exc)
                    continue
                if problem:
                    self._load_failed(spec, problem)
                    continue
                jobs.append(Job(resident, spec.chunks, spec.start, spec.end, at))
                specs.append(spec)
                at += spec.end - spec.start
            step = self._run_all(jobs, specs, layers) if jobs else None
            self.store.mark_used([j.resident for j in jobs if j.resident.tier != "storage"])
            fence = self.store.fence()
        for got in fetched:  # read by the kernels just enqueued: reusable after the fence
            self.store.release(got.resident.region, fence)
        done = {s.req_id for s in specs} - {f.req_id for f in self._failed_loads}
        if self.tp_rank == 0:
            nbytes = {g.spec.req_id: g.nbytes for g in fetched}
            for job, spec in zip(jobs, specs):
                if spec.req_id in done:
                    tier, facts = job.resident.tier, sum(c != PREFIX_ID for c in spec.chunks)
                    self.facts_by_tier[tier] += facts
                    self._sources.append(LoadSources(spec.req_id, {tier: facts},
                                                     nbytes.get(spec.req_id, 0)))
        return step

    def _run_all(self, jobs: list[Job], specs: list[LoadSpec],
                 layers: list[tuple[int, Any]]) -> StepLoad | None:
        try:
            return self._run(jobs, specs, layers)
        except Exception as exc:  # noqa: BLE001
            if len(jobs) == 1:
                self._load_failed(specs[0], exc)
                return None
        # the step's joint load failed: load each request alone, so that only the
        # requests whose own load fails are recomputed
        step = None
        for job, spec in zip(jobs, specs):
            job.at = 0
            try:
                step = self._run([job], [spec], layers)
            except Exception as exc:  # noqa: BLE001
                self._load_failed(spec, exc)
        return step

    def _attention_layers(self, forward_context: "ForwardContext") -> list[tuple[int, Any]]:
        if self._layers is None:  # the attention layers never change: find them once
            self._layers = self._checked(attention_layers(forward_context.no_compile_layers))
        if self._fused is None:
            self._build_fused()
        if not self._layers:
            raise RuntimeError("the engine has no attention layer with a paged KV cache")
        return self._layers

    def _run(self, jobs: list[Job], specs: list[LoadSpec],
             layers: list[tuple[int, Any]]) -> StepLoad:
        cuda = self.store.cuda
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        t0 = time.perf_counter()
        step = StepLoad.run(self.store, jobs, layers, self.model_dtype, self.rotary,
                            [s.slot_mapping for s in specs], self._staging, self._fused)
        if cuda:  # GPU time, read once it is known (never waited for)
            end.record()
            self._kernel_events.append((begin, end))
        else:
            self.kernel_time.observe(time.perf_counter() - t0)
        self.loaded_tokens += sum(j.width for j in jobs)
        if self.verify_next:
            self.last_step, self.verify_next = step, False
        return step

    def collect_kernel_times(self) -> None:
        """Injection GPU times of steps whose events completed (each step; also at a scrape)."""
        while self._kernel_events and self._kernel_events[0][1].query():
            begin, end = self._kernel_events.pop(0)
            self.kernel_time.observe(begin.elapsed_time(end) / 1e3)

    def _load_failed(self, spec: LoadSpec, why: str | BaseException) -> None:
        """Report ``spec``'s blocks as load errors (vLLM recomputes them), count and log
        it once, and tell the scheduler (the request's answer names the cause)."""
        what = f"request {spec.req_id} (user {spec.user}): memory load"
        if isinstance(why, BaseException):
            why = self.failures.record(what, why, "recomputing its blocks")
        else:
            self.failures.count += 1
            log.warning("%s refused (%s); recomputing its blocks", what, why)
        self._invalid_blocks.update(spec.block_ids)
        self._failed_loads.append(FailedLoad(spec.req_id, why))

    def _check(self, spec: LoadSpec, resident: Resident | None) -> str | None:
        """Why ``spec`` cannot be loaded from ``resident`` (None: it can): once per load,
        its slab must hold this rank's geometry (the store placed only such slabs) and its
        slots must lie in the blocks vLLM gave the request."""
        if resident is None:
            return f"user {spec.user} version {spec.version[:12]} is not resident"
        if self.rotary is None:
            return "no rotary module attached"
        if tuple(resident.slab.shape[2:]) != self.kept:
            return (f"slab geometry {list(resident.slab.shape[2:])} is not this rank's "
                    f"cache's {list(self.kept)}")
        if any(c not in resident.index for c in spec.chunks):
            return "unknown chunk"
        total = sum(resident.index[c][1] for c in spec.chunks)
        if spec.end > total or len(spec.slot_mapping) != spec.end - spec.start:
            return "load range outside the memory"
        if len(spec.slot_mapping) and not np.isin(
                np.asarray(spec.slot_mapping) // self.block_size, spec.block_ids).all():
            return "slots outside the request's blocks"
        return None

    def wait_for_save(self) -> None:
        """End of the step: release its staging buffer (the stream orders its reuse)."""
        self._step = None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, set[str] | None]:
        """Reads from storage reported done this step (written, failed or dropped): vLLM
        then schedules (or frees) their requests. Requests that finished meanwhile have
        their reads dropped when those complete."""
        self.fetches.cancel(finished_req_ids)
        done, self._received = self._received, set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._invalid_blocks = self._invalid_blocks, set()
        return bad

    def build_connector_worker_meta(self) -> ResidencyReport | None:
        events = self.store.take_events()
        failed = self.loader.take_failures()
        loads, self._failed_loads = self._failed_loads, []
        sources, self._sources = self._sources, []
        if not events and not failed and not loads and not sources:
            return None
        rank = self.tp_rank  # only rank 0 sends token ids (every rank reads the same)
        changes = [ResidentAdded(rank, ResidentInfo.of(e.resident, with_tokens=rank == 0), e.full)
                   if e.op == "add" else ResidentRemoved(rank, e.user, e.version, e.for_room)
                   for e in events]
        return ResidencyReport(changes, [FailedReload(*f) for f in failed], loads, sources)
