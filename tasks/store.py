"""Reads of the artifact store that decide what to encode (I/O, retried)."""

from __future__ import annotations

from prefect import get_run_logger, task

from inferscale.facts.extractor import FactsConfig
from inferscale.pipeline.config import PipelineConfig
from inferscale.pipeline.plan import RunPlan, plan_run
from inferscale.pipeline.steps import read_latest as latest_of
from tasks.policy import IO_RETRIES


@task(name="plan-users", persist_result=False, **IO_RETRIES)
def plan(cfg: PipelineConfig, facts_cfg: FactsConfig, model_fp: str,
         log_hashes: dict[str, str]) -> RunPlan:
    """:func:`inferscale.pipeline.plan.plan_run`: which users of ``log_hashes`` (user ->
    current turns hash) this run encodes, skips as up to date, or reports as failed."""
    run_plan = plan_run(cfg, facts_cfg, model_fp, log_hashes)
    todo = list(run_plan.encode)
    get_run_logger().info("%d of %d users need encoding for model %s: %s", len(todo),
                          len(log_hashes), model_fp[:12], todo[:20])
    return run_plan


@task(name="read-latest", task_run_name="read-latest-{user}", persist_result=False,
      **IO_RETRIES)
def read_latest(cfg: PipelineConfig, user: str, model_fp: str) -> str | None:
    """:func:`inferscale.pipeline.steps.read_latest`, retried on transient I/O errors."""
    return latest_of(cfg, user, model_fp)
