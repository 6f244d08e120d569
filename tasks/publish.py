"""Publish one user's version to the artifact store (I/O, retried)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pyarrow as pa
from prefect import task

from inferscale.artifacts.publish import PublishResult
from inferscale.encode.identity import RunIdentity
from inferscale.pipeline.config import PipelineConfig
from inferscale.pipeline.steps import publish_user
from tasks.policy import IO_RETRIES


@task(name="publish-version", task_run_name="publish-{user}", persist_result=False,
      **IO_RETRIES)
def publish_version(cfg: PipelineConfig, user: str, encoded: Any, facts: pa.Table,
                    log_hash: str, facts_hash: str, run: RunIdentity,
                    inputs_at: datetime | None = None) -> PublishResult:
    """:func:`inferscale.pipeline.steps.publish_user` (content-addressed: unchanged inputs
    write nothing), retried on transient I/O errors."""
    return publish_user(cfg, user, encoded, facts, log_hash, facts_hash, run, inputs_at)
