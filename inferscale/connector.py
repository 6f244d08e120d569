"""InferScale's vLLM KV connector: inject a user's memory KV, prefill only the query.

Loaded by vLLM through ``kv_connector_module_path="inferscale.connector"`` and
``kv_connector="InferScaleConnector"`` (see ``inferscale.engine.kv_transfer_config``);
settings come only from ``kv_connector_extra_config`` (:class:`ConnectorConfig`).

Scheduler side (engine-core process)
    A request names its memory in ``kv_transfer_params["inferscale"]``: ``user``,
    ``version`` and the ordered ``chunks`` (``"prefix"`` then fact ids). The scheduler
    keeps a *residency view* — which (user, version) the workers hold, under which model
    fingerprint, and each chunk's token ids — built only from what the workers report
    (:class:`ResidencyReport`). :meth:`get_num_new_matched_tokens` reports the memory
    tokens as externally available only when the user's version is resident, the
    fingerprint is the engine's, every chunk is known and the prompt begins with exactly
    the chunks' token ids; otherwise 0 and the request simply prefills (the reason is
    logged). A miss on a user the workers do not hold, or on a version that
    ``supersedes`` the one they hold (the server moved the user to a new LATEST), asks
    them to reload it in the background (unless an admin evicted it); after a failed
    reload the same (user, version) is not ordered again before a back-off
    (``reload_backoff_s``, doubling per failure up to ``reload_backoff_max_s``).
    ``build_connector_meta`` turns each admitted request into a :class:`LoadSpec` with
    its slot mapping. An exception in any scheduler hook degrades to "0 external tokens"
    (the request prefills; a request already admitted has its blocks reported as load
    errors), is logged and counted.

Worker side (worker process)
    :meth:`start_load_kv` checks every load against the worker's own
    :class:`~inferscale.resident.ResidentStore` (never trusting the scheduler's view),
    gathers the needed tokens of all requests of the step into one staging buffer (gpu
    tier: ``index_select``; host tier: pinned host->device copies of just those rows),
    rotates all keys of all layers in one call of the model's own rotary op at their
    virtual positions, and writes each layer with the attention backend's own cache
    writer through the slot mapping. A load that cannot be served — not resident here, or
    any exception while loading — is reported through ``get_block_ids_with_load_errors``
    and vLLM recomputes those blocks (``kv_load_failure_policy="recompute"``): never
    wrong KV, and nothing escapes into vLLM's step. The failure is logged once with its
    cause, counted (``load_failures`` in the worker's status) and reported to the
    scheduler, whose answer for that request then says ``fallback: memory load failed``.
    Background reloads run on a pool of ``reload_workers`` threads, one per (user,
    version) at a time, and check the slab's size from the manifest against the budgets
    before reading it.

Version differences live in ``inferscale.vllm_compat``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from inferscale.inject import Job, Staging, StepLoad
from inferscale.inject_kernels import FusedWriter
from inferscale.resident import Resident, ResidentStore
from inferscale.vllm_compat import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorWorkerMetadata,
    attention_layers, block_ids_of,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# Under vLLM's logger namespace, so its handlers print these in every engine process.
log = logging.getLogger("vllm.inferscale.connector")
PARAMS_KEY = "inferscale"


# ---------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings, from ``kv_connector_extra_config``."""

    model_fingerprint: str
    artifact_root: str = ""
    storage_options: dict = field(default_factory=dict)
    gpu_budget_bytes: int = 8 << 30
    host_budget_bytes: int = 32 << 30
    reload_tier: str = "host"  # where background reloads of a user not resident land
    auto_reload: bool = True
    reload_workers: int = 2  # background reloads running at once (a pool, not a thread each)
    reload_backoff_s: float = 30.0  # first wait after a failed reload; doubles per failure
    reload_backoff_max_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("kv_connector_extra_config needs 'model_fingerprint'")
        if self.reload_tier not in ("gpu", "host"):
            raise ValueError(f"reload_tier must be 'gpu' or 'host', got {self.reload_tier!r}")
        if self.gpu_budget_bytes < 0 or self.host_budget_bytes < 0:
            raise ValueError("byte budgets must be >= 0")
        if self.reload_workers < 1:
            raise ValueError(f"reload_workers must be >= 1, got {self.reload_workers}")
        if not 0 <= self.reload_backoff_s <= self.reload_backoff_max_s:
            raise ValueError("need 0 <= reload_backoff_s <= reload_backoff_max_s")

    def backoff_s(self, failures: int) -> float:
        """Seconds to wait before reloading again after ``failures`` failures in a row."""
        return min(self.reload_backoff_max_s, self.reload_backoff_s * 2 ** max(0, failures - 1))

    @classmethod
    def from_extra_config(cls, extra: dict) -> "ConnectorConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys: {sorted(unknown)}")
        return cls(**extra)


