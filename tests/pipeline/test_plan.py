"""The one skip decision of the nightly and backfill flows: each user's plan against
their LATEST becomes encode, up to date (skipped, its version recorded) or failed
(reported, not encoded)."""

from __future__ import annotations

import pyarrow as pa

from inferscale.artifacts.staleness import UserPlan
from inferscale.pipeline.plan import RunPlan


def test_each_plan_is_encoded_skipped_or_reported():
    plans = {"ann": UserPlan("ann", "h", "failed", detail="OSError: boom"),
             "bob": UserPlan("bob", "h", "new"),
             "cyd": UserPlan("cyd", "h", "up-to-date", "v" * 32),
             "dee": UserPlan("dee", "h", "facts-changed", "w" * 32, "facts.mode"),
             "eve": UserPlan("eve", "h", "unreadable", detail="CorruptArtifact: x")}
    decision = RunPlan.of(plans)
    assert decision.encode == {"bob": "new", "dee": "facts-changed", "eve": "unreadable"}
    assert decision.up_to_date == {"cyd": "v" * 32}
    assert decision.failed == {"ann": "OSError: boom"}
    turns = {u: pa.table({"x": [1, 2]}) for u in plans}
    skipped, failed = decision.outcomes(turns, "fp-model")
    assert (skipped.user, skipped.status, skipped.version, skipped.turns) == (
        "cyd", "up-to-date", "v" * 32, 2)
    assert skipped.artifact_key == "mem-cyd-fpmodel"
    assert (failed.user, failed.status, failed.reason, failed.error) == (
        "ann", "failed", "planning", "OSError: boom")


def test_a_fact_mode_change_is_encoded(local_store, tmp_path):
    """What the nightly and backfill flows decide (both plan with :func:`plan_run`): a
    user published in raw mode is up to date for a raw run and encoded by a mem0 run."""
    from pathlib import Path

    from builders import make_inputs
    from inferscale.artifacts.publish import publish
    from inferscale.encode.identity import EncoderConfig
    from inferscale.facts.extractor import FactsConfig
    from inferscale.pipeline.config import PipelineConfig
    from inferscale.pipeline.plan import plan_run

    cfg = PipelineConfig(home=Path(tmp_path), model="embedded", device="cpu",
                         model_dtype="float32", encoder=EncoderConfig(),
                         artifact_root=local_store.root, storage_options={})
    raw = FactsConfig(mode="raw")
    mem0 = FactsConfig(mode="mem0", llm_base_url="http://llm/v1", llm_model="m")
    mem, facts, lineage = make_inputs("maya", 2, seed=1, fp="fp")
    mem.encoder_config = cfg.run_identity(raw, "fp").record()
    v = publish(local_store, "maya", mem, facts, lineage, embeddings=False).version
    hashes = {"maya": lineage.log_hash}
    assert plan_run(cfg, raw, "fp", hashes) == RunPlan({}, {"maya": v}, {})
    assert plan_run(cfg, mem0, "fp", hashes).encode == {"maya": "facts-changed"}


def test_users_of_the_previous_default_layout_are_reencoded(local_store, tmp_path):
    """Issue 27's pick changed the default layout (best last, the text tail only up to
    k = 5): a user published under the one before (best first, a 5-fact tail at every k,
    recorded without ``tail_max_k``) is encoded again by the nightly and backfill plans,
    naming both settings; one published under today's default is up to date."""
    from dataclasses import replace
    from pathlib import Path

    from builders import make_inputs
    from inferscale.artifacts.publish import publish
    from inferscale.encode.identity import EncoderConfig
    from inferscale.facts.extractor import FactsConfig
    from inferscale.pipeline.config import PipelineConfig
    from inferscale.pipeline.plan import plan_run

    cfg = PipelineConfig(home=Path(tmp_path), model="embedded", device="cpu",
                         model_dtype="float32", encoder=EncoderConfig(),
                         artifact_root=local_store.root, storage_options={})
    before = replace(cfg, encoder=EncoderConfig(memory_order="relevance", text_tail=5,
                                                tail_max_k=0))
    raw = FactsConfig(mode="raw")
    hashes, versions = {}, {}
    for user, run in (("old", before), ("new", cfg)):
        mem, facts, lineage = make_inputs(user, 2, seed=1, fp="fp")
        mem.encoder_config = run.run_identity(raw, "fp").record()
        versions[user] = publish(local_store, user, mem, facts, lineage,
                                 embeddings=False).version
        hashes[user] = lineage.log_hash
    assert "tail_max_k" not in before.run_identity(raw, "fp").record()
    plan = plan_run(cfg, raw, "fp", hashes)
    assert plan.encode == {"old": "encoder-changed"}
    assert plan.up_to_date == {"new": versions["new"]}
    assert cfg.run_identity(raw, "fp").changed_settings(
        before.run_identity(raw, "fp").record()) == ["memory_order", "tail_max_k"]


def test_users_of_the_previous_cuda_default_are_reencoded_in_fp8(local_store, tmp_path):
    """fp8 memory became the default on CUDA (issue 31): a user stored in bf16 by a CUDA
    run before is encoded again by the next nightly or backfill run on CUDA, naming the
    dtype; a CPU run (still bf16 by default) finds its own users up to date."""
    from pathlib import Path

    from builders import make_inputs
    from inferscale.artifacts.publish import publish
    from inferscale.facts.extractor import FactsConfig
    from inferscale.pipeline.config import PipelineConfig
    from inferscale.pipeline.plan import plan_run
    from inferscale.settings import Settings

    def config(device: str, **kw) -> PipelineConfig:
        return PipelineConfig.from_settings(
            Settings(home=Path(tmp_path), device=device, artifact_root=local_store.root, **kw))

    before = config("cuda", kv_dtype="bfloat16")
    raw = FactsConfig(mode="raw")
    mem, facts, lineage = make_inputs("kim", 2, seed=1, fp="fp")
    mem.encoder_config = before.run_identity(raw, "fp").record()
    publish(local_store, "kim", mem, facts, lineage, embeddings=False)
    hashes = {"kim": lineage.log_hash}
    now = config("cuda")
    assert plan_run(now, raw, "fp", hashes).encode == {"kim": "encoder-changed"}
    assert now.run_identity(raw, "fp").changed_settings(
        before.run_identity(raw, "fp").record()) == ["dtype"]
    assert plan_run(before, raw, "fp", hashes).encode == {}
    cpu = config("cpu")
    cpu_mem, cpu_facts, cpu_lineage = make_inputs("lee", 2, seed=2, fp="fp")
    cpu_mem.encoder_config = cpu.run_identity(raw, "fp").record()
    publish(local_store, "lee", cpu_mem, cpu_facts, cpu_lineage, embeddings=False)
    assert plan_run(cpu, raw, "fp", {"lee": cpu_lineage.log_hash}).encode == {}
