"""The offline pipeline, step by step: logs -> facts -> pre-RoPE KV -> published artifact.

Each step is a plain function so that the CLI (``inferscale encode``) can run the whole
chain in one process and the Prefect tasks in ``tasks/`` can wrap, cache and retry each
step on its own. Nothing here imports Prefect.

Callers: ``inferscale.cli`` and ``tasks/``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from inferscale.encode import EncoderConfig, FactSpec, TurnText, encode_facts

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
                                  batch_tokens=settings.encode_batch_tokens),
            artifact_root=settings.resolved_artifact_root(),
            storage_options=settings.storage_options(),
        )
        kw.update(overrides)
        return cls(**kw)

    def store(self):
        from inferscale.store import StoreConfig

        return StoreConfig(self.artifact_root, dict(self.storage_options))


_MODELS: dict[tuple, Any] = {}


def serving_model(cfg: PipelineConfig):
    """The serving model (and tokenizer, fingerprint), loaded once per process."""
    from inferscale.models import load_model

    key = (cfg.model, cfg.device, cfg.model_dtype)
    if key not in _MODELS:
        _MODELS[key] = load_model(cfg.model, cfg.home, device=cfg.device, dtype=cfg.model_dtype)
    return _MODELS[key]


def turns_and_facts(turns: pa.Table, facts: pa.Table) -> tuple[list[TurnText], list[FactSpec]]:
    """Encoder inputs from a user's turns table and facts table (stored token ids kept)."""
    rows = turns.sort_by("turn_index").to_pylist()
    index_of = {r["turn_index"]: i for i, r in enumerate(rows)}
    turn_texts = [TurnText(r["speaker"], r["text"]) for r in rows]
    specs = [FactSpec(f["fact_id"], f["text"], index_of[f["source_index"]], tuple(f["token_ids"]))
             for f in facts.select(["fact_id", "text", "source_index", "token_ids"]).to_pylist()]
    return turn_texts, specs


def encode_user(cfg: PipelineConfig, turns: pa.Table, facts: pa.Table, progress: bool = True):
    """One user's facts -> :class:`~inferscale.encode.EncodedMemory` with the serving model."""
    model = serving_model(cfg)
    turn_texts, specs = turns_and_facts(turns, facts)
    return encode_facts(model.model, model.tokenizer, turn_texts, specs, cfg.encoder,
                        model.fingerprint, progress=progress)


def publish_user(cfg: PipelineConfig, user: str, encoded: Any, facts: pa.Table, log_hash: str,
                 facts_hash: str):
    """Publish a version (a no-op returning the existing one when inputs are unchanged)."""
    from inferscale.artifacts import Lineage, publish

    return publish(cfg.store(), user, encoded, facts, Lineage(log_hash, facts_hash),
                   keep=cfg.keep_versions)


def run(cfg: PipelineConfig, facts_cfg: Any, logs: str | list[str],
        users: list[str] | None = None, quarantine_uri: str | None = None,
        progress: bool = True) -> dict:
    """The whole chain in this process (what ``inferscale encode`` runs)."""
    from inferscale.facts import extract_facts
    from inferscale.logs import read_logs, turns_hash

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
        encoded = encode_user(cfg, turns, fr.table, progress)
        res = publish_user(cfg, user, encoded, fr.table, turns_hash(turns), fr.facts_hash)
        published[user] = {"version": res.version, "created": res.created,
                           "facts": fr.table.num_rows, "turns": turns.num_rows,
                           "kv_bytes": res.manifest.files["kv.arrow"].bytes}
        log.info("user %s: version %s (%s)", user, res.version,
                 "new" if res.created else "unchanged")
    return {"ingest": ingest.counts, "users": published}
