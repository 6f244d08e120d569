"""EngineConfig: validation and the engine arguments it gives vLLM (no engine started;
the engine itself is exercised by tests/vllm_plugin/test_connector.py and test_app.py),
and the scheduling limits of the running engine against ``vllm serve``'s."""

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


def _vllm_serve_scheduler(*argv: str):
    """The scheduler config ``vllm serve ARGV`` starts with: vLLM's own CLI parser, then
    what its serve command does (``AsyncEngineArgs.from_cli_args``, usage context
    OPENAI_API_SERVER)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import make_arg_parser
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(list(argv))
    return AsyncEngineArgs.from_cli_args(args).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER).scheduler_config


def _limits(sched) -> tuple[int, int]:
    return sched.max_num_batched_tokens, sched.max_num_seqs


def test_scheduling_defaults_are_vllm_serves_but_the_token_budget(tmp_path, smollm2):
    """vLLM picks max_num_batched_tokens and max_num_seqs by usage context; on the CPU at
    tensor_parallel_size 2 ``vllm serve`` gets 4096 and 256 where the engine context gets
    2048 and 128 (on an H200: 8192 and 1024 against 2048 and 128). The server takes
    ``vllm serve``'s max_num_seqs and its own token budget, 2048; None: vLLM's."""
    from inferscale.models import write_dummy_checkpoint

    tiny = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
            "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "max_position_embeddings": 8192, "torch_dtype": "float32"}  # TP=2 splits its heads
    ckpt = str(write_dummy_checkpoint(tiny, smollm2.checkpoint, tmp_path / "m"))
    for tp in (1, 2):
        ours, stock = (EngineConfig.of(
            model=ckpt, model_fingerprint="fp", load_format="dummy", max_model_len=2048,
            tensor_parallel_size=tp, **budget).vllm_config().scheduler_config
            for budget in ({}, {"max_num_batched_tokens": None}))
        serve = _vllm_serve_scheduler("--model", ckpt, "--load-format", "dummy",
                                      "--max-model-len", "2048", "--tensor-parallel-size",
                                      str(tp))
        assert _limits(ours) == (2048, serve.max_num_seqs)
        assert _limits(stock) == _limits(serve)
    assert _limits(serve) == (4096, 256)  # the case that tells the usage contexts apart
    fixed = EngineConfig.of(model=ckpt, model_fingerprint="fp", load_format="dummy",
                            max_model_len=2048, max_num_seqs=7).vllm_config()
    assert fixed.scheduler_config.max_num_seqs == 7  # set explicitly: kept
    budget = EngineConfig.of(model=ckpt, model_fingerprint="fp", load_format="dummy",
                             max_model_len=2048, max_num_batched_tokens=1024).vllm_config()
    assert budget.scheduler_config.max_num_batched_tokens == 1024  # the settings' override


def test_running_engine_schedules_as_vllm_serve(engine_env):
    """The real CPU engine's effective limits: ``vllm serve``'s max_num_seqs here and the
    server's token budget (2048, also ``vllm serve``'s on this CPU)."""
    cfg = engine_env.engine.config
    limits = engine_env.engine.scheduler_limits()
    serve = _vllm_serve_scheduler("--model", cfg.model, "--max-model-len",
                                  str(cfg.max_model_len), "--dtype", cfg.dtype)
    assert (limits["max_num_batched_tokens"], limits["max_num_seqs"]) == \
        (cfg.max_num_batched_tokens, serve.max_num_seqs) == (2048, serve.max_num_seqs)
    assert limits["enable_prefix_caching"] is True


def test_serves_engine_follows_the_settings():
    """EngineConfig.from_settings (inferscale serve's engine): the settings' sizes, and on
    the CPU float32 and eager unless enforce_eager says otherwise."""
    from inferscale.settings import Settings

    connector = ConnectorConfig("fp")
    cfg = EngineConfig.from_settings(Settings(device="cpu", max_model_len=4096,
                                              kv_cache_memory_bytes=1 << 30), "ckpt", connector)
    assert (cfg.model, cfg.connector, cfg.dtype, cfg.enforce_eager) == \
        ("ckpt", connector, "float32", True)
    assert (cfg.max_model_len, cfg.kv_cache_memory_bytes) == (4096, 1 << 30)
    assert not EngineConfig.from_settings(Settings(device="cpu", enforce_eager=False), "ckpt",
                                          connector).enforce_eager
    assert EngineConfig.from_settings(Settings(device="cpu"), "ckpt",
                                      connector).max_num_batched_tokens == 2048  # the server's
    assert EngineConfig.from_settings(Settings(device="cpu", max_num_batched_tokens=8192),
                                      "ckpt", connector).max_num_batched_tokens == 8192
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig.of(model="/m", model_fingerprint="fp", max_num_batched_tokens=8)
