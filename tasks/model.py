"""The serving model's fingerprint: which model the KV is encoded for."""

from __future__ import annotations

from prefect import task

from inferscale.pipeline import PipelineConfig, model_fingerprint


@task(name="resolve-model", persist_result=False)
def resolve_model(cfg: PipelineConfig) -> str:
    """Fingerprint of ``cfg.model`` (weights, tokenizer, rotary config); the embedded model
    is converted on first use. Called once per flow run, before planning and fan-out."""
    return model_fingerprint(cfg)
