"""Cache keys hash content, never run ids: equal inputs share a key, any change that
alters a step's output changes it, and where scratch lives does not. The KV key is the
encoding identity the version id derives from."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa

from builders import facts_table
from inferscale.encode.identity import EncoderConfig, EncodingIdentity
from inferscale.facts.extractor import FactsConfig
from inferscale.pipeline.config import PipelineConfig
from storage_schemas import turns as turns_schema
from tasks.caching import encode_cache_key, facts_cache_key


def _cfg(**kw) -> PipelineConfig:
    base = dict(home=Path("/h"), model="embedded", device="cpu", model_dtype="float32",
                encoder=EncoderConfig(), artifact_root="/a", storage_options={})
    base.update(kw)
    return PipelineConfig(**base)


def _turns(text: str = "I have a dog.") -> pa.Table:
    return pa.table({"user": ["maya"], "session": ["1"], "turn_id": ["t1"], "turn_index": [0],
                     "speaker": ["Maya"], "text": [text], "timestamp": [None]},
                    schema=turns_schema.SCHEMA)


def _facts_params(**kw):
    p = dict(cfg=_cfg(), facts_cfg=FactsConfig(mode="raw"), user="maya", turns=_turns(),
             model_fp="fp1")
    p.update(kw)
    return p


def _kv_params(**kw):
    p = dict(cfg=_cfg(), user="maya", turns=_turns(), facts=facts_table("maya", ["f1"], [[1, 2]]),
             identity=_cfg().identity("fp1"))
    p.update(kw)
    return p


def test_facts_key():
    k = facts_cache_key(None, _facts_params())
    assert k == facts_cache_key(object(), _facts_params())  # the run context is not used
    assert k.startswith("inferscale-facts-")
    for change in (dict(turns=_turns("I have a cat.")), dict(model_fp="fp2"),
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


def test_kv_key_is_the_encoding_identity():
    k = encode_cache_key(None, _kv_params())
    assert k.startswith("inferscale-kv-")
    ident = _cfg().identity("fp1")
    batched = EncoderConfig(batch_invariant=False)
    for change in (dict(turns=_turns("I have a cat.")),
                   dict(facts=facts_table("maya", ["f1"], [[1, 3]])),
                   dict(identity=replace(ident, model_fingerprint="fp2")),
                   dict(identity=_cfg(encoder=EncoderConfig(window=2)).identity("fp1")),
                   dict(identity=_cfg(encoder=EncoderConfig(dtype="float32")).identity("fp1")),
                   dict(identity=_cfg(encoder=batched).identity("fp1")),
                   dict(identity=_cfg(model_dtype="bfloat16").identity("fp1")),
                   dict(identity=_cfg(device="cuda:1").identity("fp1"))):
        assert encode_cache_key(None, _kv_params(**change)) != k, change
    # where the store and the home are, the embeddings and the previous version whose
    # K/V is reused (same bytes, test_incremental) do not change the KV
    assert encode_cache_key(None, _kv_params(cfg=replace(_cfg(), artifact_root="/b",
                                                         home=Path("/other")))) == k
    assert encode_cache_key(None, _kv_params(facts=facts_table("maya", ["f1"], [[1, 2]],
                                                               seed=5))) == k
    assert encode_cache_key(None, _kv_params(previous="a" * 32)) == k
    gpu0, gpu1 = (EncodingIdentity(EncoderConfig(), "fp1", "bfloat16", d)
                  for d in ("cuda:0", "cuda:1"))
    assert encode_cache_key(None, _kv_params(identity=gpu0)) == \
        encode_cache_key(None, _kv_params(identity=gpu1))
