"""A worker extension for tests: the serving endpoints plus fault injection.

The engines the tests start (``engine_env``, the tensor-parallel ``tp2``) load
:class:`FaultInjectionExtension` in place of
:class:`~inferscale.vllm_plugin.worker_ext.InferScaleWorkerExtension`
(``EngineConfig(worker_extension=FAULT_EXTENSION)``): vLLM imports it by its dotted path
in the worker process, which inherits this process's ``sys.path`` (``conftest.py`` puts
``tests/`` on it). Production engines carry no fault endpoint.
"""

from __future__ import annotations

from inferscale.vllm_plugin.worker_ext import InferScaleWorkerExtension, connector_worker

FAULT_EXTENSION = "fault_injection.FaultInjectionExtension"


class FaultInjectionExtension(InferScaleWorkerExtension):
    """The serving endpoints, and faults a test can inject into the worker half."""

    def inferscale_fault_drop_slab(self, user: str) -> bool:
        """The data of ``user``'s resident slab disappears underneath the store (the slab
        becomes a tensor of its shape and dtype without storage), so its next load fails
        inside the real load path. Hydrate the user again to repair it. Returns whether
        the user was resident."""
        import torch

        resident = connector_worker().store.held(user)
        if resident is None:
            return False
        slab = resident.slab
        resident.slab = torch.empty_strided(slab.shape, slab.stride(), dtype=slab.dtype,
                                            device="meta")
        return True

    def inferscale_fault_drop_on_rank(self, user: str, rank: int) -> bool:
        """Only tensor-parallel rank ``rank`` loses ``user``, as its own budget eviction
        would drop it (not an admin eviction: a later request reloads it there). Returns
        whether this worker dropped it."""
        worker = connector_worker()
        return worker.tp_rank == rank and worker.store.evict(user)
