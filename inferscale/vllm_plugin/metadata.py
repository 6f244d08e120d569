"""What the connector's two halves tell each other, once per engine step.

Scheduler -> worker: :class:`InferScaleMetadata` (built by
:meth:`~inferscale.vllm_plugin.scheduler.ConnectorScheduler.build_connector_meta`): the
step's memory loads (:class:`LoadSpec`, with their paged-cache slots) and the background
reloads to start (:class:`ReloadOrder`).

Worker -> scheduler: :class:`ResidencyReport` (built by
:meth:`~inferscale.vllm_plugin.worker.ConnectorWorker.build_connector_worker_meta`): which
(user, version) became resident or went away on which tensor-parallel rank
(:class:`ResidentInfo`: what the scheduler needs to admit a request), and which reloads
and loads failed. Under tensor parallelism every rank reports; vLLM merges the ranks'
reports of a step with :meth:`ResidencyReport.aggregate` before the scheduler sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inferscale.hydrate.resident import Resident
from inferscale.vllm_plugin.compat import KVConnectorMetadata, KVConnectorWorkerMetadata


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
    the user's current version is on, else the connector's ``reload_tier``)."""

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
    """What the scheduler needs to know about one resident (user, version). Every rank
    reads the same artifact version, so only rank 0 sends the chunks' token ids (the
    other ranks' ``token_ids`` are empty)."""

    user: str
    version: str
    fingerprint: str
    token_ids: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, r: Resident, with_tokens: bool = True) -> "ResidentInfo":
        return cls(r.user, r.version, r.fingerprint, r.token_ids if with_tokens else {})


@dataclass
class ResidencyReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler: residency changes since the last report, oldest first, and
    the reloads and loads that failed.

    ``changes`` holds ``(rank, "add", ResidentInfo)`` and ``(rank, "remove", (user,
    version))``, ``rank`` being the reporting worker's tensor-parallel rank.
    """

    changes: list[tuple[int, str, Any]] = field(default_factory=list)
    failed_reloads: list[tuple[str, str, str]] = field(default_factory=list)  # + reason
    failed_loads: list[tuple[str, str]] = field(default_factory=list)  # (request id, reason)

    def aggregate(self, other: "ResidencyReport") -> "ResidencyReport":
        """vLLM's merge of the ranks' reports of one step (``KVOutputAggregator``, in
        rank order): each change keeps its rank, so concatenating loses nothing; the
        scheduler counts a user resident only once every rank has reported it."""
        return ResidencyReport(self.changes + other.changes,
                               self.failed_reloads + other.failed_reloads,
                               self.failed_loads + other.failed_loads)
