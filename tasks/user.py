"""One user's whole chain — facts -> KV -> publish -> lineage — the unit flows fan out.

The chain runs in one process (a thread of the flow's process, or a Ray worker), so the
KV never travels between processes: each step is a nested task run with its own cache
or retries. The compute steps hold one slot of the Prefect global concurrency limit
:data:`COMPUTE_LIMIT` (created by the flows), which bounds how many users are extracted
and encoded at once across every run and worker sharing the Prefect server.

When ``LATEST`` already names the version these inputs make (the facts come from the
cache when the turns did not change), nothing is encoded or written. Otherwise the K/V of
every fact unchanged since ``LATEST``'s version is reused from it and only the rest is
encoded (:func:`inferscale.pipeline.encode_user_kv`).
"""

from __future__ import annotations

import os
import socket
import time
from datetime import datetime
from typing import Any, Sequence

import pyarrow as pa
from prefect import get_run_logger, task
from prefect.concurrency.sync import concurrency

from inferscale.artifacts.lineage_view import artifact_key
from inferscale.facts.extractor import FactsConfig
from inferscale.ingest.logs import turns_hash as hash_turns
from inferscale.pipeline import PipelineConfig, expected_version
from inferscale.run_report import UserOutcome
from tasks.encode import encode_kv
from tasks.facts import extract_facts
from tasks.lineage import record_lineage
from tasks.publish import publish_version
from tasks.store import read_latest

COMPUTE_LIMIT = "inferscale-compute"
LEASE_S = 60  # the server's minimum; a killed worker's slots come back after it


@task(name="encode-user", task_run_name="encode-user-{user}", persist_result=False)
def encode_user(cfg: PipelineConfig, facts_cfg: FactsConfig, user: str, turns: pa.Table,
                model_fp: str, reason: str = "requested",
                sources: Sequence[str] = (), inputs_at: datetime | None = None) -> dict[str, Any]:
    """Encode and publish ``user`` for ``model_fp``; returns a
    :class:`~inferscale.run_report.UserOutcome` as a dict. Raises on failure (the flow
    records the user as failed and goes on with the others).

    ``reason`` says why the user is encoded (``requested``, ``new``, ``log-changed``...);
    ``sources`` are the log URIs (the lineage's upstream assets); ``inputs_at`` when they
    were read (LATEST names the newest inputs when runs race). Submitted once per user
    by the encode, nightly and backfill flows.
    """
    t0 = time.perf_counter()
    logger = get_run_logger()
    log_hash = hash_turns(turns)
    with concurrency(COMPUTE_LIMIT, occupy=1, lease_duration=LEASE_S):
        facts = extract_facts(cfg, facts_cfg, user, turns, log_hash, model_fp)
        version = expected_version(cfg, user, log_hash, facts.facts_hash, model_fp)
        current = read_latest(cfg, user, model_fp)
        encoded = None
        if current != version:
            state = encode_kv(cfg, user, turns, facts.table, log_hash, facts.facts_hash,
                              model_fp, previous=current, return_state=True)
            encoded = state.result()
            cached = state.name == "Cached"
    kv_bytes = reused = encoded_facts = None
    if encoded is None:
        status = "unchanged"
        logger.info("user %s: LATEST already names version %s", user, version)
    else:
        # facts whose K/V came from the previous version / a forward pass in this run (a
        # cached KV cost neither)
        reused, encoded_facts = (0, 0) if cached else (encoded.stats["reused"],
                                                       encoded.stats["encoded"])
        logger.info("user %s: %s", user, "KV from the task cache" if cached else
                    f"{reused} facts reused from version {current}, {encoded_facts} encoded")
        published = publish_version(cfg, user, encoded, facts.table, log_hash,
                                    facts.facts_hash, inputs_at)
        if published["version"] != version:
            raise RuntimeError(f"published version {published['version']} differs from the "
                               f"expected {version}: version ids and the encoder disagree")
        status = "published" if published["created"] else "unchanged"
        kv_bytes = published["kv_bytes"]
    record_lineage(cfg, model_fp, {user: version}, list(sources))
    return UserOutcome(user, status, version, reason, facts=facts.table.num_rows,
                       turns=turns.num_rows, reused=reused, encoded=encoded_facts,
                       kv_bytes=kv_bytes,
                       seconds=time.perf_counter() - t0,
                       artifact_key=artifact_key(user, model_fp),
                       worker=f"{socket.gethostname()}:{os.getpid()}").to_dict()
