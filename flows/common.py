"""What the encode, nightly and backfill flows share: settings, ingest, fan-out, reports.

:func:`prepare` reads the settings (``INFERSCALE_*`` in the worker's environment) with a
run's overrides, ingests the logs and fingerprints the model. :func:`fan_out` runs
``tasks.user.encode_user`` for each user on the chosen task runner — threads in this
process, or Ray (a local instance, or a cluster at ``ray_address`` listed in
``INFERSCALE_RAY_ADDRESSES``) with one GPU per task when the cluster has GPUs — bounded
by the Prefect global concurrency limit ``inferscale-compute``; a user's failure is
recorded and the others go on.
:func:`finish` turns the outcomes into the run's markdown summary (an artifact per
flow key) and the flow's return value, or a Failed state carrying it in a
:class:`~flows.results.UsersFailed` when users failed (the run then ends Failed, after
every other user finished).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Literal

from prefect import get_client, get_run_logger
from prefect.artifacts import (
    create_markdown_artifact, create_progress_artifact, update_progress_artifact,
)
from prefect.futures import as_completed

from flows.results import failed_run
from inferscale.artifacts.lineage_view import artifact_key
from inferscale.facts.extractor import FactsConfig
from inferscale.ingest.logs import IngestResult, sample_conversations
from inferscale.pipeline.config import PipelineConfig, configs_from_settings
from inferscale.pipeline.report import RunReport, UserOutcome
from inferscale.settings import Settings
from tasks.lineage import record_lineage
from tasks.user import COMPUTE_LIMIT, TASK_STEPS, encode_user

RunnerKind = Literal["threads", "ray"]
QUARANTINE_ROWS = 20


@dataclass
class Prepared:
    cfg: PipelineConfig
    facts_cfg: FactsConfig
    ingest: IngestResult
    model_fp: str
    logs: list[str]


def prepare(logs: list[str] | None, *, model: str | None = None, fact_mode: str | None = None,
            artifact_root: str | None = None, window: int | None = None) -> Prepared:
    """Settings with the run's overrides, the logs ingested, the model fingerprinted."""
    from prefect.runtime import flow_run

    settings = Settings()
    cfg, facts_cfg = configs_from_settings(settings, model=model, fact_mode=fact_mode,
                                           artifact_root=artifact_root, window=window)
    logs = list(logs or settings.log_uris or [str(sample_conversations())])
    run_id = flow_run.get_id() or time.strftime("%Y%m%dT%H%M%S")
    quarantine = f"{cfg.artifact_root.rstrip('/')}/quarantine/{run_id}.jsonl"
    ingest = TASK_STEPS.ingest(cfg, logs, quarantine)
    return Prepared(cfg, facts_cfg, ingest, TASK_STEPS.fingerprint(cfg), logs)


def _runner(kind: RunnerKind, max_workers: int, ray_address: str | None):
    if kind == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=max_workers)
    if kind == "ray":
        from prefect_ray.task_runners import RayTaskRunner

        check_ray_address(ray_address, Settings().ray_addresses)
        return RayTaskRunner(address=ray_address, init_kwargs=_ray_init_kwargs(ray_address))
    raise ValueError(f"task_runner must be 'threads' or 'ray', not {kind!r}")


def check_ray_address(address: str | None, allowed: list[str]) -> None:
    """A run may name a local Ray instance (``None``/``"local"``) or a cluster listed in
    ``INFERSCALE_RAY_ADDRESSES``: the tasks' parameters (store options included) go there."""
    if address not in (None, "local") and address not in allowed:
        raise ValueError(f"ray_address {address!r} is not in INFERSCALE_RAY_ADDRESSES: "
                         "refusing to send the run's tasks (and their store credentials) there")


def _ray_init_kwargs(address: str | None) -> dict[str, Any]:
    """Ship this code to the Ray workers (py_modules) and keep them offline. Their
    environment gets the offline switches (``inferscale.settings.OFFLINE_ENV``, as this
    process has them) and the non-secret settings of
    ``inferscale.settings.WORKER_ENV_SETTINGS`` only (no keys, no credentials)."""
    import os

    import flows
    import inferscale
    import storage_schemas
    import tasks
    from inferscale.settings import OFFLINE_ENV, worker_env

    env = {k: os.environ.get(k, v) for k, v in OFFLINE_ENV.items()}
    env.update(worker_env())
    kwargs: dict[str, Any] = {"runtime_env": {
        "py_modules": [os.path.dirname(m.__file__) for m in (inferscale, storage_schemas,
                                                              tasks, flows)],
        "env_vars": env}}
    if address in (None, "local"):
        kwargs.update(include_dashboard=False, log_to_driver=True)
    return kwargs


