"""EngineConfig: validation and the engine arguments it gives vLLM (no engine started;
the engine itself is exercised by tests/vllm_plugin/test_connector.py and test_app.py)."""

import pytest

from inferscale.serve.engine import EngineConfig


def test_kv_cache_size_passes_to_vllm_and_is_validated(tmp_path):
    cfg = EngineConfig(model=str(tmp_path), model_fingerprint="fp", kv_cache_memory_bytes=3 << 30)
    args = cfg.engine_args()
    assert args.kv_cache_memory_bytes == 3 << 30
    assert args.kv_transfer_config.kv_connector_module_path == "inferscale.vllm_plugin.connector"
    assert EngineConfig(model=str(tmp_path), model_fingerprint="fp").engine_args() \
        .kv_cache_memory_bytes is None  # sized by gpu_memory_utilization
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        EngineConfig(model="/m", model_fingerprint="fp", kv_cache_memory_bytes=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model="/m", model_fingerprint="fp", gpu_memory_utilization=1.5)
