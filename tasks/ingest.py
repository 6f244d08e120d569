"""Read conversation logs into per-user turn tables; quarantine bad records."""

from __future__ import annotations

from prefect import get_run_logger, task

from inferscale.ingest.logs import IngestResult
from inferscale.pipeline.config import PipelineConfig
from inferscale.pipeline.steps import ingest_logs as read_and_quarantine
from tasks.policy import IO_RETRIES


@task(name="ingest-logs", persist_result=False, **IO_RETRIES)
def ingest_logs(cfg: PipelineConfig, logs: list[str], quarantine_uri: str | None) -> IngestResult:
    """:func:`inferscale.pipeline.steps.ingest_logs`, retried on transient I/O errors."""
    result = read_and_quarantine(cfg, logs, quarantine_uri)
    logger = get_run_logger()
    counts = result.counts
    logger.info("logs: %d records read, %d turns kept for %d users, %d quarantined %s",
                counts["records_read"], counts["turns_kept"], counts["users"],
                counts["quarantined"], counts["reasons"] or "")
    if result.quarantine_uri:
        logger.warning("%d bad records quarantined to %s", len(result.quarantined),
                       result.quarantine_uri)
    return result
