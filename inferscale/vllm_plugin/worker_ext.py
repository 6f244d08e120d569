"""Worker extension: the collective-RPC endpoints the serving engine calls in the worker.

vLLM mixes :class:`InferScaleWorkerExtension` into its worker class
(``worker_extension_cls``, :data:`inferscale.vllm_plugin.config.WORKER_EXTENSION`), so
``engine.collective_rpc("inferscale_hydrate", args=...)`` runs
:meth:`InferScaleWorkerExtension.inferscale_hydrate` next to the KV cache. Only ids cross
the process boundary: the worker reads the artifact itself. Each endpoint hands over to
the connector's worker half (:class:`~inferscale.vllm_plugin.worker.ConnectorWorker`).
Under tensor parallelism ``collective_rpc`` runs each endpoint on every rank and returns
one result per rank, in rank order: each rank hydrates, evicts, reports and verifies its
own KV heads (the results name the rank, ``tp_rank``, and its heads, ``kv_heads``).

Reached only by name, through vLLM's ``collective_rpc``, from
:class:`inferscale.serve.engine.MemoryEngine` (attach at start-up, admin commands, load
verification, the counters ``/metrics`` reads at scrape time, and per cold request the
prefetch of its facts and the storage statistics of the compute-or-load split). The
tests' engines load a subclass with fault injection (``tests/fault_injection.py``):
nothing here exists only for tests.
"""

from __future__ import annotations

import time

from inferscale.vllm_plugin.compat import kv_transfer_group
from inferscale.vllm_plugin.connector import InferScaleConnector
from inferscale.vllm_plugin.worker import ConnectorWorker


def connector_worker() -> ConnectorWorker:
    """This worker process's connector half (RuntimeError: the engine has none)."""
    conn = kv_transfer_group()
    if not isinstance(conn, InferScaleConnector) or conn.connector_worker is None:
        raise RuntimeError("the engine was started without the InferScale connector")
    return conn.connector_worker


class InferScaleWorkerExtension:
    """Methods the engine's ``collective_rpc`` calls on each worker (``self`` is the worker)."""

    def inferscale_attach(self) -> dict:
        """Hand the model's own rotary module to the connector; called once at start-up."""
        worker = connector_worker()
        runner = self.model_runner  # type: ignore[attr-defined]
        worker.attach_model(runner.model,
                            runner.vllm_config.compilation_config.static_forward_context)
        return {"rotary": type(worker.rotary).__name__, "device": str(worker.store.device),
                "inject_path": worker.inject_path}

    def inferscale_hydrate(self, user: str, version: str, tier: str) -> dict:
        """Load ``user``'s artifact ``version`` (or ``"latest"``) into ``tier``."""
        worker = connector_worker()
        worker.attach_model(self.model_runner.model)  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        resident = worker.load(user, version, tier)
        heads = worker.heads
        return {"user": user, "version": resident.version, "tier": resident.tier,
                "tp_rank": worker.tp_rank,
                "kv_heads": [heads.start, heads.count] if heads is not None else None,
                "bytes": resident.nbytes, "chunks": len(resident.index),
                "dtype": str(resident.slab.dtype).removeprefix("torch."),
                "seconds": round(time.perf_counter() - t0, 4)}

    def inferscale_set_budgets(self, gpu_bytes: int, host_bytes: int) -> dict:
        """New byte budgets for the tiers; over-budget users are demoted/evicted now."""
        return connector_worker().store.set_budgets(gpu_bytes, host_bytes)

    def inferscale_verify_next(self) -> bool:
        """Keep the next load's description so :meth:`inferscale_verify_last_load` can
        check what it wrote."""
        connector_worker().verify_next = True
        return True

    def inferscale_verify_last_load(self) -> dict:
        """Compare the paged cache at the last kept load's slots with an independent
        computation (:func:`inferscale.vllm_plugin.inject.verify_step`)."""
        hf_config = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        worker = connector_worker()
        return {**worker.verify_last_load(hf_config), "tp_rank": worker.tp_rank}

    def inferscale_evict(self, user: str) -> bool:
        return connector_worker().evict(user)

    def inferscale_prefetch(self, user: str, version: str, chunks: list[str],
                            deadline_s: float, nbytes: int = 0) -> dict:
        """Start reading a request's leading ``chunks`` from storage before the engine
        sees the request (the server sends this ahead of it), unless this worker holds
        the user; returns this worker's storage statistics."""
        return connector_worker().prefetch(user, version, list(chunks), deadline_s, nbytes)

    def inferscale_prime_index(self, user: str, version: str) -> bool:
        """Start reading ``user``'s ``version`` chunk index into this worker's cache (an
        admin hydrate of the user's facts alone); False without a store to read from."""
        return connector_worker().fetches.prime(user, version)

    def inferscale_storage_stats(self) -> dict:
        """This worker's storage statistics for the server's compute-or-load split."""
        return connector_worker().storage_stats()

    def inferscale_status(self) -> dict:
        return connector_worker().status()

    def inferscale_metrics(self) -> dict:
        """This worker's running counters and residency, for the server's ``/metrics``:
        resident users and bytes per tier, budgets, the loads written (tokens, calls,
        seconds), loads and scheduler hooks that failed, background reloads (count,
        failures, latency histogram: :meth:`~inferscale.hydrate.loader.ResidentLoader.
        reload_stats`)."""
        worker = connector_worker()
        worker.collect_kernel_times()
        status = worker.status()
        tiers = {t: {"users": 0, "bytes": 0} for t in status["budgets"]}
        for r in status["residents"]:
            tiers[r["tier"]]["users"] += 1
            tiers[r["tier"]]["bytes"] += r["bytes"]
        return {"tiers": tiers, "budgets": status["budgets"],
                "loaded_tokens": worker.loaded_tokens, "inject_calls": worker.inject_calls,
                "inject_seconds": worker.inject_seconds,
                "load_failures": status["load_failures"],
                "scheduler_errors": status["scheduler_errors"],
                "reload": worker.loader.reload_stats(),
                "step": worker.step_time.snapshot(), "kernel": worker.kernel_time.snapshot(),
                "hook_seconds": dict(worker.hook_seconds),
                "promotions_declined": worker.promotions_declined,
                "facts_by_tier": dict(worker.facts_by_tier),
                "fetch": {**worker.fetches.latency.snapshot(), "reads": worker.fetches.reads,
                          "failures": worker.fetches.failures,
                          "bytes": worker.fetches.bytes_read,
                          "phase_seconds": dict(worker.fetches.phase_s)},
                "prefetch": dict(worker.fetches.prefetches)}
