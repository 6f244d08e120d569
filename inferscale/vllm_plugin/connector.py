"""InferScale's vLLM KV connector: inject a user's memory KV, prefill only the query.

Loaded by vLLM through ``kv_connector_module_path="inferscale.vllm_plugin.connector"``
and ``kv_connector="InferScaleConnector"`` (:func:`inferscale.vllm_plugin.config.
kv_transfer_config`); settings come only from ``kv_connector_extra_config``
(:class:`~inferscale.vllm_plugin.config.ConnectorConfig`).

:class:`InferScaleConnector` is a thin facade, as vLLM's own larger connectors are: vLLM
builds one per process with a role, and the connector delegates each hook to the half of
that role —

- scheduler (engine-core process): :class:`~inferscale.vllm_plugin.scheduler.ConnectorScheduler`
  decides which requests get memory KV and builds each step's
  :class:`~inferscale.vllm_plugin.metadata.InferScaleMetadata`;
- worker (worker process): :class:`~inferscale.vllm_plugin.worker.ConnectorWorker` holds
  the resident slabs, writes the step's loads into the paged cache and reports residency
  back (:class:`~inferscale.vllm_plugin.metadata.ResidencyReport`).

Tensor parallelism: vLLM builds one worker half per rank; each holds and writes only its
rank's KV heads, and the scheduler admits a user only when every rank holds it.
Pipeline and context parallelism, and a tensor-parallel size that does not divide the
model's KV heads, are refused when the connector is built
(:func:`~inferscale.vllm_plugin.compat.check_parallelism`).

Version differences live in :mod:`inferscale.vllm_plugin.compat`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from inferscale.vllm_plugin.compat import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, check_parallelism,
)
from inferscale.vllm_plugin.config import ConnectorConfig
from inferscale.vllm_plugin.metadata import ResidencyReport
from inferscale.vllm_plugin.scheduler import ConnectorScheduler
from inferscale.vllm_plugin.worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class InferScaleConnector(KVConnectorBase_V1):
    """Memory KV injection for vLLM: the facade over the scheduler and worker halves."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_extra_config(
            dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        tp_size = check_parallelism(vllm_config)
        self.connector_scheduler: ConnectorScheduler | None = None
        self.connector_worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = ConnectorScheduler(
                self.config, vllm_config.cache_config.block_size, tp_size)
        else:
            self.connector_worker = ConnectorWorker(self.config, vllm_config)

    @property
    def _scheduler(self) -> ConnectorScheduler:
        assert self.connector_scheduler is not None, "a scheduler hook called on a worker"
        return self.connector_scheduler

    @property
    def _worker(self) -> ConnectorWorker:
        assert self.connector_worker is not None, "a worker hook called on the scheduler"
        return self.connector_worker

    # ======================================================================= scheduler

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._scheduler.request_finished(request, block_ids)

    # ======================================================================= worker

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker.start_load_kv(self._get_connector_metadata(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv enqueues every write ahead of the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # memory is only ever loaded

    def wait_for_save(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> ResidencyReport | None:
        return self._worker.build_connector_worker_meta()
