"""The server's per-user memory cache on real artifacts (local store, tiny random KV):
loads off the event loop, LATEST picked up after the refresh interval, LRU under the
byte budget, pins, users without memory, a held version deleted by gc, the rate limit
of first lookups (API-key users never shed, others waiting their turn boundedly) and
the named reason whenever a user goes without memory it may have."""

from __future__ import annotations

import asyncio
import threading

import pytest

from builders import make_inputs
from inferscale.artifacts import gc as G
from inferscale.artifacts import publish as P
from inferscale.artifacts import read as R
from inferscale.serve.memory_cache import (
    Lookup, MemoryCache, MemoryCacheConfig, MemoryFallbackReason, UserMemory,
)
from inferscale.serve.retrieval import FactIndex

FP = "fp-test"


class Reader:
    """The cache's ``read`` and ``latest``: the real artifact reads, counted, with the
    thread each ran on."""

    def __init__(self, store):
        self.store, self.reads, self.latests, self.threads = store, [], [], set()

    def read(self, user: str, version: str) -> UserMemory:
        self.threads.add(threading.get_ident())
        self.reads.append((user, version))
        manifest = R.read_manifest(self.store, user, FP, version)
        facts = R.read_facts(self.store, user, FP, manifest.version)
        ids = facts.column("fact_id").to_pylist()
        return UserMemory(user, manifest.version, ids, facts.column("text").to_pylist(),
                          dict(zip(ids, facts.column("token_ids").to_pylist())),
                          FactIndex.from_table(facts, device="cpu"))

    def latest(self, user: str) -> str | None:
        self.threads.add(threading.get_ident())
        self.latests.append(user)
        return R.latest_version(self.store, user, FP)


def publish(store, user: str, seed: int, n_facts: int = 3) -> str:
    memory, facts, lineage = make_inputs(user, n_facts, seed=seed)
    return P.publish(store, user, memory, facts, lineage, embeddings=False).version


def cache(store, **config) -> tuple[MemoryCache, Reader]:
    reader = Reader(store)
    return MemoryCache(reader.read, reader.latest, MemoryCacheConfig(**config)), reader


def test_first_load_runs_off_the_event_loop_once_per_user(local_store):
    v1 = publish(local_store, "ann", 1)
    memories, reader = cache(local_store)

    async def main():
        loop_thread = threading.get_ident()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)
        t = asyncio.ensure_future(ticker())
        got = await asyncio.gather(*(memories.get("ann") for _ in range(8)))
        t.cancel()
        return loop_thread, ticks, got

    loop_thread, ticks, got = asyncio.run(main())
    assert {m.version for m in got} == {v1} and len({id(m) for m in got}) == 1
    assert reader.reads == [("ann", v1)]  # eight concurrent first requests, one read
    assert reader.latests == ["ann"]  # of LATEST, then of the version it names
    assert loop_thread not in reader.threads  # read on the pool, not the event loop's thread
    assert ticks > 0  # the loop went on meanwhile


def test_a_new_latest_is_served_after_the_refresh_interval(local_store):
    v1 = publish(local_store, "ann", 1)

    async def main(refresh_s):
        memories, reader = cache(local_store, refresh_s=refresh_s)
        first = (await memories.get("ann")).version
        v2 = publish(local_store, "ann", 2)
        during = (await memories.get("ann")).version  # answered from what is held
        await memories.settle()
        after = (await memories.get("ann")).version
        await memories.settle()
        return first, v2, during, after, reader.reads

    first, v2, during, after, reads = asyncio.run(main(refresh_s=0.0))
    assert (first, during, after) == (v1, v1, v2)
    assert reads == [("ann", v1), ("ann", v2)]
    # within the interval nothing is re-read
    first, v3, during, after, reads = asyncio.run(main(refresh_s=3600.0))
    assert first == during == after == v2 and reads == [("ann", v2)]