def _gpu_options(kind: RunnerKind):
    """``remote_options(num_gpus=1)`` on a Ray cluster that has GPUs, else nothing."""
    import contextlib

    if kind != "ray":
        return contextlib.nullcontext(), False
    import ray
    from prefect_ray.context import remote_options

    if ray.cluster_resources().get("GPU", 0) >= 1:
        return remote_options(num_gpus=1), True
    return contextlib.nullcontext(), False


def ensure_compute_limit(limit: int) -> None:
    """Create or resize the global concurrency limit the compute steps take slots from."""
    if limit < 1:
        raise ValueError(f"concurrency_limit must be >= 1, got {limit}")
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(COMPUTE_LIMIT, limit)


def fan_out(prep: Prepared, users: dict[str, str], *, task_runner: RunnerKind = "threads",
            max_workers: int = 2, ray_address: str | None = None,
            concurrency_limit: int = 2) -> list[UserOutcome]:
    """Run ``encode_user`` for each ``user -> reason``; one outcome per user, failures
    included (never raised)."""
    logger = get_run_logger()
    if not users:
        return []
    ensure_compute_limit(concurrency_limit)
    progress = create_progress_artifact(0.0, description=f"users encoded (of {len(users)})")
    outcomes: list[UserOutcome] = []
    with _runner(task_runner, max_workers, ray_address) as runner:
        gpu, on_gpu = _gpu_options(task_runner)
        cfg = replace(prep.cfg, device="cuda", model_dtype="bfloat16") if on_gpu else prep.cfg
        futures = {}
        with gpu:
            for user, reason in sorted(users.items()):
                fut = runner.submit(encode_user, parameters=dict(
                    cfg=cfg, facts_cfg=prep.facts_cfg, user=user,
                    turns=prep.ingest.turns[user], model_fp=prep.model_fp, reason=reason,
                    sources=list(prep.ingest.sources), inputs_at=prep.ingest.read_at))
                futures[fut] = user
        for fut in as_completed(list(futures)):
            user = futures[fut]
            fut.wait()  # the final state, not the API's possibly older view of it
            state = fut.state
            if state.is_completed():
                outcomes.append(UserOutcome(**fut.result()))
            else:
                err = state.result(raise_on_failure=False)
                outcomes.append(UserOutcome.failed(
                    user, users[user], err if isinstance(err, BaseException)
                    else (state.message or state.name), artifact_key(user, prep.model_fp)))
                logger.error("user %s failed: %s", user, outcomes[-1].error)
            update_progress_artifact(progress, 100.0 * len(outcomes) / len(users))
            logger.info("%d/%d users done (%s: %s)", len(outcomes), len(users), user,
                        outcomes[-1].status)
    return outcomes


def record_skipped(prep: Prepared, versions: dict[str, str]) -> None:
    """Make sure users skipped as up to date have their current version recorded."""
    if versions:
        record_lineage(prep.cfg, prep.model_fp, versions, list(prep.ingest.sources))


def finish(title: str, summary_key: str, prep: Prepared, outcomes: list[UserOutcome],
           started: float) -> Any:
    """Markdown summary artifact; the report dict, or a Failed state carrying it
    (:func:`flows.results.failed_run`)."""
    ing = prep.ingest
    report = RunReport(title, prep.model_fp, outcomes, ing.counts, ing.quarantine_uri,
                       time.perf_counter() - started)
    md = report.markdown()
    if ing.quarantined:
        md += ("\n## Quarantined records\n\n| source | location | reason | detail |\n"
               "|---|---|---|---|\n")
        for q in ing.quarantined[:QUARANTINE_ROWS]:
            md += f"| {q.source} | {q.location} | {q.reason} | {_cell(q.detail)} |\n"
        if len(ing.quarantined) > QUARANTINE_ROWS:
            md += f"\n… and {len(ing.quarantined) - QUARANTINE_ROWS} more in " \
                  f"`{ing.quarantine_uri}`\n"
    create_markdown_artifact(md, key=summary_key, description=title)
    result = report.to_dict()
    if report.failed:
        names = ", ".join(o.user for o in report.failed[:10])
        return failed_run(f"{len(report.failed)} of {len(outcomes)} users failed: {names}",
                          result)
    return result


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")[:160]
