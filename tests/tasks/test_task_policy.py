"""Retries: I/O tasks retry transient errors only; compute tasks never retry."""

from __future__ import annotations

import errno

import pytest


def test_transient_classification():
    import botocore.exceptions
    import httpx

    from inferscale.artifacts.layout import ArtifactNotFound, ChecksumError, TruncatedArtifact
    from inferscale.serve.admin_client import AdminError
    from tasks.policy import is_transient

    transient = [ConnectionResetError(), TimeoutError(), OSError("S3 503 SlowDown"),
                 OSError(errno.ECONNRESET, "reset"), httpx.ConnectError("refused"),
                 httpx.ReadTimeout("slow"), AdminError("busy", status=503, transient=True),
                 botocore.exceptions.EndpointConnectionError(endpoint_url="http://x")]
    permanent = [FileNotFoundError("gone"), PermissionError("no"), NotADirectoryError("file"),
                 OSError(errno.ENOSPC, "disk full"), ValueError("bad input"),
                 AdminError("unknown user", status=404), ArtifactNotFound("no LATEST"),
                 ChecksumError("damaged"), TruncatedArtifact("short"), RuntimeError("bug")]
    assert [is_transient(e) for e in transient] == [True] * len(transient)
    assert [is_transient(e) for e in permanent] == [False] * len(permanent)


def test_io_tasks_retry_compute_tasks_do_not():
    from tasks.encode import encode_kv
    from tasks.facts import extract_facts
    from tasks.ingest import ingest_logs
    from tasks.lineage import record_lineage
    from tasks.policy import retry_transient
    from tasks.publish import publish_version
    from tasks.serving import hydrate_user
    from tasks.store import plan, read_latest

    for t in (ingest_logs, publish_version, hydrate_user, record_lineage, plan, read_latest):
        assert t.retries == 3 and t.retry_condition_fn is retry_transient, t.name
    for t in (extract_facts, encode_kv):
        assert t.retries == 0 and t.retry_condition_fn is None, t.name


@pytest.mark.slow
def test_retry_condition_on_a_real_run(prefect_server):
    """On the real engine: a transient error is retried until it succeeds; a permanent
    one fails at once."""
    from prefect import flow, task

    from tasks.policy import IO_RETRIES

    calls = {"flaky": 0, "broken": 0}

    @task(**{**IO_RETRIES, "retry_delay_seconds": 0})
    def flaky():
        calls["flaky"] += 1
        if calls["flaky"] < 3:
            raise ConnectionResetError("peer reset")
        return "ok"

    @task(**{**IO_RETRIES, "retry_delay_seconds": 0})
    def broken():
        calls["broken"] += 1
        raise FileNotFoundError("s3://bucket/logs/missing.jsonl")

    @flow
    def both():
        return flaky(), broken(return_state=True)

    ok, state = both()
    assert ok == "ok" and calls["flaky"] == 3
    assert state.is_failed() and calls["broken"] == 1
