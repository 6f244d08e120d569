"""One user's whole chain, the unit the flows fan out: the library's chain
(:func:`inferscale.pipeline.chain.encode_user`) with each step a Prefect task.

The chain runs in one process (a thread of the flow's process, or a Ray worker), so the
KV never travels between processes: each step is a nested task run with its own cache
or retries. The compute steps hold one slot of the Prefect global concurrency limit
:data:`COMPUTE_LIMIT` (created by the flows), which bounds how many users are extracted
and encoded at once across every run and worker sharing the Prefect server.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Any, Sequence

import pyarrow as pa
from prefect import get_run_logger, task
from prefect.concurrency.sync import concurrency

from inferscale.facts.extractor import FactsConfig
from inferscale.pipeline.chain import Steps
from inferscale.pipeline.chain import encode_user as chain
from inferscale.pipeline.config import PipelineConfig
from tasks.encode import encode_kv
from tasks.facts import extract_facts
from tasks.ingest import ingest_logs
from tasks.lineage import record_lineage
from tasks.model import resolve_model
from tasks.publish import publish_version
from tasks.store import read_latest

COMPUTE_LIMIT = "inferscale-compute"
LEASE_S = 60  # the server's minimum; a killed worker's slots come back after it


def _encode(*args: Any) -> Any:
    """``encode_kv``; a result from the task cache reused and encoded no fact in this run."""
    state = encode_kv(*args, return_state=True)
    encoded = state.result()
    if state.name == "Cached":
        encoded = replace(encoded, stats={**encoded.stats, "reused": 0, "encoded": 0,
                                          "cached": True})
    return encoded


TASK_STEPS = Steps(
    ingest=ingest_logs, fingerprint=resolve_model, facts=extract_facts, latest=read_latest,
    encode=_encode, publish=publish_version, record=record_lineage,
    compute=lambda: concurrency(COMPUTE_LIMIT, occupy=1, lease_duration=LEASE_S),
    logger=get_run_logger)


@task(name="encode-user", task_run_name="encode-user-{user}", persist_result=False)
def encode_user(cfg: PipelineConfig, facts_cfg: FactsConfig, user: str, turns: pa.Table,
                model_fp: str, reason: str = "requested",
                sources: Sequence[str] = (), inputs_at: datetime | None = None) -> dict[str, Any]:
    """The chain for ``user`` with :data:`TASK_STEPS`; its
    :class:`~inferscale.pipeline.report.UserOutcome` as a dict. Raises on failure (the
    flow records the user as failed and goes on with the others)."""
    return chain(cfg, facts_cfg, user, turns, model_fp, steps=TASK_STEPS, reason=reason,
                 sources=sources, inputs_at=inputs_at).to_dict()
