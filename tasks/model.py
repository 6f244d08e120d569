"""The serving model's fingerprint: which model the KV is encoded for."""

from __future__ import annotations

from prefect import task

from inferscale.pipeline.config import PipelineConfig
from inferscale.pipeline.steps import model_fingerprint


@task(name="resolve-model", persist_result=False)
def resolve_model(cfg: PipelineConfig) -> str:
    """:func:`inferscale.pipeline.steps.model_fingerprint` (the embedded model is
    converted on first use)."""
    return model_fingerprint(cfg)
