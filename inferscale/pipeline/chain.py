"""The one orchestration of the offline chain: for each user, facts -> KV -> publish ->
lineage record, with the LATEST check and per-user failure isolation.

:func:`encode_user` is one user's chain. Its steps come from a :class:`Steps`: the plain
functions of :mod:`inferscale.pipeline.steps` (``inferscale encode``), or the same
functions wrapped as Prefect tasks (``tasks/user.py``: caching, retries, a concurrency
slot around the compute steps). When ``LATEST`` already names the version these inputs
make, nothing is encoded or written; otherwise the K/V of every fact unchanged since
``LATEST``'s version is reused and only the rest is encoded. The version id the chain
expects and the one publishing yields derive from one
:class:`~inferscale.encode.identity.RunIdentity` (the facts config and the encoding), so
they cannot differ.

:func:`encode_users` runs users one after another and turns a user's failure into a
``failed`` outcome: the others still get their versions (the flows fan out with Prefect
instead and isolate users the same way). :func:`run` is the whole run from the logs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, ContextManager, Mapping, Sequence

import pyarrow as pa

from inferscale.facts.extractor import FactsConfig
from inferscale.ingest.logs import IngestResult, turns_hash
from inferscale.pipeline import steps as plain
from inferscale.pipeline.config import PipelineConfig
from inferscale.pipeline.report import RunReport, UserOutcome

log = logging.getLogger("inferscale.pipeline")


@dataclass(frozen=True)
class Steps:
    """The chain's steps (signatures of :mod:`inferscale.pipeline.steps`), the context
    the compute steps run in, and where the chain logs."""

    ingest: Callable[..., IngestResult] = plain.ingest_logs
    fingerprint: Callable[..., str] = plain.model_fingerprint
    facts: Callable[..., Any] = plain.extract_user_facts
    latest: Callable[..., str | None] = plain.read_latest
    encode: Callable[..., Any] = plain.encode_user_kv
    publish: Callable[..., Any] = plain.publish_user
    record: Callable[..., Mapping[str, str]] = plain.record_lineage
    compute: Callable[[], ContextManager] = contextlib.nullcontext
    logger: Callable[[], Any] = lambda: log


PLAIN = Steps()


def encode_user(cfg: PipelineConfig, facts_cfg: FactsConfig, user: str, turns: pa.Table,
                model_fp: str, *, steps: Steps = PLAIN, reason: str = "requested",
                sources: Sequence[str] = (), inputs_at: datetime | None = None) -> UserOutcome:
    """Encode and publish ``user`` for ``model_fp``; raises on failure.

    ``reason`` says why the user is encoded (``requested``, ``new``, ``log-changed``...);
    ``sources`` are the log URIs (the lineage's upstream); ``inputs_at`` when they were
    read (LATEST names the newest inputs when runs race). An encode step may mark its
    result ``stats["cached"]`` (it came from a cache: no fact was reused or encoded)."""
    t0 = time.perf_counter()
    logger = steps.logger()
    run = cfg.run_identity(facts_cfg, model_fp)
    log_hash = turns_hash(turns)
    encoded = None
    with steps.compute():
        facts = steps.facts(cfg, facts_cfg, user, turns, model_fp)
        version = plain.expected_version(run, user, log_hash, facts.facts_hash)
        current = steps.latest(cfg, user, model_fp)
        if current != version:
            encoded = steps.encode(cfg, user, turns, facts.table, run.encoding, current)
    status, kv_bytes, reused, n_encoded = "unchanged", None, None, None
    if encoded is None:
        logger.info("user %s: LATEST already names version %s", user, version)
    else:
        reused, n_encoded = encoded.stats.get("reused"), encoded.stats.get("encoded")
        logger.info("user %s: %s", user, "KV from the task cache" if encoded.stats.get("cached")
                    else f"{reused} facts reused from version {current}, {n_encoded} encoded")
        published = steps.publish(cfg, user, encoded, facts.table, log_hash, facts.facts_hash,
                                  run, inputs_at)
        logger.info("user %s: version %s %s", user, published.version,
                    "published" if published.created else "already published")
        if published.latest != published.version:
            logger.warning("user %s: LATEST stays on %s, published from newer inputs", user,
                           published.latest)
        status = "published" if published.created else "unchanged"
        kv_bytes = published.manifest.files["kv.arrow"].bytes
    keys = steps.record(cfg, model_fp, {user: version}, list(sources))
    return UserOutcome(user, status, version, reason, facts=facts.table.num_rows,
                       turns=turns.num_rows, reused=reused, encoded=n_encoded,
                       kv_bytes=kv_bytes, seconds=time.perf_counter() - t0,
                       artifact_key=keys.get(user),
                       worker=f"{socket.gethostname()}:{os.getpid()}")


def encode_users(cfg: PipelineConfig, facts_cfg: FactsConfig, ingest: IngestResult,
                 users: Mapping[str, str], model_fp: str, *,
                 steps: Steps = PLAIN) -> list[UserOutcome]:
    """:func:`encode_user` for each ``user -> reason``, one after another; one outcome per
    user, failures included (logged, never raised)."""
    outcomes = []
    for user, reason in sorted(users.items()):
        try:
            outcomes.append(encode_user(cfg, facts_cfg, user, ingest.turns[user], model_fp,
                                        steps=steps, reason=reason, sources=ingest.sources,
                                        inputs_at=ingest.read_at))
        except Exception as exc:  # noqa: BLE001 - one user's failure is that user's only
            log.error("user %s failed: %s: %s", user, type(exc).__name__, exc)
            outcomes.append(UserOutcome.failed(user, reason, exc))
    return outcomes


def select_users(ingest: IngestResult, users: Sequence[str] | None,
                 reason: str = "requested") -> dict[str, str]:
    """``user -> reason`` for ``users`` (None: every user with valid turns);
    ValueError naming those without valid turns."""
    if users is None:
        return {u: reason for u in sorted(ingest.turns)}
    missing = sorted(set(users) - set(ingest.turns))
    if missing:
        raise ValueError(f"no valid turns for users {missing} in {ingest.sources}")
    return {u: reason for u in users}


def run(cfg: PipelineConfig, facts_cfg: FactsConfig, logs: Sequence[str],
        users: Sequence[str] | None = None, quarantine_uri: str | None = None, *,
        steps: Steps = PLAIN) -> RunReport:
    """Read ``logs``, then :func:`encode_users` (every user, or ``users``)."""
    started = time.perf_counter()
    ingest = steps.ingest(cfg, list(logs), quarantine_uri)
    model_fp = steps.fingerprint(cfg)
    outcomes = encode_users(cfg, facts_cfg, ingest, select_users(ingest, users), model_fp,
                            steps=steps)
    return RunReport("Encode users", model_fp, outcomes, ingest.counts, ingest.quarantine_uri,
                     time.perf_counter() - started)
