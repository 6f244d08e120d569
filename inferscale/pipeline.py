"""The offline pipeline, step by step: logs -> facts -> pre-RoPE KV -> published artifact.

Each step is a plain function so that the CLI (``inferscale encode``) can run the whole
chain in one process and the Prefect tasks in ``tasks/`` can wrap, cache and retry each
step on its own. Nothing here imports Prefect.

Callers: ``inferscale.cli`` and ``tasks/``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from inferscale.encode.encoder import EncoderConfig, FactSpec, TurnText, encode_facts

log = logging.getLogger("inferscale.pipeline")


@dataclass(frozen=True)
class PipelineConfig:
    """Everything a run needs, derived once from :class:`~inferscale.settings.Settings`."""

    home: Path
    model: str
    device: str
    model_dtype: str
    encoder: EncoderConfig
    artifact_root: str
    storage_options: dict
    keep_versions: int = 5

    @classmethod
    def from_settings(cls, settings: Any, **overrides: Any) -> "PipelineConfig":
        import torch

        device = settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        kw: dict[str, Any] = dict(
            home=Path(settings.home), model=settings.model, device=device,
            model_dtype="bfloat16" if device.startswith("cuda") else "float32",
            encoder=EncoderConfig(window=settings.window, dtype=settings.kv_dtype,
                                  max_fact_tokens=settings.max_fact_tokens,
                                  max_window_tokens=settings.max_window_tokens,
                                  batch_tokens=settings.encode_batch_tokens,
                                  context=settings.encoder_context,
                                  memory_order=settings.memory_order,
                                  text_tail=settings.text_tail,
                                  batch_invariant=settings.encode_batch_invariant),
            artifact_root=settings.resolved_artifact_root(),
            storage_options=settings.storage_options(),
        )
        kw.update(overrides)
        return cls(**kw)

    def store(self):
        from inferscale.artifacts.layout import StoreConfig

        return StoreConfig(self.artifact_root, dict(self.storage_options))


def configs_from_settings(settings: Any, *, model: str | None = None,
                          fact_mode: str | None = None, artifact_root: str | None = None,
                          window: int | None = None) -> tuple[PipelineConfig, Any]:
    """(PipelineConfig, FactsConfig) from settings, with a flow's parameter overrides.

    ``model`` changes the model whose KV is encoded (a backfill onto a new model); the
    LLM that extracts facts stays the configured one, so facts keep their text.
    Callers: the flows in ``flows/``, the demo.
    """
    from inferscale.facts.extractor import FactsConfig

    overrides = {k: v for k, v in dict(model=model, fact_mode=fact_mode,
                                        artifact_root=artifact_root, window=window).items()
                 if v is not None}
    effective = settings.model_copy(update=overrides) if overrides else settings
    facts_cfg = FactsConfig.from_settings(effective, llm_checkpoint=settings.model)
    return PipelineConfig.from_settings(effective), facts_cfg


_MODELS: dict[tuple, Any] = {}
_FINGERPRINTS: dict[tuple, str] = {}
_LOCK = threading.Lock()  # model loading and fingerprints
_FACTS_LOCK = threading.Lock()  # the shared fact extractors (Mem0 is not thread-safe)


def serving_model(cfg: PipelineConfig):
    """The serving model (and tokenizer, fingerprint), loaded once per process."""
    from inferscale.encode.models import load_model

    key = (cfg.model, cfg.device, cfg.model_dtype)
    with _LOCK:
        if key not in _MODELS:
            _MODELS[key] = load_model(cfg.model, cfg.home, device=cfg.device,
                                      dtype=cfg.model_dtype)
        return _MODELS[key]


def model_fingerprint(cfg: PipelineConfig) -> str:
    """The serving model's fingerprint without loading it (the embedded model is
    converted on first use; weight digests are cached under ``{home}/fingerprints``)."""
    from inferscale.encode.models import checkpoint_fingerprint, resolve_checkpoint

    key = (cfg.model, str(cfg.home))
    with _LOCK:
        if key not in _FINGERPRINTS:
            ckpt = resolve_checkpoint(cfg.model, cfg.home)
            _FINGERPRINTS[key] = checkpoint_fingerprint(ckpt, cfg.home)
        return _FINGERPRINTS[key]


_EXTRACTORS: dict[Any, Any] = {}
_EXIT = contextlib.ExitStack()
atexit.register(_EXIT.close)


def extract_user_facts(cfg: PipelineConfig, facts_cfg: Any, turns: pa.Table):
    """One user's facts (:class:`~inferscale.facts.extractor.FactsResult`) with this process's
    extractor: Mem0 (and the local LLM server in mem0 mode) is opened once per process
    and closed at exit; extractions in one process run one at a time."""
    from inferscale.facts.extractor import FactExtractor

    tokenizer = serving_model(cfg).tokenizer
    key = json.dumps(asdict(facts_cfg), sort_keys=True, default=str)
    with _FACTS_LOCK:
        ex = _EXTRACTORS.get(key)
        if ex is None:
            ex = _EXTRACTORS[key] = _EXIT.enter_context(FactExtractor.open(facts_cfg, cfg.home))
        return ex.extract_user(turns, tokenizer)


def compact(encoded: Any) -> Any:
    """The encoder's output with every chunk's K/V copied out of the batch tensors it
    views, so that a cached task result holds the chunks, not the batches."""
    chunks = [replace(c, keys=c.keys.clone(), values=c.values.clone()) for c in encoded.chunks]
    return replace(encoded, chunks=chunks)


def expected_version(cfg: PipelineConfig, user: str, log_hash: str, facts_hash: str,
                     model_fp: str) -> str:
    """The version id that publishing these inputs yields (without encoding them)."""
    from inferscale.artifacts.publish import Lineage, version_id

    return version_id(user, Lineage(log_hash, facts_hash), model_fp,
                      cfg.encoder.identity(cfg.model_dtype, cfg.device))


def facts_identity(facts_cfg: Any) -> dict:
    """The facts settings that decide what extraction yields (a cache key's part): the
    mode, the embedder and the limits; in mem0 mode also the LLM and its prompting.
    Where Mem0 keeps its scratch and the API key do not change the facts."""
    ident = {"mode": facts_cfg.mode, "embedder": facts_cfg.embedder_id(),
             "max_facts_per_turn": facts_cfg.max_facts_per_turn,
             "max_fact_tokens": facts_cfg.max_fact_tokens}
    if facts_cfg.mode == "mem0":
        ident.update({k: getattr(facts_cfg, k) for k in (
            "llm_base_url", "llm_model", "llm_checkpoint", "prompt_style", "guided",
            "llm_max_tokens", "llm_temperature", "repetition_penalty", "max_fact_chars",
            "context_messages", "server_dtype")})
    return ident


def encode_identity(cfg: PipelineConfig) -> dict:
    """What decides the encoder's KV bits besides its inputs: the encoder config and the
    dtype and device kind the model computes in."""
    return {"encoder": cfg.encoder.to_dict(), "model_dtype": cfg.model_dtype,
            "device": cfg.device.split(":")[0]}


def log_storage_options(cfg: PipelineConfig, uris: list[str]) -> dict:
    """fsspec options for reading logs: the store's (S3) options for remote URIs."""
    import fsspec

    remote = any(fsspec.core.split_protocol(u)[0] not in (None, "file", "local") for u in uris)
    return dict(cfg.storage_options) if remote else {}


def turns_and_facts(turns: pa.Table, facts: pa.Table) -> tuple[list[TurnText], list[FactSpec]]:
    """Encoder inputs from a user's turns table and facts table (stored token ids kept)."""
    rows = turns.sort_by("turn_index").to_pylist()
    index_of = {r["turn_index"]: i for i, r in enumerate(rows)}
    turn_texts = [TurnText(r["speaker"], r["text"], r["timestamp"]) for r in rows]
    specs = [FactSpec(f["fact_id"], f["text"], index_of[f["source_index"]], tuple(f["token_ids"]))
             for f in facts.select(["fact_id", "text", "source_index", "token_ids"]).to_pylist()]
    return turn_texts, specs


def encode_user_kv(cfg: PipelineConfig, turns: pa.Table, facts: pa.Table, progress: bool = True,
                   *, user: str | None = None, previous: str | None = None):
    """One user's facts -> their pre-RoPE KV (:class:`~inferscale.encode.encoder.EncodedMemory`)
    with the serving model: the encode step only (``tasks.user.encode_user`` runs the
    whole chain: facts -> KV -> publish -> lineage).

    ``previous``: a published version of ``user`` (or ``"latest"``: the one ``LATEST``
    names, if any) whose K/V rows are reused for every fact with the same content key;
    only the other facts are encoded (the result is byte-identical to encoding them all)."""
    model = serving_model(cfg)
    turn_texts, specs = turns_and_facts(turns, facts)
    reuse = None
    if previous is not None and cfg.encoder.batch_invariant:
        if user is None:
            raise ValueError("encode_user_kv: previous needs the user it belongs to")
        reuse = previous_kv(cfg, user, model.fingerprint, previous)
    return encode_facts(model.model, model.tokenizer, turn_texts, specs, cfg.encoder,
                        model.fingerprint, progress=progress, reuse=reuse)


def previous_kv(cfg: PipelineConfig, user: str, model_fp: str, version: str) -> dict | None:
    """``content key -> (K, V)`` of a published version (``"latest"``: ``LATEST``'s), read
    and checksum-verified (a memory map of a local file; S3 is read into memory), or None
    when there is none or it cannot be read: then every fact is encoded (a warning says
    why when a version was there)."""
    from inferscale.artifacts.layout import ArtifactError
    from inferscale.artifacts.read import latest_version
    from inferscale.hydrate.slab import hydrate

    try:
        if version == "latest":
            version = latest_version(cfg.store(), user, model_fp)
            if version is None:
                return None
        hydrated = hydrate(cfg.store(), user, model_fp, version, tier="host", device="cpu")
    except ArtifactError as exc:
        log.warning("user %s: previous version %s unreadable, encoding every fact: %s",
                    user, version, exc)
        return None
    return hydrated.kv_by_content_key()


def publish_user(cfg: PipelineConfig, user: str, encoded: Any, facts: pa.Table, log_hash: str,
                 facts_hash: str, inputs_at: Any = None):
    """Publish a version (a no-op returning the existing one when inputs are unchanged).
    ``inputs_at``: when the logs were read (``IngestResult.read_at``): LATEST names the
    publish of the newest inputs when runs race (:mod:`inferscale.artifacts.latest`)."""
    from inferscale.artifacts.publish import Lineage, publish

    return publish(cfg.store(), user, encoded, facts, Lineage(log_hash, facts_hash),
                   keep=cfg.keep_versions, inputs_at=inputs_at)


def run(cfg: PipelineConfig, facts_cfg: Any, logs: str | list[str],
        users: list[str] | None = None, quarantine_uri: str | None = None,
        progress: bool = True) -> dict:
    """The whole chain in this process (what ``inferscale encode`` runs)."""
    from inferscale.facts.extractor import extract_facts
    from inferscale.ingest.logs import read_logs, turns_hash

    ingest = read_logs(logs, quarantine_uri=quarantine_uri)
    selected = {u: t for u, t in ingest.turns.items() if users is None or u in users}
    missing = sorted(set(users or []) - set(selected))
    if missing:
        raise ValueError(f"no turns for users {missing} in {logs}")
    tokenizer = serving_model(cfg).tokenizer
    facts = extract_facts(selected, tokenizer, facts_cfg, home=cfg.home)
    published = {}
    for user, turns in selected.items():
        fr = facts[user]
        encoded = encode_user_kv(cfg, turns, fr.table, progress, user=user, previous="latest")
        res = publish_user(cfg, user, encoded, fr.table, turns_hash(turns), fr.facts_hash,
                           ingest.read_at)
        published[user] = {"version": res.version, "created": res.created,
                           "facts": fr.table.num_rows, "turns": turns.num_rows,
                           "reused": encoded.stats.get("reused"),
                           "encoded": encoded.stats.get("encoded"),
                           "kv_bytes": res.manifest.files["kv.arrow"].bytes}
        log.info("user %s: version %s (%s)", user, res.version,
                 "new" if res.created else "unchanged")
    return {"ingest": ingest.counts, "users": published}
