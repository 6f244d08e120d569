"""Encode users: ingest -> extract facts -> encode KV -> publish, per user."""

from __future__ import annotations

import time
from typing import Any, Literal

from prefect import flow

from flows.common import fan_out, finish, prepare
from flows.results import PERSISTED
from inferscale.pipeline.chain import select_users


@flow(name="encode-users", log_prints=True, **PERSISTED)
def encode_users(users: list[str] | None = None, logs: list[str] | None = None,
                 fact_mode: Literal["raw", "mem0"] | None = None, model: str | None = None,
                 artifact_root: str | None = None, window: int | None = None,
                 task_runner: Literal["threads", "ray"] = "threads", max_workers: int = 2,
                 ray_address: str | None = None, concurrency_limit: int = 2) -> Any:
    """Encode and publish the memory of the given users.

    Every user goes through facts -> KV -> publish; steps whose inputs did not change
    come from the cache, and a user whose LATEST already is the version these inputs
    make costs a cache lookup. Returns the run report (per user: status, version,
    counts); the run ends Failed when some users failed, after all others finished.
    Deployed as ``encode``; ``inferscale-demo`` calls it in-process.

    Args:
        users: user ids to encode; none = every user found in the logs.
        logs: fsspec URIs or globs of conversation logs (JSONL or LoCoMo JSON); none =
            INFERSCALE_LOG_URIS, else the project's sample conversation.
        fact_mode: "raw" (each turn is a fact, fast) or "mem0" (LLM extraction); none =
            INFERSCALE_FACT_MODE.
        model: serving model to encode for ("embedded", a checkpoint path or hub id);
            none = INFERSCALE_MODEL.
        artifact_root: artifact store root (directory or s3://); none =
            INFERSCALE_ARTIFACT_ROOT.
        window: turns of context before each fact; none = INFERSCALE_WINDOW.
        task_runner: "threads" (in the flow's process) or "ray" (a Ray cluster; one GPU
            per user task when the cluster has GPUs).
        max_workers: threads of the "threads" runner.
        ray_address: Ray cluster address for "ray"; none = start a local instance (a
            cluster must be listed in INFERSCALE_RAY_ADDRESSES).
        concurrency_limit: size of the global concurrency limit "inferscale-compute"
            shared by every encode run (users extracted/encoded at once).
    """
    started = time.perf_counter()
    prep = prepare(logs, model=model, fact_mode=fact_mode, artifact_root=artifact_root,
                   window=window)
    outcomes = fan_out(prep, select_users(prep.ingest, users), task_runner=task_runner,
                       max_workers=max_workers, ray_address=ray_address,
                       concurrency_limit=concurrency_limit)
    return finish("Encode users", "inferscale-encode-summary", prep, outcomes, started)
