"""The connector's worker half (worker process): memory KV into the paged cache.

:class:`ConnectorWorker` owns the worker's
:class:`~inferscale.hydrate.resident.ResidentStore` and its
:class:`~inferscale.hydrate.loader.ResidentLoader`. Each step,
:meth:`~ConnectorWorker.start_load_kv` starts the background reloads the scheduler
ordered, checks every load against the worker's own store (never trusting the
scheduler's view), gathers the needed tokens of all requests of the step and writes their
rotated K and V into every layer's paged blocks (:mod:`inferscale.vllm_plugin.inject`:
the fused kernel where it passed its check, else the model's rotary op and the backend's
own writer). A load that cannot be served is reported through
:meth:`~ConnectorWorker.get_block_ids_with_load_errors` and vLLM recomputes those blocks
(``kv_load_failure_policy="recompute"``): never wrong KV. Residency changes and failed
reloads go back to the scheduler in :meth:`~ConnectorWorker.build_connector_worker_meta`.

Called by :class:`inferscale.vllm_plugin.connector.InferScaleConnector` (vLLM's hooks)
and by the worker extension's collective-RPC endpoints
(:mod:`inferscale.vllm_plugin.worker_ext`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from inferscale.hydrate.loader import ResidentLoader
from inferscale.hydrate.resident import Resident, ResidentStore
from inferscale.types import TIERS
from inferscale.vllm_plugin.compat import attention_layers, find_rotary
from inferscale.vllm_plugin.config import ConnectorConfig
from inferscale.vllm_plugin.inject import Job, Staging, StepLoad, verify_step
from inferscale.vllm_plugin.kernels.writer import FusedWriter
from inferscale.vllm_plugin.metadata import (
    InferScaleMetadata, LoadSpec, ResidencyReport, ResidentInfo,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

# Under vLLM's logger namespace, so its handlers print these in every engine process.
log = logging.getLogger("vllm.inferscale.connector")


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
        self.model_dtype = vllm_config.model_config.dtype
        self.store = ResidentStore(worker_device(vllm_config), config.gpu_budget_bytes,
                                   config.host_budget_bytes)
        self.loader = ResidentLoader(self.store, config.model_fingerprint, config.artifact_root,
                                     config.storage_options)
        self.rotary: torch.nn.Module | None = None
        self._invalid_blocks: set[int] = set()
        self.loaded_tokens = 0
        self.inject_seconds = 0.0
        self.inject_calls = 0
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

    # ------------------------------------------------------------------ admin

    def load(self, user: str, version: str = "latest", tier: str = "gpu") -> Resident:
        """Admin hydration of ``user``'s ``version`` into ``tier``."""
        return self.loader.load(user, version, tier)

    def evict(self, user: str) -> bool:
        """Admin eviction: drop the user and do not reload it until hydrated again."""
        return self.loader.evict(user)

    def status(self) -> dict:
        store = self.store
        return {"residents": store.residents(), "loaded_tokens": self.loaded_tokens,
                "reloads": self.loader.reloads,
                "inject_calls": self.inject_calls,
                "inject_ms_mean": self.inject_seconds * 1e3 / max(1, self.inject_calls),
                "inject_path": self.inject_path,
                "budgets": store.budget,
                "used": {t: store.used(t) for t in TIERS}}

    def verify_last_load(self, hf_config: Any) -> dict:
        """Check the paged cache at the last kept load's slots (see
        :func:`inferscale.vllm_plugin.inject.verify_step`)."""
        if self.last_step is None:
            return {"checked": False, "reason": "no load kept"}
        return verify_step(self.last_step, hf_config, self.block_size)

    # ------------------------------------------------------------------ each step

    def start_load_kv(self, meta: InferScaleMetadata, forward_context: "ForwardContext") -> None:
        assert isinstance(meta, InferScaleMetadata)
        for order in meta.reloads:
            self.loader.reload_in_background(order.user, order.version, order.tier)
        if meta.loads:
            t0 = time.perf_counter()
            self._step = self._begin(meta.loads, forward_context)
            self.inject_seconds += time.perf_counter() - t0
            self.inject_calls += 1

    def _begin(self, loads: list[LoadSpec], forward_context: "ForwardContext") -> StepLoad | None:
        """Verify the step's loads against the store, then start them (see inject.py)."""
        if self._layers is None:  # the attention layers never change: find them once
            self._layers = attention_layers(forward_context.no_compile_layers)
        if self._fused is None:
            self._build_fused()
        layers = self._layers
        if not layers:
            return None
        jobs, slots, at = [], [], 0  # slots: one int64 array per job
        for spec in loads:
            resident = self.store.get(spec.user, spec.version)
            problem = self._check(spec, resident)
            if problem:
                log.warning("request %s: cannot inject memory (%s); recomputing its blocks",
                            spec.req_id, problem)
                self._invalid_blocks.update(spec.block_ids)
                continue
            jobs.append(Job(resident, spec.chunks, spec.start, spec.end, at))
            slots.append(spec.slot_mapping)
            at += spec.end - spec.start
        if not jobs:
            return None
        step = StepLoad.run(self.store, jobs, layers, self.model_dtype, self.rotary, slots,
                            self._staging, self._fused)
        self.loaded_tokens += at
        if self.verify_next:
            self.last_step, self.verify_next = step, False
        return step

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

    def wait_for_save(self) -> None:
        """End of the step: release its staging buffer (the stream orders its reuse)."""
        self._step = None

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._invalid_blocks = self._invalid_blocks, set()
        return bad

    def build_connector_worker_meta(self) -> ResidencyReport | None:
        events = self.store.take_events()
        failed = self.loader.take_failures()
        if not events and not failed:
            return None
        changes = [("add", ResidentInfo.of(e.resident)) if e.op == "add"
                   else ("remove", (e.user, e.version)) for e in events]
        return ResidencyReport(changes, failed)