def test_a_held_version_removed_by_gc_keeps_serving_then_moves_to_latest(local_store):
    v1 = publish(local_store, "ann", 1)

    async def main():
        memories, _ = cache(local_store, refresh_s=0.0)
        assert (await memories.get("ann")).version == v1
        v2 = publish(local_store, "ann", 2)
        assert G.gc(local_store, "ann", FP, keep=1) == [v1]
        held = await memories.get("ann")  # v1's files are gone: served from memory
        await memories.settle()
        return held, await memories.get("ann"), v2

    held, after, v2 = asyncio.run(main())
    assert held.version == v1 and len(held.fact_ids) == 3
    assert after.version == v2


def test_least_recently_used_users_are_dropped_under_the_budget(local_store):
    for i, user in enumerate(("ann", "bob", "cid")):
        publish(local_store, user, i, n_facts=4)

    async def main():
        probe, _ = cache(local_store)
        size = (await probe.get("ann")).nbytes
        memories, reader = cache(local_store, budget_bytes=int(2.5 * size))
        for user in ("ann", "bob", "ann", "cid"):  # bob is the least recently used
            await memories.get(user)
        return memories, reader, size

    memories, reader, size = asyncio.run(main())
    assert size > 0 and list(memories.held()) == ["ann", "cid"]
    assert memories.nbytes <= 2.5 * size
    assert [user for user, _ in reader.reads] == ["ann", "bob", "cid"]


def test_admin_pins_and_unpins_a_version(local_store):
    v1 = publish(local_store, "ann", 1)
    v2 = publish(local_store, "ann", 2)
    publish(local_store, "bob", 3)

    async def main():
        probe, _ = cache(local_store)
        size = (await probe.get("ann")).nbytes
        memories, _ = cache(local_store, refresh_s=0.0, budget_bytes=int(1.5 * size))
        pinned = (await memories.load("ann", v1)).version
        await memories.get("ann")
        await memories.settle()
        still = (await memories.get("ann")).version  # no refresh for a pinned user
        await memories.get("bob")  # ann dropped under the budget: the pin survives
        assert list(memories.held()) == ["bob"]
        reloaded = (await memories.get("ann")).version
        latest = (await memories.load("ann", "latest")).version  # unpins
        return pinned, still, reloaded, latest

    assert asyncio.run(main()) == (v1, v1, v1, v2)


def test_a_user_without_memory_is_remembered_until_the_next_check(local_store):
    async def main(refresh_s):
        memories, reader = cache(local_store, refresh_s=refresh_s)
        got = [await memories.get("nobody") for _ in range(5)]
        await memories.settle()
        return got, reader, memories

    got, reader, _ = asyncio.run(main(3600.0))
    assert got == [None] * 5 and reader.reads == []  # nothing published: no version read
    assert reader.latests == ["nobody"]  # and not one LATEST read per request
    v1 = publish(local_store, "nobody", 1)

    async def later():
        memories, _ = cache(local_store, refresh_s=0.0)
        assert await memories.get("nobody") is not None  # a fresh cache loads it
        return (await memories.get("nobody")).version
    assert asyncio.run(later()) == v1


def test_config_is_validated():
    for bad in ({"refresh_s": -1}, {"budget_bytes": -1}, {"load_threads": 0},
                {"max_negative": 0}, {"misses_per_s": -1}, {"miss_burst": 0}, {"retry_s": -1},
                {"miss_wait_s": -1}):
        with pytest.raises(ValueError):
            MemoryCacheConfig(**bad)


class Flaky(Reader):
    """The real reads, the first ``fail`` of which raise an OSError (a storage hiccup)."""

    def __init__(self, store, fail: int):
        super().__init__(store)
        self.fail = fail

    def read(self, user: str, version: str) -> UserMemory:
        if self.fail > 0:
            self.fail -= 1
            self.reads.append((user, "failed"))
            raise OSError("storage timed out")
        return super().read(user, version)


