"""Reads of the artifact store that decide what to encode (I/O, retried)."""

from __future__ import annotations

from prefect import get_run_logger, task

from inferscale.artifacts.read import latest_version
from inferscale.artifacts.staleness import UserPlan, plan_users
from inferscale.pipeline import PipelineConfig
from tasks.policy import IO_RETRIES


@task(name="plan-users", persist_result=False, **IO_RETRIES)
def plan(cfg: PipelineConfig, model_fp: str, log_hashes: dict[str, str]) -> dict[str, UserPlan]:
    """``user -> UserPlan`` (:mod:`inferscale.artifacts.staleness`) for the users of ``log_hashes``
    (user -> current turns hash). Called by the nightly and backfill flows."""
    plans = plan_users(cfg.store(), model_fp, cfg.encoder.to_dict(), log_hashes)
    todo = sorted(u for u, p in plans.items() if p.needs_encoding)
    get_run_logger().info("%d of %d users need encoding for model %s: %s", len(todo),
                          len(plans), model_fp[:12], todo[:20])
    return plans


@task(name="read-latest", task_run_name="read-latest-{user}", persist_result=False,
      **IO_RETRIES)
def read_latest(cfg: PipelineConfig, user: str, model_fp: str) -> str | None:
    """The version ``LATEST`` names for (user, model), or None. Called by
    ``tasks.user.encode_user`` to skip encoding when LATEST already is the target."""
    return latest_version(cfg.store(), user, model_fp)
