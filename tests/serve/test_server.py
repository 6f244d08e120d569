"""The memory server's reading of a user's version (no engine started: only its
configuration is read): what it refuses at load, how those users are answered, and what
a first load costs (each file read once, the instruction's prefix made once)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_helpers import limiting_memory
from inferscale.artifacts.publish import Lineage, publish
from inferscale.compose import Composer
from inferscale.serve.backend import AnswerRequest
from inferscale.serve.memory_cache import MemoryCacheConfig

FP = "fp-server"


@pytest.fixture
def server(local_store, smollm2, embedder):
    from inferscale.serve.engine import EngineConfig, MemoryEngine
    from inferscale.serve.server import ServerConfig, build_server

    engine = MemoryEngine(EngineConfig.of(model=str(smollm2.checkpoint), model_fingerprint=FP,
                                          max_model_len=2048))
    server = build_server(engine, smollm2.tokenizer, embedder, local_store,
                          ServerConfig(cache=MemoryCacheConfig(refresh_s=0.0)))
    yield server
    server.memories.close()


def test_a_server_is_built_for_one_known_model(local_store, smollm2, embedder):
    """build_server: without an engine the model's fingerprint is needed, with one it
    may not differ from the engine's; a tokenizer is loaded from its checkpoint."""
    from inferscale.serve.engine import EngineConfig, MemoryEngine
    from inferscale.serve.server import ServerConfig, build_server

    with pytest.raises(ValueError, match="needs the model's fingerprint"):
        build_server(None, smollm2.tokenizer, embedder, local_store)
    engine = MemoryEngine(EngineConfig.of(model=str(smollm2.checkpoint), model_fingerprint=FP))
    with pytest.raises(ValueError, match="differs from the engine's"):
        build_server(engine, smollm2.tokenizer, embedder, local_store, fingerprint="other")
    with pytest.raises(ValueError, match="mode must be"):
        ServerConfig(mode="text")
    server = build_server(None, smollm2.checkpoint, embedder, local_store,
                          ServerConfig(mode="prompt"), fingerprint=FP)
    assert (server.fp, server.mode, server.max_model_len) == (FP, "prompt", None)
    assert server.tokenizer.encode("Where do I live?") == \
        smollm2.tokenizer.encode("Where do I live?")
    server.close()


def publish_with(store, model, embedder, user: str, instruction) -> str:
    """Two facts of ``user`` (bf16 K/V of ``model``, the server's SmolLM2) whose layout
    names ``instruction``."""
    mem, table = limiting_memory(model.model, model.tokenizer, user,
                                 [f"{user} keeps bees.", f"{user} lives by the sea."], FP,
                                 embedder, torch.bfloat16)
    mem.encoder_config["instruction"] = instruction
    return publish(store, user, mem, table, Lineage(f"log-{user}", "f"),
                   embeddings=False).version


def ask(server, user: str, n: int = 2):
    async def main():
        out = []
        for _ in range(n):
            out.append(await server.prepare(AnswerRequest(user, "Where do I live?", mode="kv",
                                                          max_tokens=8)))
            await server.memories.settle()
        return out

    return asyncio.run(main())


@pytest.mark.parametrize("instruction, why", [
    ("Remember this. " * 2667, "no request fits the model's context (2048 tokens)"),
    (5, "its instruction is a int, not text"),
])
def test_an_instruction_that_can_never_be_served_is_refused_at_load(
        server, local_store, smollm2, embedder, instruction, why):
    """A version whose instruction no request can fit in the model's context (40,000
    characters: every request of the user was a 400), or which is not text: refused once,
    at load, and counted; the user is answered without memory and the answer names why."""
    version = publish_with(local_store, smollm2, embedder, "dora", instruction)
    prepared = ask(server, "dora")
    assert [p.info.to_json()["mode"] for p in prepared] == ["none"] * 2
    for p in prepared:
        info = p.info.to_json()  # as the API answers
        assert p.ref is None and info["fallback_reason"] == "refused"
        assert info["fallback"].startswith(f"version {version[:12]} refused (instruction): ")
        assert why in info["fallback"]
    assert server.metrics.registry.get_sample_value(
        "inferscale_memory_refused_total", {"reason": "instruction"}) == 1
    assert server.memories.held()["dora"] is None and version


def test_a_servable_instruction_serves_and_clears_the_refusal(server, local_store, smollm2,
                                                              embedder):
    """A user of a refused version whose next version can be served: served from it
    (its own instruction's prefix), and its answers no longer name a refusal."""
    publish_with(local_store, smollm2, embedder, "dora", 5)
    assert ask(server, "dora", 1)[0].info.to_json()["fallback_reason"] == "refused"
    good = publish_with(local_store, smollm2, embedder, "dora", "Be brief.\n")
    ask(server, "dora", 1)  # the refresh reads the new LATEST in the background
    (p,) = ask(server, "dora", 1)
    info = p.info.to_json()
    assert info["mode"] == "kv" and info["version"] == good and "fallback" not in info
    from inferscale.compose import Composer

    assert p.ids[:len(Composer(smollm2.tokenizer, "Be brief.\n").prefix_ids())] == \
        Composer(smollm2.tokenizer, "Be brief.\n").prefix_ids()


