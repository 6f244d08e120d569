"""Worker extension: what the engine's collective RPC calls inside the vLLM worker.

vLLM mixes :class:`InferScaleWorkerExtension` into its worker class
(``worker_extension_cls``), so ``engine.collective_rpc("inferscale_hydrate", args=...)``
runs :meth:`InferScaleWorkerExtension.inferscale_hydrate` next to the KV cache. Only ids
cross the process boundary: the worker reads the artifact itself.

Callers: ``inferscale.engine.MemoryEngine`` (admin hydrate/evict/status) and the
connector's background reloads (:func:`load_resident`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from inferscale.resident import Resident


def load_resident(config: Any, user: str, version: str,
                  admit: Callable[[Any], None] | None = None) -> Resident:
    """Hydrate ``user``'s artifact ``version`` from the store named in the connector config.

    The slab lands in host memory (pinned where CUDA exists); the store moves it to the
    tier asked for. Checksums and the model fingerprint are verified by hydration;
    ``admit(manifest)`` may refuse the version before its KV is read (the budget check).
    """
    from inferscale.hydrate import hydrate
    from inferscale.store import StoreConfig

    if not config.artifact_root:
        raise RuntimeError("the connector has no artifact_root to hydrate from")
    store = StoreConfig(config.artifact_root, dict(config.storage_options))
    art = hydrate(store, user, config.model_fingerprint, version, tier="host", admit=admit)
    return Resident(user=user, version=art.manifest.version,
                    fingerprint=art.manifest.model_fingerprint, slab=art.slab,
                    index=dict(art.index),
                    token_ids={k: tuple(v) for k, v in art.token_ids.items()})


def _connector():
    from inferscale.connector import InferScaleConnector
    from inferscale.vllm_compat import kv_transfer_group

    conn = kv_transfer_group()
    if not isinstance(conn, InferScaleConnector):
        raise RuntimeError("the engine was started without the InferScale connector")
    return conn


class InferScaleWorkerExtension:
    """Methods the engine's ``collective_rpc`` calls on each worker (``self`` is the worker)."""

    def inferscale_attach(self) -> dict:
        """Hand the model's own rotary module to the connector; called once at start-up."""
        conn = _connector()
        runner = self.model_runner  # type: ignore[attr-defined]
        conn.attach_model(runner.model,
                          runner.vllm_config.compilation_config.static_forward_context)
        return {"rotary": type(conn.rotary).__name__, "device": str(conn.store.device),
                "inject_path": conn.inject_path}

    def inferscale_hydrate(self, user: str, version: str, tier: str) -> dict:
        """Load ``user``'s artifact ``version`` (or ``"latest"``) into ``tier``."""
        conn = _connector()
        conn.attach_model(self.model_runner.model)  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        resident = conn.hydrate(load_resident(conn.config, user, version, conn.admission(tier)),
                                tier)
        return {"user": user, "version": resident.version, "tier": resident.tier,
                "bytes": resident.nbytes, "chunks": len(resident.index),
                "dtype": str(resident.slab.dtype).removeprefix("torch."),
                "seconds": round(time.perf_counter() - t0, 4)}

    def inferscale_set_budgets(self, gpu_bytes: int, host_bytes: int) -> dict:
        """New byte budgets for the tiers; over-budget users are demoted/evicted now."""
        return _connector().store.set_budgets(gpu_bytes, host_bytes)

    def inferscale_verify_next(self) -> bool:
        """Keep the next load's description so :meth:`inferscale_verify_last_load` can
        check what it wrote."""
        _connector().verify_next = True
        return True

    def inferscale_verify_last_load(self) -> dict:
        """Compare the paged cache at the last kept load's slots with an independent
        computation: the resident's pre-RoPE K/V, rotated with transformers' tables of
        the served config (fp32). Returns max abs errors, or ``checked: False`` where the
        backend's layout cannot be read back."""
        import torch

        from inferscale.inject import row_index
        from inferscale.rope import RotaryTables, rotate_keys
        from inferscale.vllm_compat import read_layer_kv

        conn = _connector()
        step = conn.last_step
        if step is None:
            return {"checked": False, "reason": "no load kept"}
        device = step.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        pre = torch.cat([j.resident.slab[row_index(j.resident, j.chunks, j.start, j.end)]
                         .to(device, torch.float32) for j in step.jobs])  # [N, 2, L, H, D]
        hf_config = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        tables = RotaryTables.from_config(hf_config, device=device)
        positions = step.positions.to(device)
        want_k = rotate_keys(pre[:, 0], positions, tables, token_dim=0)  # [N, L, H, D]
        err_k = err_v = 0.0
        scale = float(pre.abs().max())
        for idx, layer in step.layers.items():
            got = read_layer_kv(layer, step.slots.to(device), conn.block_size)
            if got is None:
                return {"checked": False, "reason": f"{type(layer.impl).__name__} layout"}
            err_k = max(err_k, float((got[0].float() - want_k[:, idx]).abs().max()))
            err_v = max(err_v, float((got[1].float() - pre[:, 1, idx]).abs().max()))
        return {"checked": True, "tokens": int(pre.shape[0]), "max_abs_err_k": err_k,
                "max_abs_err_v": err_v, "max_abs_value": scale,
                "tiers": sorted({j.resident.tier for j in step.jobs}),
                "dtype": str(step.dtype), "path": step.path}

    def inferscale_evict(self, user: str) -> bool:
        return _connector().evict(user)

    def inferscale_fault_drop_slab(self, user: str) -> bool:
        """Fault injection, for tests: the data of ``user``'s resident slab disappears
        underneath the store (the slab becomes a tensor of its shape and dtype without
        storage), so its next load fails inside the real load path. Hydrate the user
        again to repair it. Returns whether the user was resident."""
        import torch

        resident = _connector().store.held(user)
        if resident is None:
            return False
        slab = resident.slab
        resident.slab = torch.empty_strided(slab.shape, slab.stride(), dtype=slab.dtype,
                                            device="meta")
        return True

    def inferscale_status(self) -> dict:
        conn = _connector()
        from inferscale.hydrate import READS

        return {"residents": conn.store.residents(), "loaded_tokens": conn.loaded_tokens,
                "reloads": conn.reloads, "reload_failures": conn.reload_failures,
                "kv_reads": dict(READS),  # kv.arrow reads started (hydrations, reloads)
                "load_failures": conn.failures.count,  # loads recomputed instead (logged)
                "scheduler_errors": conn.scheduler_errors,  # scheduler-hook errors (logged)
                "inject_calls": conn.inject_calls,
                "inject_ms_mean": conn.inject_seconds * 1e3 / max(1, conn.inject_calls),
                "inject_path": conn.inject_path,
                "budgets": conn.store.budget,
                "used": {t: conn.store.used(t) for t in ("gpu", "host")}}
