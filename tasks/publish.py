"""Publish one user's version to the artifact store (I/O, retried)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pyarrow as pa
from prefect import get_run_logger, task

from inferscale.pipeline import PipelineConfig, publish_user
from tasks.policy import IO_RETRIES


@task(name="publish-version", task_run_name="publish-{user}", persist_result=False,
      **IO_RETRIES)
def publish_version(cfg: PipelineConfig, user: str, encoded: Any, facts: pa.Table,
                    log_hash: str, facts_hash: str,
                    inputs_at: datetime | None = None) -> dict[str, Any]:
    """Publish (content-addressed: unchanged inputs write nothing) and move ``LATEST``
    unless a publish of newer inputs (``inputs_at``: when the logs were read) got there.
    Returns ``version``, ``created``, ``latest``, ``kv_bytes``, ``removed`` (gc'd
    versions). Called by ``tasks.user.encode_user``."""
    res = publish_user(cfg, user, encoded, facts, log_hash, facts_hash, inputs_at)
    logger = get_run_logger()
    logger.info("user %s: version %s %s", user, res.version,
                "published" if res.created else "already published")
    if res.latest != res.version:
        logger.warning("user %s: LATEST stays on %s, published from newer inputs", user,
                       res.latest)
    return {"version": res.version, "created": res.created, "latest": res.latest,
            "kv_bytes": res.manifest.files["kv.arrow"].bytes, "removed": list(res.removed)}
