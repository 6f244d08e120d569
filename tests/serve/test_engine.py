"""EngineConfig: validation and the engine arguments it gives vLLM (no engine started;
the engine itself is exercised by tests/vllm_plugin/test_connector.py and test_app.py)."""

import pytest

from inferscale.serve.engine import EngineConfig
from inferscale.vllm_plugin.config import ConnectorConfig


def test_kv_cache_size_passes_to_vllm_and_is_validated(tmp_path):
    cfg = EngineConfig.of(model=str(tmp_path), model_fingerprint="fp",
                          kv_cache_memory_bytes=3 << 30, fetch_tokens=123)
    assert cfg.connector == ConnectorConfig("fp", fetch_tokens=123)
    args = cfg.engine_args()
    assert args.kv_cache_memory_bytes == 3 << 30
    assert "compilation_config" not in vars(args) or not args.compilation_config or \
        cfg.enforce_eager  # eager (the default here): no CUDA graphs to size
    graphs = EngineConfig.of(model=str(tmp_path), model_fingerprint="fp", enforce_eager=False,
                             cudagraph_max_tokens=768).engine_args()
    assert graphs.compilation_config.max_cudagraph_capture_size == 768
    assert args.kv_transfer_config.kv_connector_module_path == "inferscale.vllm_plugin.connector"
    # every connector setting travels, and only there
    assert ConnectorConfig.from_extra_config(
        args.kv_transfer_config.kv_connector_extra_config) == cfg.connector
    assert EngineConfig.of(model=str(tmp_path), model_fingerprint="fp").engine_args() \
        .kv_cache_memory_bytes is None  # sized by gpu_memory_utilization
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        EngineConfig.of(model="/m", model_fingerprint="fp", kv_cache_memory_bytes=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig.of(model="/m", model_fingerprint="fp", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        EngineConfig.of(model="/m", model_fingerprint="fp", no_such_setting=1)
