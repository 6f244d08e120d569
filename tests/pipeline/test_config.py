"""What an offline run derives from the settings: the stored K/V dtype "auto" (the
default) is fp8 where the encoding runs on CUDA and bfloat16 on the CPU; an explicit
dtype is kept wherever the run is."""

from __future__ import annotations

import pytest

from inferscale.pipeline.config import PipelineConfig
from inferscale.settings import Settings


@pytest.mark.parametrize("device, dtype, model_dtype", [
    ("cuda", "float8_e4m3fn", "bfloat16"), ("cuda:1", "float8_e4m3fn", "bfloat16"),
    ("cpu", "bfloat16", "float32")])
def test_auto_is_fp8_on_cuda_and_bf16_on_the_cpu(tmp_path, device, dtype, model_dtype):
    settings = Settings(home=tmp_path, device=device)
    assert settings.kv_dtype == "auto"
    cfg = PipelineConfig.from_settings(settings)
    assert (cfg.encoder.dtype, cfg.model_dtype) == (dtype, model_dtype)


@pytest.mark.parametrize("explicit", ["bfloat16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_an_explicit_dtype_is_kept(tmp_path, explicit, device):
    settings = Settings(home=tmp_path, device=device, kv_dtype=explicit)
    assert PipelineConfig.from_settings(settings).encoder.dtype == explicit


def test_an_unknown_dtype_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSCALE_KV_DTYPE", "int8")
    with pytest.raises(ValueError, match="kv_dtype"):
        Settings(home=tmp_path)