def test_a_failed_first_load_is_retried_not_cached_as_no_memory(local_store):
    """A transient failure of a user's first load answers that request without memory,
    but is not remembered as "no memory" for the refresh interval: the next request
    after a short back-off loads again, re-reading LATEST (which moved meanwhile)."""
    v1 = publish(local_store, "ann", 1)

    async def main():
        reader = Flaky(local_store, fail=2)
        memories = MemoryCache(reader.read, reader.latest,
                               MemoryCacheConfig(refresh_s=3600.0, retry_s=0.05))
        got = [await memories.get("ann")]  # fails: answered without memory
        got.append(await memories.get("ann"))  # within the back-off: no storage read
        await asyncio.sleep(0.06)
        got.append(await memories.get("ann"))  # fails again: the back-off doubles
        await asyncio.sleep(0.06)
        got.append(await memories.get("ann"))  # still within 0.1 s
        v2 = publish(local_store, "ann", 2)
        await asyncio.sleep(0.1)
        got.append(await memories.get("ann"))
        return got, reader.reads, v2, memories.stats()

    got, reads, v2, stats = asyncio.run(main())
    assert got[:4] == [None] * 4 and got[4].version == v2 and v1 != v2
    assert reads == [("ann", "failed"), ("ann", "failed"), ("ann", v2)]
    assert stats["load_failures"] == 2


def test_a_failed_load_is_named_not_silent(local_store):
    """A user whose load failed is answered without memory saying so (``load_failed``,
    with the cause), on the failing request and on those within the back-off; a user
    with nothing published goes without memory and without a fallback."""
    publish(local_store, "ann", 1)

    async def main():
        reader = Flaky(local_store, fail=1)
        memories = MemoryCache(reader.read, reader.latest,
                               MemoryCacheConfig(refresh_s=3600.0, retry_s=60.0))
        return [await memories.lookup("ann"), await memories.lookup("ann"),
                await memories.lookup("nobody")]

    failed, within, nobody = asyncio.run(main())
    for found in (failed, within):
        assert found.memory is None and found.fallback.reason is MemoryFallbackReason.LOAD_FAILED
        assert "OSError: storage timed out" in found.fallback.detail
    assert nobody == Lookup(None)


def test_an_api_key_users_first_lookup_is_never_shed(local_store):
    """With the rate limit spent (one lookup, next in ~1000 s), an unauthenticated user
    is shed at once, named (``shed``) and not remembered; users of API keys
    (``shed=False``) are all loaded."""
    users = [f"u{i}" for i in range(6)]
    for i, user in enumerate(users):
        publish(local_store, user, i + 1)

    async def main():
        memories, _ = cache(local_store, misses_per_s=0.001, miss_burst=1, miss_wait_s=5.0)
        first = await memories.lookup("u0")
        shed = await memories.lookup("u1")
        keyed = await asyncio.gather(*(memories.lookup(u, shed=False) for u in users[1:]))
        return first, shed, keyed, memories

    first, shed, keyed, memories = asyncio.run(main())
    assert first.memory is not None and first.fallback is None
    assert shed.memory is None and shed.fallback.reason is MemoryFallbackReason.SHED
    assert "INFERSCALE_SERVE_STORAGE_MISSES_PER_S" in shed.fallback.detail
    assert [k.memory.user for k in keyed] == users[1:] and all(k.fallback is None for k in keyed)
    stats = memories.stats()
    assert stats["lookups_limited"] == 1 and stats["storage_lookups"] == 6


def test_shed_lookups_wait_their_turn_then_are_shed(local_store):
    """Ten unauthenticated first lookups at once, 2 at once then 10 a second, waiting at
    most 0.35 s: 2 load at once, the next 3 wait for their turn (booked in arrival order)
    and load, the last 5 are shed at once, named; nothing is remembered of those."""
    users = [f"u{i}" for i in range(10)]
    for i, user in enumerate(users):
        publish(local_store, user, i + 1)

    async def main():
        memories, reader = cache(local_store, misses_per_s=10.0, miss_burst=2,
                                 miss_wait_s=0.35)
        found = await asyncio.gather(*(memories.lookup(u) for u in users))
        return found, memories, reader

    found, memories, reader = asyncio.run(main())
    assert [f.memory.user for f in found[:5]] == users[:5]
    assert all(f.memory is None and f.fallback.reason is MemoryFallbackReason.SHED
               for f in found[5:])
    stats = memories.stats()
    assert stats["lookups_delayed"] == 3 and stats["lookups_limited"] == 5
    assert sorted(u for u, _ in reader.reads) == users[:5]
    assert sorted(memories.held()) == users[:5]


