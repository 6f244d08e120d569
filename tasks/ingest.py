"""Read conversation logs into per-user turn tables; quarantine bad records."""

from __future__ import annotations

from prefect import get_run_logger, task

from inferscale.ingest.logs import IngestResult, read_logs, write_quarantine
from inferscale.pipeline import PipelineConfig, log_storage_options
from tasks.policy import IO_RETRIES


@task(name="ingest-logs", persist_result=False, **IO_RETRIES)
def ingest_logs(cfg: PipelineConfig, logs: list[str], quarantine_uri: str | None) -> IngestResult:
    """Read ``logs`` (fsspec URIs or globs); write quarantined records as JSONL to
    ``quarantine_uri`` (with the artifact store's options) when there are any.

    Called once per flow run by the encode, nightly and backfill flows.
    """
    result = read_logs(logs, storage_options=log_storage_options(cfg, logs))
    logger = get_run_logger()
    counts = result.counts
    logger.info("logs: %d records read, %d turns kept for %d users, %d quarantined %s",
                counts["records_read"], counts["turns_kept"], counts["users"],
                counts["quarantined"], counts["reasons"] or "")
    if result.quarantined and quarantine_uri:
        opts = log_storage_options(cfg, [quarantine_uri])
        write_quarantine(result.quarantined, quarantine_uri, storage_options=opts)
        result.quarantine_uri = quarantine_uri
        logger.warning("%d bad records quarantined to %s", len(result.quarantined),
                       quarantine_uri)
    return result
