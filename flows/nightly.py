"""Nightly re-encode: only the users whose conversation changed since their LATEST."""

from __future__ import annotations

import time
from typing import Any, Literal

from prefect import flow

from flows.common import fan_out, finish, prepare, record_skipped
from flows.results import PERSISTED
from tasks.store import plan


@flow(name="nightly-reencode", log_prints=True, **PERSISTED)
def nightly_reencode(logs: list[str] | None = None,
                     fact_mode: Literal["raw", "mem0"] | None = None, model: str | None = None,
                     artifact_root: str | None = None, window: int | None = None,
                     task_runner: Literal["threads", "ray"] = "threads", max_workers: int = 2,
                     ray_address: str | None = None, concurrency_limit: int = 2) -> Any:
    """Re-encode the users whose log content changed since their LATEST artifact.

    For each user in the logs, the content hash of their turns is compared with the
    parent log hash in their LATEST manifest (and the encoder and facts configs with
    the current ones: a ``fact_mode`` change re-encodes everyone); only users that
    differ — or have nothing published yet — are encoded. An unchanged user costs
    reading LATEST and one manifest. Deployed as ``nightly`` (cron).

    Args:
        logs: fsspec URIs or globs of conversation logs; none = INFERSCALE_LOG_URIS,
            else the project's sample conversation.
        fact_mode: "raw" or "mem0"; none = INFERSCALE_FACT_MODE.
        model: serving model; none = INFERSCALE_MODEL.
        artifact_root: artifact store root; none = INFERSCALE_ARTIFACT_ROOT.
        window: turns of context before each fact; none = INFERSCALE_WINDOW.
        task_runner: "threads" or "ray".
        max_workers: threads of the "threads" runner.
        ray_address: Ray cluster address for "ray"; none = a local instance (a cluster must be
            listed in INFERSCALE_RAY_ADDRESSES).
        concurrency_limit: size of the global concurrency limit "inferscale-compute".
    """
    started = time.perf_counter()
    prep = prepare(logs, model=model, fact_mode=fact_mode, artifact_root=artifact_root,
                   window=window)
    run_plan = plan(prep.cfg, prep.facts_cfg, prep.model_fp, prep.ingest.turns_hashes())
    record_skipped(prep, run_plan.up_to_date)
    outcomes = fan_out(prep, run_plan.encode, task_runner=task_runner, max_workers=max_workers,
                       ray_address=ray_address, concurrency_limit=concurrency_limit)
    outcomes += run_plan.outcomes(prep.ingest.turns, prep.model_fp)
    return finish("Nightly re-encode", "inferscale-nightly-summary", prep, outcomes, started)