def test_unknown_users_are_bounded_in_entries_and_storage_reads(local_store):
    """A flood of unknown user ids: storage lookups are rate-limited (beyond the burst
    they are answered without memory, uncached) and the entries without memory are
    bounded (the least recently used go first); both are counted."""
    publish(local_store, "ann", 1)

    async def main():
        reader, calls = Reader(local_store), []
        memories = MemoryCache(reader.read, lambda u: calls.append(u) or reader.latest(u),
                               MemoryCacheConfig(max_negative=50, misses_per_s=0.001,
                                                 miss_burst=200))
        assert (await memories.get("ann")) is not None  # one of the burst
        got = [await memories.get(f"nobody-{i}") for i in range(2000)]
        return got, calls, memories

    got, calls, memories = asyncio.run(main())
    stats = memories.stats()
    assert got == [None] * 2000
    assert len(calls) == stats["storage_lookups"] == 200  # the burst, then limited
    assert stats["lookups_limited"] == 1801
    held = memories.held()
    assert held["ann"] is not None and len(held) == 51  # ann + 50 without memory
    assert stats["negative_entries"] == 50 and stats["negative_evictions"] == 149


def test_the_default_config_bounds_storage_reads_of_unknown_users(local_store):
    import time

    async def main():
        reader = Reader(local_store)
        calls = []
        memories = MemoryCache(reader.read, lambda u: calls.append(u) or reader.latest(u))
        start = time.monotonic()
        await asyncio.gather(*(memories.get(f"nobody-{i}") for i in range(3000)))
        return calls, time.monotonic() - start

    calls, elapsed = asyncio.run(main())
    config = MemoryCacheConfig()
    assert len(calls) <= config.miss_burst + config.misses_per_s * elapsed + 1, (len(calls),
                                                                               elapsed)


def test_facts_of_another_embedding_dimension_are_refused_at_load(local_store, smollm2,
                                                                   embedder, caplog):
    """Facts embedded at another dimension than the serving embedder's (here 4, not
    384): the version is refused when it is loaded (logged and counted in the server's
    metrics), the user is answered without memory, and the refused version is not read
    again on every request."""
    import logging

    from inferscale.serve.engine import EngineConfig, MemoryEngine
    from inferscale.serve.backend import AnswerRequest
    from inferscale.serve.server import ServerConfig, build_server

    v1 = publish(local_store, "dora", 1)
    # a real engine object, never started: the server reads only its configuration here
    engine = MemoryEngine(EngineConfig.of(model=str(smollm2.checkpoint), model_fingerprint=FP))
    server = build_server(engine, smollm2.tokenizer, embedder, local_store,
                          ServerConfig(cache=MemoryCacheConfig(refresh_s=0.0)))
    reads = []
    real = server.memories.read
    server.memories.read = lambda user, version: reads.append(version) or real(user, version)

    async def main():
        out = []
        for _ in range(3):
            out.append(await server.prepare(AnswerRequest("dora", "What is my dog called?")))
            await server.memories.settle()
        return out

    with caplog.at_level(logging.WARNING, logger="inferscale.serve"):
        prepared = asyncio.run(main())
    server.memories.close()
    infos = [p.info.to_json() for p in prepared]  # as the API answers
    assert [i["mode"] for i in infos] == ["none"] * 3
    assert all(p.ref is None for p in prepared)
    assert all(i["fallback_reason"] == "refused" and v1[:12] in i["fallback"] for i in infos)
    assert reads == [v1]  # refused once; the refresh sees LATEST unchanged
    assert server.metrics.registry.get_sample_value(
        "inferscale_memory_refused_total", {"reason": "embedding_dim"}) == 1
    assert any("384" in r.getMessage() and v1[:12] in r.getMessage() for r in caplog.records)
    # the first request's lookup read the version (refused or not, its time is counted)
    assert server.metrics.registry.get_sample_value(
        "inferscale_memory_load_seconds_total", {"phase": "read"}) > 0.0
    t = [i["timings_ms"] for i in infos]
    assert all(0.0 <= x["lookup"] <= x["memory"] for x in t)


