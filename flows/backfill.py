"""Backfill: encode every user for a (new) model; resumable, bounded, failure-tolerant."""

from __future__ import annotations

import time
from typing import Any, Literal

from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.common import fan_out, finish, prepare, record_skipped
from flows.results import PERSISTED
from inferscale.artifacts.lineage_view import fingerprint_slug
from inferscale.pipeline.chain import select_users
from inferscale.pipeline.report import RunReport
from tasks.store import plan


@flow(name="backfill-model", log_prints=True, **PERSISTED)
def backfill_model(model: str, users: list[str] | None = None, logs: list[str] | None = None,
                   fact_mode: Literal["raw", "mem0"] | None = None,
                   artifact_root: str | None = None, window: int | None = None,
                   task_runner: Literal["threads", "ray"] = "threads", max_workers: int = 2,
                   ray_address: str | None = None, concurrency_limit: int = 2) -> Any:
    """Re-encode every user (or the given ones) for ``model``.

    Resumable: a user whose LATEST for this model's fingerprint already has the same
    inputs (log hash, encoder and facts configs) is skipped, so a rerun after a crash or
    a partial failure only does what is left. At most ``concurrency_limit`` users are encoded at
    once across all runs (the Prefect global concurrency limit "inferscale-compute");
    one user's failure never stops the others. Ends with a table of done and failed users
    (artifact key ``inferscale-backfill-<fingerprint prefix>``); the run is Failed when
    some users failed. Deployed as ``backfill``, run when a model changes.

    Args:
        model: the model to encode for ("embedded", a checkpoint directory or hub id).
        users: user ids; none = every user found in the logs.
        logs: fsspec URIs or globs of conversation logs; none = INFERSCALE_LOG_URIS,
            else the project's sample conversation.
        fact_mode: "raw" or "mem0"; none = INFERSCALE_FACT_MODE.
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
    hashes = prep.ingest.turns_hashes()
    hashes = {u: hashes[u] for u in select_users(prep.ingest, users)}
    run_plan = plan(prep.cfg, prep.facts_cfg, prep.model_fp, hashes)
    record_skipped(prep, run_plan.up_to_date)
    outcomes = fan_out(prep, run_plan.encode, task_runner=task_runner, max_workers=max_workers,
                       ray_address=ray_address, concurrency_limit=concurrency_limit)
    outcomes += run_plan.outcomes(prep.ingest.turns, prep.model_fp)
    table = RunReport("", prep.model_fp, outcomes).table()
    fp = prep.model_fp
    create_table_artifact(
        table, key=f"inferscale-backfill-{fingerprint_slug(fp)}",
        description=f"Backfill onto model `{fp}`: "
                    f"{sum(o.status != 'failed' for o in outcomes)} done, "
                    f"{sum(o.status == 'failed' for o in outcomes)} failed")
    return finish(f"Backfill onto model {fp[:12]}", "inferscale-backfill-summary", prep,
                  outcomes, started)
