"""Cache keys hash content, never run ids: equal inputs share a key, any change that
alters a step's output changes it, and where scratch lives does not."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from inferscale.encode.encoder import EncoderConfig
from inferscale.facts.extractor import FactsConfig
from inferscale.pipeline import PipelineConfig
from tasks.caching import encode_cache_key, facts_cache_key


def _cfg(**kw) -> PipelineConfig:
    base = dict(home=Path("/h"), model="embedded", device="cpu", model_dtype="float32",
                encoder=EncoderConfig(), artifact_root="/a", storage_options={})
    base.update(kw)
    return PipelineConfig(**base)


def _facts_params(**kw):
    p = dict(cfg=_cfg(), facts_cfg=FactsConfig(mode="raw"), user="maya", turns=None,
             turns_hash="t1", model_fp="fp1")
    p.update(kw)
    return p


def _kv_params(**kw):
    p = dict(cfg=_cfg(), user="maya", turns=None, facts=None, turns_hash="t1",
             facts_hash="f1", model_fp="fp1")
    p.update(kw)
    return p


def test_facts_key():
    k = facts_cache_key(None, _facts_params())
    assert k == facts_cache_key(object(), _facts_params())  # the run context is not used
    assert k.startswith("inferscale-facts-")
    for change in (dict(turns_hash="t2"), dict(model_fp="fp2"),
                   dict(facts_cfg=FactsConfig(mode="raw", max_fact_tokens=64)),
                   dict(facts_cfg=FactsConfig(mode="raw", embedder="/models/other-st")),
                   dict(facts_cfg=FactsConfig(mode="mem0"))):
        assert facts_cache_key(None, _facts_params(**change)) != k, change
    for same in (dict(facts_cfg=FactsConfig(mode="raw", store_uri="/x", history_dir=Path("/y"))),
                 dict(facts_cfg=FactsConfig(mode="raw", llm_model="m", llm_base_url="http://l")),
                 dict(cfg=_cfg(artifact_root="s3://b/p"))):
        assert facts_cache_key(None, _facts_params(**same)) == k, same
    # in mem0 mode the LLM decides the facts; its API key does not
    m0 = facts_cache_key(None, _facts_params(facts_cfg=FactsConfig(
        mode="mem0", llm_base_url="http://l", llm_model="a")))
    assert m0 != facts_cache_key(None, _facts_params(facts_cfg=FactsConfig(
        mode="mem0", llm_base_url="http://l", llm_model="b")))
    assert m0 == facts_cache_key(None, _facts_params(facts_cfg=FactsConfig(
        mode="mem0", llm_base_url="http://l", llm_model="a", openai_api_key="sk-1")))


def test_kv_key():
    k = encode_cache_key(None, _kv_params())
    assert k.startswith("inferscale-kv-")
    for change in (dict(turns_hash="t2"), dict(facts_hash="f2"), dict(model_fp="fp2"),
                   dict(cfg=_cfg(encoder=EncoderConfig(window=2))),
                   dict(cfg=_cfg(encoder=EncoderConfig(dtype="float32"))),
                   dict(cfg=_cfg(encoder=EncoderConfig(batch_invariant=False))),
                   dict(cfg=_cfg(model_dtype="bfloat16")),
                   dict(cfg=_cfg(device="cuda:1"))):
        assert encode_cache_key(None, _kv_params(**change)) != k, change
    assert encode_cache_key(None, _kv_params(cfg=replace(_cfg(), artifact_root="/b",
                                                         home=Path("/other")))) == k
    # the version whose K/V is reused does not change the bytes encoded (test_incremental)
    assert encode_cache_key(None, _kv_params(previous="a" * 32)) == k
    assert encode_cache_key(None, _kv_params(cfg=_cfg(device="cuda:0"))) == \
        encode_cache_key(None, _kv_params(cfg=_cfg(device="cuda:1")))