# ---------------------------------------------------------------------------- metadata


@dataclass
class LoadSpec:
    """One request's memory load for this step: tokens ``[start, end)`` of its memory."""

    req_id: str
    user: str
    version: str
    chunks: list[str]
    start: int
    end: int
    slot_mapping: np.ndarray  # [end - start] paged-cache slot of each token
    block_ids: list[int]  # blocks covering [start, end), reported if the load fails


@dataclass
class ReloadOrder:
    """Ask workers to hydrate a user's version in the background (``tier`` None: the tier
    the user's current version is on, else ``reload_tier``)."""

    user: str
    version: str
    tier: str | None


@dataclass
class InferScaleMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    loads: list[LoadSpec] = field(default_factory=list)
    reloads: list[ReloadOrder] = field(default_factory=list)
    failed_blocks: list[int] = field(default_factory=list)  # admitted, then failed: recompute
    scheduler_errors: int = 0  # the scheduler side's failure count (shown in status)


@dataclass
class ResidentInfo:
    """What the scheduler needs to know about one resident (user, version)."""

    user: str
    version: str
    fingerprint: str
    token_ids: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, r: Resident) -> "ResidentInfo":
        return cls(r.user, r.version, r.fingerprint, r.token_ids)


@dataclass
class ResidencyReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler: residency changes since the last report, oldest first, and
    the reloads and loads that failed.

    ``changes`` holds ``("add", ResidentInfo)`` and ``("remove", (user, version))``.
    """

    changes: list[tuple[str, Any]] = field(default_factory=list)
    failed_reloads: list[tuple[str, str, str]] = field(default_factory=list)  # + reason
    failed_loads: list[tuple[str, str]] = field(default_factory=list)  # (request id, reason)

    def aggregate(self, other: "ResidencyReport") -> "ResidencyReport":
        # Tensor parallelism is refused at start-up, so there is one worker; merging
        # keeps every change in order.
        return ResidencyReport(self.changes + other.changes,
                               self.failed_reloads + other.failed_reloads,
                               self.failed_loads + other.failed_loads)


class Failures:
    """Counts the connector's failures and logs each once: one line with its cause, and
    the traceback the first time that cause is seen. One per connector side."""

    def __init__(self) -> None:
        self.count = 0
        self._seen: set[str] = set()

    def record(self, what: str, exc: BaseException, then: str) -> str:
        """Count and log ``exc`` (raised while doing ``what``; ``then``: what happens
        instead); returns its cause as one line."""
        self.count += 1
        cause = f"{type(exc).__name__}: {exc}"
        first = cause not in self._seen
        if first and len(self._seen) < 1000:
            self._seen.add(cause)
        log.error("%s failed (%s); %s", what, cause, then, exc_info=exc if first else None)
        return cause


@dataclass
class _Plan:
    user: str
    version: str
    chunks: list[str]
    start: int
    end: int


# ---------------------------------------------------------------------------- connector


class InferScaleConnector(KVConnectorBase_V1):
    """Memory KV injection for vLLM (scheduler and worker sides; see module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_extra_config(
            dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        if vllm_config.parallel_config.tensor_parallel_size != 1 or \
                vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise NotImplementedError("InferScaleConnector supports one worker (TP=PP=1)")
        self.block_size = vllm_config.cache_config.block_size
        if role == KVConnectorRole.SCHEDULER:
            self._view: dict[tuple[str, str], ResidentInfo] = {}
            self._held: dict[str, str] = {}  # user -> version the workers hold
            self._plans: dict[str, _Plan] = {}
            self._to_load: dict[str, _Plan] = {}
            self._reloads: dict[tuple[str, str], ReloadOrder] = {}
            self._reload_pending: set[tuple[str, str]] = set()
            self._reload_failed: dict[tuple[str, str], tuple[int, float]] = {}  # n, retry at
            self.injected_tokens: dict[str, int] = {}
            self._fallbacks: dict[str, str] = {}  # request id -> why memory was prefilled
            self._unloadable: set[str] = set()  # admitted, but no load could be planned
            self._disabled: str | None = None  # set: no memory is admitted any more
            self.failures = Failures()
        else:
            # the engine's model dtype: slabs are converted to it once, when hydrated
            self.model_dtype = vllm_config.model_config.dtype
            self.store = ResidentStore(self._worker_device(vllm_config),
                                       self.config.gpu_budget_bytes,
                                       self.config.host_budget_bytes, self.model_dtype)
            self.rotary: torch.nn.Module | None = None
            self.admin_evicted: set[str] = set()
            self._invalid_blocks: set[int] = set()
            self._failed_reloads: list[tuple[str, str, str]] = []
            self._failed_loads: list[tuple[str, str]] = []
            self.failures = Failures()
            self.scheduler_errors = 0
            self._reload_lock = threading.Lock()
            self._reload_pool = ThreadPoolExecutor(self.config.reload_workers,
                                                   thread_name_prefix="inferscale-reload")
            self._reloading: set[tuple[str, str]] = set()
            self.reload_failures = 0
            self.loaded_tokens = 0
            self.inject_seconds = 0.0
            self._step: StepLoad | None = None
            self._staging = Staging()
            self._fused: FusedWriter | None = None
            self._layers: list[tuple[int, Any]] | None = None
            self.verify_next = False  # keep the next step's load for verify_last_load()
            self.last_step: StepLoad | None = None
            self.reloads = 0
            self.inject_calls = 0

    @staticmethod
    def _worker_device(vllm_config: "VllmConfig") -> torch.device:
        device = getattr(vllm_config.device_config, "device", None)
        if device is not None and torch.device(device).type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ======================================================================= scheduler

    def _params(self, request: "Request") -> dict | None:
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if not isinstance(params, dict):
            return None
        return params

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Memory tokens beyond ``num_computed_tokens`` that the workers can inject (0 on
        any error: the request prefills)."""
        try:
            return self._matched(request, num_computed_tokens)
        except Exception as exc:  # noqa: BLE001 - never into vLLM's step
            self._failed("get_num_new_matched_tokens", request.request_id, exc)
            return 0, False

    def _matched(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = self._params(request)
        if params is None:
            return 0, False
        user, version = str(params.get("user")), str(params.get("version"))
        chunks = [str(c) for c in params.get("chunks") or []]
        why = self._refusal(user, version, chunks, request, bool(params.get("supersedes")))
        if why is not None:
            if self._fallbacks.get(request.request_id) != why:
                log.warning("request %s (user %s, version %s): prefilling memory, %s",
                            request.request_id, user, version[:12], why)
            self._fallbacks[request.request_id] = why
            self._plans.pop(request.request_id, None)
            return 0, False
        self._fallbacks.pop(request.request_id, None)
        info = self._view[(user, version)]
        memory = sum(len(info.token_ids[c]) for c in chunks)
        end = min(memory, len(request.prompt_token_ids) - 1)  # at least one token computed
        if end <= num_computed_tokens:
            self._plans.pop(request.request_id, None)
            return 0, False
        self._plans[request.request_id] = _Plan(user, version, chunks, num_computed_tokens, end)
        return end - num_computed_tokens, False

    def _failed(self, hook: str, req_id: str, exc: BaseException) -> None:
        """A scheduler hook raised for ``req_id``: count, log, and prefill its memory."""
        self._plans.pop(req_id, None)
        fallback = f"connector error in {hook}: {type(exc).__name__}: {exc}"
        if self._fallbacks.get(req_id) != fallback:  # once per request, not per retry
            self.failures.record(f"request {req_id}: {hook}", exc, "prefilling its memory")
            self._fallbacks[req_id] = fallback

    def _refusal(self, user: str, version: str, chunks: list[str], request: "Request",
                 supersedes: bool = False) -> str | None:
        """Why this request's memory cannot be injected, or None when it can. A miss
        orders a background reload when the workers hold nothing of the user, or hold
        another version and the request's version ``supersedes`` it (the server moved
        the user to a new LATEST)."""
        if self._disabled:
            return self._disabled
        info = self._view.get((user, version))
        if info is None:
            held = self._held.get(user)
            if held is None:
                self._order_reload(user, version, self.config.reload_tier)
                return "user not resident"
            if supersedes:
                self._order_reload(user, version, None)  # into the old version's tier
            return f"stale version (workers hold {held[:12]})"
        if info.fingerprint != self.config.model_fingerprint:
            return "artifact model fingerprint differs from the engine's"
        if not chunks:
            return "no chunks named"
        ids: list[int] = []
        for c in chunks:
            if c not in info.token_ids:
                return f"unknown chunk {c!r}"
            ids.extend(info.token_ids[c])
        prompt = request.prompt_token_ids or []
        if len(prompt) <= len(ids) or list(prompt[:len(ids)]) != ids:
            return "prompt does not begin with the memory's token ids"
        return None

    def _order_reload(self, user: str, version: str, tier: str | None) -> None:
        key = (user, version)
        if not (self.config.auto_reload and self.config.artifact_root) or \
                key in self._reload_pending:
            return
        failed = self._reload_failed.get(key)
        if failed is not None and time.monotonic() < failed[1]:
            return  # backing off after a failure
        self._reloads[key] = ReloadOrder(user, version, tier)
        self._reload_pending.add(key)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        try:
            plan = self._plans.pop(request.request_id, None)
            if num_external_tokens > 0 and plan is not None:
                plan.start = plan.end - num_external_tokens
                self._to_load[request.request_id] = plan
        except Exception as exc:  # noqa: BLE001 - never into vLLM's step
            self._failed("update_state_after_alloc", request.request_id, exc)
            if num_external_tokens > 0:  # vLLM counts them computed: report them failed
                self._unloadable.add(request.request_id)

    def _slots(self, block_ids: list[int], start: int, end: int) -> tuple[np.ndarray, list[int]]:
        """Paged-cache slot of each token in ``[start, end)``, and the blocks they use."""
        bs = self.block_size
        pos = np.arange(start, end)
        slots = np.asarray(block_ids, dtype=np.int64)[pos // bs] * bs + pos % bs
        return slots, block_ids[start // bs:(end - 1) // bs + 1]

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = InferScaleMetadata(reloads=list(self._reloads.values()))
        self._reloads.clear()
        try:
            block_ids = self._scheduled_blocks(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - never into vLLM's step
            # the blocks of this step's admitted loads are unknown: they can be neither
            # loaded nor reported, so no request is admitted from now on
            cause = self.failures.record("build_connector_meta", exc,
                                         "no memory is injected from now on")
            self._disabled = f"connector disabled after an error ({cause})"
            meta.scheduler_errors = self.failures.count
            return meta
        for req_id in self._unloadable & block_ids.keys():
            self._unloadable.discard(req_id)
            meta.failed_blocks.extend(block_ids[req_id])
        for req_id, plan in list(self._to_load.items()):
            if req_id not in block_ids:
                continue  # not scheduled this step; stays pending
            del self._to_load[req_id]
            try:
                slots, blocks = self._slots(block_ids[req_id], plan.start, plan.end)
                meta.loads.append(LoadSpec(req_id, plan.user, plan.version, plan.chunks,
                                           plan.start, plan.end, slots, blocks))
                self.injected_tokens[req_id] = plan.end - plan.start
            except Exception as exc:  # noqa: BLE001 - its blocks are recomputed instead
                self._failed("build_connector_meta", req_id, exc)
                meta.failed_blocks.extend(block_ids[req_id])
        meta.scheduler_errors = self.failures.count
        return meta

    def _scheduled_blocks(self, scheduler_output: "SchedulerOutput") -> dict[str, list[int]]:
        """Block ids of the requests this step schedules that may need a load."""
        block_ids: dict[str, list[int]] = {}
        for new_req in scheduler_output.scheduled_new_reqs:
            block_ids[new_req.req_id] = block_ids_of(new_req)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            # resumed after preemption: new_block_ids then lists all the request's blocks
            if (req_id in self._to_load or req_id in self._unloadable) and req_id in resumed \
                    and cached.new_block_ids[i]:
                block_ids[req_id] = list(cached.new_block_ids[i][0])
        return block_ids

    def update_connector_output(self, connector_output: Any) -> None:
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(report, ResidencyReport):
            return
        try:
            self._apply(report)
        except Exception as exc:  # noqa: BLE001 - the workers re-check every load anyway
            self.failures.record("update_connector_output", exc,
                                 "the residency view may lag (loads are checked by workers)")

    def _apply(self, report: ResidencyReport) -> None:
        for op, payload in report.changes:
            if op == "remove":
                user, version = payload
                self._view.pop((user, version), None)
                self._reload_pending.discard((user, version))
                if self._held.get(user) == version:
                    del self._held[user]
                continue
            info: ResidentInfo = payload
            old = self._held.get(info.user)
            if old is not None and old != info.version:
                self._view.pop((info.user, old), None)
            self._view[(info.user, info.version)] = info
            self._held[info.user] = info.version
            self._reload_pending.discard((info.user, info.version))
            self._reload_failed.pop((info.user, info.version), None)
        for user, version, reason in report.failed_reloads:
            key = (user, version)
            failures = self._reload_failed.get(key, (0, 0.0))[0] + 1
            wait = self.config.backoff_s(failures)
            self._reload_failed[key] = (failures, time.monotonic() + wait)
            self._reload_pending.discard(key)
            log.warning("reload of user %s version %s failed (%d in a row; next try in "
                        "%.0f s at the earliest): %s", user, version[:12], failures, wait,
                        reason)
        for req_id, reason in report.failed_loads:  # the worker logged and counted it
            if self.injected_tokens.pop(req_id, None) is not None:
                self._fallbacks[req_id] = f"memory load failed ({reason}); recomputed"

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict | None]:
        req_id = request.request_id
        self._plans.pop(req_id, None)
        self._to_load.pop(req_id, None)
        self._unloadable.discard(req_id)
        result: dict[str, Any] = {"injected_tokens": self.injected_tokens.pop(req_id, 0)}
        fallback = self._fallbacks.pop(req_id, None)
        if fallback:
            result["fallback"] = fallback
        return False, {PARAMS_KEY: result}

    # ======================================================================= worker

    def attach_model(self, model: torch.nn.Module, layers: dict[str, Any] | None = None) -> None:
        """Called once by the worker extension after the KV cache exists: take the model's
        own rotary module and, given the engine's attention ``layers`` (its static
        forward context), build and check the fused injection kernel."""
        from inferscale.vllm_compat import find_rotary

        if self.rotary is None:
            self.rotary = find_rotary(model)
        if layers is not None and self._fused is None:
            self._layers = attention_layers(layers)
            self._build_fused()

    def _build_fused(self) -> None:
        if not self._layers or self.rotary is None:
            return
        self._fused = FusedWriter.build(self._layers, self.rotary, self.model_dtype,
                                        place=lambda slab: self.store.place(slab, "gpu"))

    @property
    def inject_path(self) -> str:
        """``numba`` / ``triton`` (fused kernel) or ``generic: why``."""
        if self._fused is None:
            return "generic: not built yet"
        return self._fused.kind if self._fused.ok else f"generic: {self._fused.reason}"

    def hydrate(self, resident: Resident, tier: str) -> Resident:
        """Put a hydrated artifact in the store (worker extension, background reloads)."""
        if resident.fingerprint != self.config.model_fingerprint:
            raise ValueError(f"artifact fingerprint {resident.fingerprint} is not the "
                             f"engine's {self.config.model_fingerprint}")
        self.admin_evicted.discard(resident.user)
        return self.store.put(resident, tier)

    def evict(self, user: str) -> bool:
        """Admin eviction: drop the user and do not reload it until hydrated again."""
        self.admin_evicted.add(user)
        return self.store.evict(user)

    def admission(self, tier: str):
        """``admit(manifest)`` for hydration: refuses, before any KV byte is read, a slab
        larger than every budget ``tier`` may use (:meth:`ResidentStore.fit_tier`)."""
        from inferscale.hydrate import slab_nbytes

        def admit(manifest: Any) -> None:
            self.store.fit_tier(manifest.user, slab_nbytes(manifest, self.store.dtype), tier)
        return admit

    def _start_reload(self, order: ReloadOrder) -> None:
        """Queue the scheduler's reload order on the pool (at most one per (user, version)
        at a time); ``order.tier`` None: the tier the user's current version is on, else
        ``reload_tier``. An admin-evicted user is refused (reported to the scheduler)."""
        user, version = order.user, order.version
        if user in self.admin_evicted:
            with self._reload_lock:
                self._failed_reloads.append((user, version, "evicted by an admin"))
            return
        with self._reload_lock:
            if (user, version) in self._reloading:
                return
            self._reloading.add((user, version))
        held = self.store.held(user)
        tier = order.tier or (held.tier if held is not None else self.config.reload_tier)
        self._reload_pool.submit(self._reload, ReloadOrder(user, version, tier))

    def _reload(self, order: ReloadOrder) -> None:
        from inferscale.worker_ext import load_resident

        try:
            if self.store.get(order.user, order.version) is None:
                resident = load_resident(self.config, order.user, order.version,
                                         self.admission(order.tier))
                if order.user in self.admin_evicted:
                    raise RuntimeError("evicted by an admin since the reload was ordered")
                self.hydrate(resident, order.tier)
                self.reloads += 1
                log.info("reloaded user %s version %s into %s", order.user,
                         order.version[:12], order.tier)
        except Exception as exc:  # noqa: BLE001 - reported to the scheduler, logged
            with self._reload_lock:
                self.reload_failures += 1
                self._failed_reloads.append((order.user, order.version,
                                             f"{type(exc).__name__}: {exc}"))
        finally:
            with self._reload_lock:
                self._reloading.discard((order.user, order.version))

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Start the step's background reloads and memory loads. Never raises: a load
        that fails for any reason is reported through :meth:`get_block_ids_with_load_errors`."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, InferScaleMetadata)
        self.scheduler_errors = meta.scheduler_errors
        self._invalid_blocks.update(meta.failed_blocks)
        for order in meta.reloads:
            try:
                self._start_reload(order)
            except Exception as exc:  # noqa: BLE001 - reported to the scheduler
                cause = self.failures.record(f"starting the reload of user {order.user}", exc,
                                             "a later request orders it again")
                with self._reload_lock:
                    self._failed_reloads.append((order.user, order.version, cause))
        if meta.loads:
            t0 = time.perf_counter()
            self._step = self._begin(meta.loads, forward_context)
            self.inject_seconds += time.perf_counter() - t0
            self.inject_calls += 1

    def _begin(self, loads: list[LoadSpec], forward_context: "ForwardContext") -> StepLoad | None:
        """Verify the step's loads against the store, then start them (see inject.py).
        Every load that is refused or raises is reported as failed (:meth:`_load_failed`)."""
        jobs, specs, at = [], [], 0
        try:
            layers = self._attention_layers(forward_context)
        except Exception as exc:  # noqa: BLE001 - every load of the step is recomputed
            for spec in loads:
                self._load_failed(spec, exc)
            return None
        for spec in loads:
            try:
                resident = self.store.get(spec.user, spec.version)
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
        if not jobs:
            return None
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
            self._layers = attention_layers(forward_context.no_compile_layers)
        if self._fused is None:
            self._build_fused()
        if not self._layers:
            raise RuntimeError("the engine has no attention layer with a paged KV cache")
        return self._layers

    def _run(self, jobs: list[Job], specs: list[LoadSpec],
             layers: list[tuple[int, Any]]) -> StepLoad:
        step = StepLoad.run(self.store, jobs, layers, self.model_dtype, self.rotary,
                            [s.slot_mapping for s in specs], self._staging, self._fused)
        self.loaded_tokens += sum(j.width for j in jobs)
        if self.verify_next:
            self.last_step, self.verify_next = step, False
        return step

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
        self._failed_loads.append((spec.req_id, why))

    def _check(self, spec: LoadSpec, resident: Resident | None) -> str | None:
        if resident is None:
            return f"user {spec.user} version {spec.version[:12]} is not resident"
        if self.rotary is None:
            return "no rotary module attached"
        if any(c not in resident.index for c in spec.chunks):
            return "unknown chunk"
        total = sum(resident.index[c][1] for c in spec.chunks)
        if spec.end > total or len(spec.slot_mapping) != spec.end - spec.start:
            return "load range outside the memory"
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv enqueues every write ahead of the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # memory is only ever loaded

    def wait_for_save(self) -> None:
        """End of the step: release its staging buffer (the stream orders its reuse)."""
        self._step = None

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._invalid_blocks = self._invalid_blocks, set()
        return bad

    def build_connector_worker_meta(self) -> ResidencyReport | None:
        events = self.store.take_events()
        with self._reload_lock:
            failed, self._failed_reloads = self._failed_reloads, []
        loads, self._failed_loads = self._failed_loads, []
        if not events and not failed and not loads:
            return None
        changes = [("add", ResidentInfo.of(e.resident)) if e.op == "add"
                   else ("remove", (e.user, e.version)) for e in events]
        return ResidencyReport(changes, failed, loads)
