"""What an offline run needs, derived once from the settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferscale.artifacts.layout import StoreConfig
from inferscale.encode.identity import EncoderConfig, EncodingIdentity, RunIdentity
from inferscale.facts.extractor import FactsConfig


@dataclass(frozen=True)
class PipelineConfig:
    """The serving model and how it runs, the encoder config, the artifact store."""

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
        device = settings.resolved_device()
        kw: dict[str, Any] = dict(
            home=Path(settings.home), model=settings.model, device=device,
            model_dtype="bfloat16" if device.startswith("cuda") else "float32",
            encoder=EncoderConfig(window=settings.window,
                                  dtype=settings.resolved_kv_dtype(device),
                                  max_fact_tokens=settings.max_fact_tokens,
                                  max_window_tokens=settings.max_window_tokens,
                                  batch_tokens=settings.encode_batch_tokens,
                                  context=settings.encoder_context,
                                  memory_order=settings.memory_order,
                                  text_tail=settings.text_tail,
                                  tail_max_k=settings.tail_max_k,
                                  key_calibration=settings.key_calibration,
                                  batch_invariant=settings.encode_batch_invariant),
            artifact_root=settings.resolved_artifact_root(),
            storage_options=settings.storage_options(),
        )
        kw.update(overrides)
        return cls(**kw)

    def store(self) -> StoreConfig:
        return StoreConfig(self.artifact_root, dict(self.storage_options))

    def identity(self, model_fp: str) -> EncodingIdentity:
        """The identity of encoding with this config for the model ``model_fp``: the
        model is loaded in ``model_dtype`` on ``device``, so this is what it computes in."""
        return EncodingIdentity(self.encoder, model_fp, self.model_dtype, self.device)

    def run_identity(self, facts_cfg: FactsConfig, model_fp: str) -> RunIdentity:
        """The identity of a run with this config and ``facts_cfg`` for the model
        ``model_fp``: what its versions' ids, staleness and cache keys derive from."""
        return RunIdentity.of(facts_cfg, self.identity(model_fp))

    def storage_options_for(self, uris: list[str]) -> dict:
        """fsspec options for reading or writing ``uris``: the store's (S3) options when
        any is remote, none for local paths."""
        import fsspec

        remote = any(fsspec.core.split_protocol(u)[0] not in (None, "file", "local")
                     for u in uris)
        return dict(self.storage_options) if remote else {}


def configs_from_settings(settings: Any, *, model: str | None = None,
                          fact_mode: str | None = None, artifact_root: str | None = None,
                          window: int | None = None) -> tuple[PipelineConfig, FactsConfig]:
    """(PipelineConfig, FactsConfig) from settings, with a run's overrides.

    ``model`` changes the model whose KV is encoded (a backfill onto a new model); the
    LLM that extracts facts stays the configured one, so facts keep their text.
    """
    overrides = {k: v for k, v in dict(model=model, fact_mode=fact_mode,
                                        artifact_root=artifact_root, window=window).items()
                 if v is not None}
    effective = settings.model_copy(update=overrides) if overrides else settings
    facts_cfg = FactsConfig.from_settings(effective, llm_checkpoint=settings.model)
    return PipelineConfig.from_settings(effective), facts_cfg
