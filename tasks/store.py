"""Reads of the artifact store that decide what to encode (I/O, retried)."""

from __future__ import annotations

from prefect import get_run_logger, task

from inferscale.artifacts.staleness import UserPlan, plan_users
from inferscale.pipeline.config import PipelineConfig
from inferscale.pipeline.steps import read_latest as latest_of
from tasks.policy import IO_RETRIES


@task(name="plan-users", persist_result=False, **IO_RETRIES)
def plan(cfg: PipelineConfig, model_fp: str, log_hashes: dict[str, str]) -> dict[str, UserPlan]:
    """``user -> UserPlan`` (:mod:`inferscale.artifacts.staleness`) for the users of
    ``log_hashes`` (user -> current turns hash), for this run's encoding identity."""
    plans = plan_users(cfg.store(), cfg.identity(model_fp), log_hashes)
    todo = sorted(u for u, p in plans.items() if p.needs_encoding)
    get_run_logger().info("%d of %d users need encoding for model %s: %s", len(todo),
                          len(plans), model_fp[:12], todo[:20])
    return plans


@task(name="read-latest", task_run_name="read-latest-{user}", persist_result=False,
      **IO_RETRIES)
def read_latest(cfg: PipelineConfig, user: str, model_fp: str) -> str | None:
    """:func:`inferscale.pipeline.steps.read_latest`, retried on transient I/O errors."""
    return latest_of(cfg, user, model_fp)