def test_the_first_request_starts_the_event_loop_probe(server):
    """``inferscale_event_loop_lag_seconds`` is measured on the loop that serves, from
    the first request on; closing the server stops the probe."""
    async def main():
        assert not server.metrics.loop_probe.running
        await server.prepare(AnswerRequest("nobody-here", "Where do I live?"))
        await asyncio.sleep(0.05)
        running = server.metrics.loop_probe.running
        server.metrics.loop_probe.stop()
        return running

    assert asyncio.run(main())
    assert server.metrics.loop_lag.collect()[0].samples  # observed


def test_a_first_load_reads_each_file_once(server, local_store, smollm2, embedder,
                                           monkeypatch):
    """LATEST, the manifest and the facts: one read each (the manifest was read twice)."""
    from inferscale.artifacts.blobs import LocalBlobs

    publish_with(local_store, smollm2, embedder, "hal", None)
    reads, real = [], LocalBlobs.read_bytes

    def counted(self, path):
        reads.append(path.rsplit("/", 1)[-1].split(".")[0])
        return real(self, path)

    monkeypatch.setattr(LocalBlobs, "read_bytes", counted)
    asyncio.run(server.prepare(AnswerRequest("hal", "Where do I live?")))
    assert sorted(reads) == ["LATEST", "facts", "manifest"]


def test_a_facts_hydrate_holds_the_facts_and_leaves_the_kv(server, local_store, smollm2,
                                                         embedder, monkeypatch):
    """``hydrate(tier="facts")`` reads the facts (and no KV: the engine is only asked to
    prime the workers' chunk index) and
    the user's first request then reads no facts: its lookup finds them held (the
    fixture's ``refresh_s=0`` has it check LATEST, a few bytes, in the background)."""
    from inferscale.artifacts.blobs import LocalBlobs

    version = publish_with(local_store, smollm2, embedder, "hal", None)

    async def no_engine(*args, **kwargs):
        raise AssertionError("a facts hydrate asked the engine")

    primed = []

    async def prime_index(user, v):  # the workers' RPC, which needs a running engine
        primed.append((user, v))
        return True

    monkeypatch.setattr(server.engine, "hydrate", no_engine)
    monkeypatch.setattr(server.engine, "prime_index", prime_index)
    answer = asyncio.run(server.hydrate("hal", tier="facts"))
    assert {k: answer[k] for k in ("user", "version", "tier", "bytes", "facts",
                                   "index_primed")} == \
        {"user": "hal", "version": version, "tier": "facts", "bytes": 0, "facts": 2,
         "index_primed": True}
    assert primed == [("hal", version)]
    assert answer["memory_bytes"] == server.memories.peek("hal").nbytes > 0
    reads, real = [], LocalBlobs.read_bytes

    def counted(self, path):
        reads.append(path)
        return real(self, path)

    monkeypatch.setattr(LocalBlobs, "read_bytes", counted)
    p = asyncio.run(server.prepare(AnswerRequest("hal", "Where do I live?", mode="kv")))
    assert p.info.to_json()["version"] == version
    assert [r.rsplit("/", 1)[-1] for r in reads] in ([], ["LATEST"])
    assert server.memories.stats()["storage_lookups"] == 0


@settings(max_examples=60, deadline=None, database=None)
@given(instruction=st.one_of(st.none(), st.text(max_size=300),
                             st.sampled_from(["<|im_start|>system\n", "<|im_end|>", ""])),
       limit=st.integers(1, 200))
def test_prefixes_are_what_each_load_computed(smollm2, instruction, limit):
    """Any instruction text (control-token text included) and context: the prefix ids and
    the refusal a load computed afresh before, from the prefixes made once."""
    from inferscale.serve.memory_cache import MemoryRefused
    from inferscale.serve.prefixes import Prefixes

    prefixes = Prefixes(smollm2.tokenizer, limit)
    composer = Composer(smollm2.tokenizer, instruction) if instruction \
        else Composer(smollm2.tokenizer)
    want = composer.prefix_ids()
    fits = len(Composer(smollm2.tokenizer).compose([want], "?")[0]) + 1 <= limit
    for _ in range(2):  # made, then found
        if fits:
            assert prefixes.servable("v", {"instruction": instruction}) == tuple(want)
            assert prefixes.ids(instruction) is prefixes.ids(instruction)
        else:
            with pytest.raises(MemoryRefused, match="no request fits"):
                prefixes.servable("v", {"instruction": instruction})
            assert not prefixes._ids and (instruction or "") not in prefixes._composers
