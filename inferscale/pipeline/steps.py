"""The steps of the offline chain, each a plain function of its inputs.

A step's parameters are the task's parameters: ``tasks/`` wraps each one as a Prefect
task with the same signature (retries for I/O, a content-hash cache for compute), and
:mod:`inferscale.pipeline.chain` calls either form. The serving model and the fact
extractors (Mem0, and the local LLM server in mem0 mode) are opened once per process
and closed at exit; extractions in one process run one at a time (Mem0 is not
thread-safe).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import threading
from dataclasses import asdict, replace
from datetime import datetime
from typing import Mapping, Sequence

import pyarrow as pa

from inferscale.artifacts.layout import ArtifactError
from inferscale.artifacts.publish import Lineage, PublishResult, publish, version_id
from inferscale.artifacts.read import latest_version, read_kv_rows, read_manifest
from inferscale.encode.encoder import EncodedMemory, FactSpec, TurnText, encode_facts
from inferscale.encode.identity import EncodingIdentity, RunIdentity
from inferscale.facts.extractor import FactExtractor, FactsConfig, FactsResult
from inferscale.ingest.logs import IngestResult, read_logs, write_quarantine
from inferscale.models import LoadedModel
from inferscale.pipeline.config import PipelineConfig
from inferscale.types import ChunkKV, KVGeometry

log = logging.getLogger("inferscale.pipeline")

_MODELS: dict[tuple, LoadedModel] = {}
_FINGERPRINTS: dict[tuple, tuple[str, KVGeometry]] = {}
_LOCK = threading.Lock()  # model loading and fingerprints
_FACTS_LOCK = threading.Lock()  # the shared fact extractors
_EXTRACTORS: dict[str, FactExtractor] = {}
_EXIT = contextlib.ExitStack()
atexit.register(_EXIT.close)


def serving_model(cfg: PipelineConfig) -> LoadedModel:
    """The serving model (and tokenizer, fingerprint), loaded once per process."""
    from inferscale.models import load_model

    key = (cfg.model, cfg.device, cfg.model_dtype)
    with _LOCK:
        if key not in _MODELS:
            _MODELS[key] = load_model(cfg.model, cfg.home, device=cfg.device,
                                      dtype=cfg.model_dtype)
        return _MODELS[key]


def model_fingerprint(cfg: PipelineConfig) -> str:
    """The serving model's fingerprint without loading it (the embedded model is
    converted on first use; weight digests are cached under ``{home}/fingerprints``)."""
    return _checkpoint_identity(cfg)[0]


def model_geometry(cfg: PipelineConfig) -> KVGeometry:
    """The serving model's KV geometry, from its checkpoint's config (not loaded)."""
    return _checkpoint_identity(cfg)[1]


def _checkpoint_identity(cfg: PipelineConfig) -> tuple[str, KVGeometry]:
    from inferscale.models import checkpoint_fingerprint, checkpoint_geometry, resolve_checkpoint

    key = (cfg.model, str(cfg.home))
    with _LOCK:
        if key not in _FINGERPRINTS:
            ckpt = resolve_checkpoint(cfg.model, cfg.home)
            _FINGERPRINTS[key] = (checkpoint_fingerprint(ckpt, cfg.home),
                                  checkpoint_geometry(ckpt))
        return _FINGERPRINTS[key]


def ingest_logs(cfg: PipelineConfig, logs: list[str],
                quarantine_uri: str | None) -> IngestResult:
    """Read ``logs`` (fsspec URIs or globs, with the store's options when remote); write
    the quarantined records as JSONL to ``quarantine_uri`` when there are any."""
    result = read_logs(logs, storage_options=cfg.storage_options_for(logs))
    if result.quarantined and quarantine_uri:
        write_quarantine(result.quarantined, quarantine_uri,
                         storage_options=cfg.storage_options_for([quarantine_uri]))
        result.quarantine_uri = quarantine_uri
    return result


def extract_user_facts(cfg: PipelineConfig, facts_cfg: FactsConfig, user: str,
                       turns: pa.Table, model_fp: str) -> FactsResult:
    """``user``'s facts from their turns, with token ids of the serving model, whose
    fingerprint must be ``model_fp``."""
    model = serving_model(cfg)
    _check_fingerprint(model, model_fp)
    key = json.dumps(asdict(facts_cfg), sort_keys=True, default=str)
    with _FACTS_LOCK:
        ex = _EXTRACTORS.get(key)
        if ex is None:
            ex = _EXTRACTORS[key] = _EXIT.enter_context(FactExtractor.open(facts_cfg, cfg.home))
        result = ex.extract_user(turns, model.tokenizer)
    if result.user != user:
        raise ValueError(f"the turns are {result.user!r}'s, not {user!r}'s")
    return result


def read_latest(cfg: PipelineConfig, user: str, model_fp: str) -> str | None:
    """The version ``LATEST`` names for (user, model), or None."""
    return latest_version(cfg.store(), user, model_fp)


def expected_version(run: RunIdentity, user: str, log_hash: str, facts_hash: str) -> str:
    """The version id that publishing these inputs in the run ``run`` yields."""
    return version_id(user, Lineage(log_hash, facts_hash), run.model_fingerprint,
                      run.record())


def encode_user_kv(cfg: PipelineConfig, user: str, turns: pa.Table, facts: pa.Table,
                   identity: EncodingIdentity, previous: str | None = None,
                   progress: bool = False) -> EncodedMemory:
    """One user's facts -> their pre-RoPE KV as ``identity`` says, with the serving model
    (whose fingerprint must be the identity's).

    ``previous``: a published version of ``user`` (or ``"latest"``) whose K/V rows are
    reused for every fact with the same content key; only the other facts are encoded
    (the result is byte-identical to encoding them all)."""
    model = serving_model(cfg)
    _check_fingerprint(model, identity.model_fingerprint)
    turn_texts, specs = turns_and_facts(turns, facts)
    reuse = None
    if previous is not None and identity.encoder.batch_invariant:
        reuse = previous_kv(cfg, user, identity.model_fingerprint, previous)
    return encode_facts(model.model, model.tokenizer, turn_texts, specs, identity,
                        progress=progress, reuse=reuse)


def compact(encoded: EncodedMemory) -> EncodedMemory:
    """``encoded`` with every chunk's rows copied out of the batch tensors they view, so
    that a cached result holds the chunks, not the batches."""
    chunks = [replace(c, kv=c.kv.clone()) for c in encoded.chunks]
    return replace(encoded, chunks=chunks)


def publish_user(cfg: PipelineConfig, user: str, encoded: EncodedMemory, facts: pa.Table,
                 log_hash: str, facts_hash: str, run: RunIdentity,
                 inputs_at: datetime | None = None) -> PublishResult:
    """Publish a version (a no-op returning the existing one when inputs are unchanged)
    recorded under ``run``'s record (:meth:`RunIdentity.record`: the version id
    :func:`expected_version` gives). ``inputs_at``: when the logs were read: LATEST names
    the publish of the newest inputs when runs race (:mod:`inferscale.artifacts.latest`).
    The KV must be the serving model's (its fingerprint, and the geometry of its
    checkpoint: publish checks it) and encoded under ``run``'s encoding identity."""
    fp = model_fingerprint(cfg)
    if encoded.model_fingerprint != fp:
        raise RuntimeError(f"the KV was encoded for model {encoded.model_fingerprint}, not "
                           f"the serving model {fp}")
    if dict(encoded.encoder_config) != run.encoding.record():
        raise RuntimeError(f"the KV was encoded as {dict(encoded.encoder_config)}, not as "
                           f"this run encodes ({run.encoding.record()})")
    return publish(cfg.store(), user, replace(encoded, encoder_config=run.record()), facts,
                   Lineage(log_hash, facts_hash), geometry=model_geometry(cfg),
                   keep=cfg.keep_versions, inputs_at=inputs_at)