@pytest.mark.parametrize("layout", [{"memory_order": "random"}, {"text_tail": -1},
                                    {"tail_max_k": "5"}, {"text_tail": True}])
def test_a_layout_that_cannot_be_served_is_refused_at_load(local_store, smollm2, embedder,
                                                          layout):
    """A manifest re-signed with a memory layout no request can be composed with (a
    damaged or forged record): the version is refused once, at load, and counted; the
    user is answered without memory instead of failing every request."""
    from inferscale.artifacts.blobs import Location
    from inferscale.serve.engine import EngineConfig, MemoryEngine
    from inferscale.serve.backend import AnswerRequest
    from inferscale.serve.server import ServerConfig, build_server
    from storage_schemas.manifest import Manifest

    v1 = publish(local_store, "dora", 1)
    m = R.read_manifest(local_store, "dora", FP, v1)
    local_store.filesystem().pipe_file(
        Location(local_store, "dora", FP).file(v1, "manifest.json"),
        Manifest(**{**m.__dict__, "encoder_config": {**m.encoder_config, **layout}}).to_json())
    engine = MemoryEngine(EngineConfig.of(model=str(smollm2.checkpoint), model_fingerprint=FP))
    server = build_server(engine, smollm2.tokenizer, embedder, local_store,
                          ServerConfig(cache=MemoryCacheConfig(refresh_s=0.0)))

    async def main():
        out = []
        for _ in range(2):
            out.append(await server.prepare(AnswerRequest("dora", "What is my dog called?")))
            await server.memories.settle()
        return out

    prepared = asyncio.run(main())
    server.memories.close()
    assert [p.info.to_json()["mode"] for p in prepared] == ["none"] * 2
    assert [p.info.to_json()["fallback_reason"] for p in prepared] == ["refused"] * 2
    assert server.metrics.registry.get_sample_value(
        "inferscale_memory_refused_total", {"reason": "layout"}) == 1


def test_held_token_ids_leave_the_collectors_view(local_store):
    """Thousands of users' facts must not lengthen every full collection: their ids and
    texts held as tuples, the collector stops tracking them after one pass (lists it
    never does), their token ids in one array it never tracks; their values are the
    facts table's."""
    import gc

    publish(local_store, "ann", 1, n_facts=4)
    mem = Reader(local_store).read("ann", "latest")
    facts = R.read_facts(local_store, "ann", FP, mem.version)
    assert [list(mem.token_ids[f]) for f in mem.fact_ids] == \
        facts.column("token_ids").to_pylist()
    gc.collect()
    held = [r for r in gc.get_referents(mem.token_ids) if not isinstance(r, type)]
    assert held and not any(gc.is_tracked(r) for r in held)
    assert mem.token_ids.tokens == sum(map(len, facts.column("token_ids").to_pylist()))
    assert not gc.is_tracked(mem.fact_ids) and not gc.is_tracked(mem.texts)
    assert mem.fact_ids == tuple(facts.column("fact_id").to_pylist())


def test_first_loads_are_timed_by_phase(local_store):
    """A first load's time by phase: waiting for the one load thread behind another
    user's slow read (``queued``), LATEST, the version (``read``); hits add nothing."""
    import time

    publish(local_store, "ann", 1)
    publish(local_store, "bob", 2)
    memories, reader = cache(local_store, load_threads=1)
    read = reader.read

    def slow_read(user: str, version: str) -> UserMemory:
        time.sleep(0.2)
        return read(user, version)

    memories.read = slow_read
    assert memories.stats()["load_seconds"] == dict.fromkeys(
        ("queued", "latest", "read", "handback"), 0.0)

    async def main():
        await asyncio.gather(memories.get("ann"), memories.get("bob"))
        before = memories.stats()["load_seconds"]
        await memories.get("ann")  # a hit: no load
        return before

    before = asyncio.run(main())
    spent = memories.stats()["load_seconds"]
    assert spent == before
    assert spent["read"] >= 0.4  # two reads of 0.2 s on the thread
    assert spent["queued"] >= 0.15  # one of them waited behind the other's read
    assert spent["latest"] > 0.0 and spent["handback"] >= 0.0
    assert memories.stats()["storage_lookups"] == 2