def record_lineage(cfg: PipelineConfig, model_fp: str, versions: Mapping[str, str],
                   sources: Sequence[str] = ()) -> dict[str, str]:
    """Without an orchestrator a version's lineage is its manifest: log it (parents,
    previous version). Returns no artifact keys (the flows' task records Prefect
    artifacts and returns theirs)."""
    from inferscale.artifacts.read import list_versions

    store = cfg.store()
    for user, version in sorted(versions.items()):
        m = read_manifest(store, user, model_fp, version)
        older = [v.version for v in list_versions(store, user, model_fp)
                 if (v.created, v.version) < (m.created, m.version)]
        log.info("user %s: version %s of model %s, parents log %s facts %s, previous %s, "
                 "from %s", user, version, model_fp[:12], m.parents.get("log", "")[:12],
                 m.parents.get("facts", "")[:12], older[-1] if older else "(none)",
                 ", ".join(sources) or "(unknown logs)")
    return {}


def turns_and_facts(turns: pa.Table, facts: pa.Table) -> tuple[list[TurnText], list[FactSpec]]:
    """Encoder inputs from a user's turns table and facts table (stored token ids kept)."""
    rows = turns.sort_by("turn_index").to_pylist()
    index_of = {r["turn_index"]: i for i, r in enumerate(rows)}
    turn_texts = [TurnText(r["speaker"], r["text"], r["timestamp"]) for r in rows]
    specs = [FactSpec(f["fact_id"], f["text"], index_of[f["source_index"]], tuple(f["token_ids"]))
             for f in facts.select(["fact_id", "text", "source_index", "token_ids"]).to_pylist()]
    return turn_texts, specs


def previous_kv(cfg: PipelineConfig, user: str, model_fp: str,
                version: str) -> dict[str, ChunkKV] | None:
    """``content key -> ChunkKV`` of a published version (``"latest"``: ``LATEST``'s),
    read and checksum-verified (:func:`inferscale.artifacts.read.read_kv_rows`), or None
    when there is none or it cannot be read: then every fact is encoded (a warning says
    why when a version was there)."""
    try:
        if version == "latest":
            version = latest_version(cfg.store(), user, model_fp)
            if version is None:
                return None
        return read_kv_rows(cfg.store(), user, model_fp, version)
    except ArtifactError as exc:
        log.warning("user %s: previous version %s unreadable, encoding every fact: %s",
                    user, version, exc)
        return None


def _check_fingerprint(model: LoadedModel, model_fp: str) -> None:
    if model.fingerprint != model_fp:
        raise RuntimeError(f"the loaded model's fingerprint {model.fingerprint} is not the "
                           f"planned {model_fp} (the checkpoint changed during the run?)")
