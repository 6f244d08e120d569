"""The scheduler half on its own (no engine: the real ``ConnectorScheduler`` with vLLM's own
``Request``, ``KVCacheBlocks`` and ``SchedulerOutput``): admission of users in neither
tier as reads from storage, their budget, their blocks' lifetime, the compute-or-load
split (only the leading chunks read, the rest prefilled; ignored for resident users),
and step timing."""

from __future__ import annotations

import dataclasses

import pytest

from inferscale.vllm_plugin.config import ConnectorConfig
from inferscale.vllm_plugin.failures import FallbackReason
from inferscale.vllm_plugin.metadata import (
    FailedLoad, FetchSpec, MemoryRef, MemoryReply, ResidencyReport, ResidentAdded, ResidentInfo,
)
from inferscale.vllm_plugin.scheduler import ConnectorScheduler

FP = "a" * 32
BS = 4
PREFIX, FACT = (1, 2, 3), (4, 5, 6, 7, 8)


def request(req_id: str, ref: MemoryRef | None, prompt: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    extra = {"kv_transfer_params": ref.to_params()} if ref else None
    return Request(req_id, prompt, SamplingParams(max_tokens=1, extra_args=extra), None)


def blocks(ids: list[int]):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))


def output(scheduled: dict[str, int]):
    from vllm.v1.core.sched.output import SchedulerOutput

    return dataclasses.replace(SchedulerOutput.make_empty(), num_scheduled_tokens=scheduled,
                               total_num_scheduled_tokens=sum(scheduled.values()))


def finished(recving: set[str]):
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(finished_recving=recving)


def sched(**cfg) -> ConnectorScheduler:
    return ConnectorScheduler(ConnectorConfig(FP, artifact_root="/store", **cfg), BS)


REF = MemoryRef("ann", "v1", ("prefix", "f1"), (3, 5), supersedes=True)
PROMPT = [*PREFIX, *FACT, 90, 91]


def test_a_user_in_neither_tier_is_read_from_storage_asynchronously():
    s = sched()
    req = request("r1", REF, PROMPT)
    assert s.get_num_new_matched_tokens(req, 0) == (8, True)
    s.update_state_after_alloc(req, blocks([7, 3, 9]), 8)
    meta = s.build_connector_meta(output({}))
    (spec,) = meta.fetches
    assert isinstance(spec, FetchSpec) and (spec.start, spec.end) == (0, 8)
    assert spec.expected == PROMPT[:8] and spec.chunks == ["prefix", "f1"]
    assert spec.slot_mapping.tolist() == [28, 29, 30, 31, 12, 13, 14, 15]
    assert spec.block_ids == [7, 3]
    # the whole user is promoted in the background meanwhile
    assert [(o.user, o.version, o.tier) for o in meta.reloads] == [("ann", "v1", "host")]
    assert s.build_connector_meta(output({})).fetches == []  # sent once
    # finished before its read completes: its blocks are kept until the workers report
    delay, params = s.request_finished(req, [7, 3, 9])
    assert delay is True and MemoryReply.from_params(params).injected_tokens == 8
    s.update_connector_output(finished({"r1"}))
    assert s._fetching == {}


def test_a_prefix_cache_hit_reads_only_the_rest():
    s = sched()
    req = request("r1", REF, PROMPT)
    assert s.get_num_new_matched_tokens(req, 4) == (4, True)
    s.update_state_after_alloc(req, blocks([7, 3, 9]), 4)
    (spec,) = s.build_connector_meta(output({})).fetches
    assert (spec.start, spec.end, spec.expected) == (4, 8, PROMPT[4:8])
    assert spec.block_ids == [3]


def test_reads_in_flight_are_bounded_and_a_read_done_frees_its_share():
    s = sched(fetch_tokens=10)
    a, b = request("a", REF, PROMPT), request("b", REF, PROMPT)
    assert s.get_num_new_matched_tokens(a, 0) == (8, True)
    s.update_state_after_alloc(a, blocks([1, 2, 3]), 8)
    assert s.get_num_new_matched_tokens(b, 0) == (0, False)  # 8 + 8 > 10: prefill
    delay, params = s.request_finished(b, [])
    assert delay is False
    fallback = MemoryReply.from_params(params).fallback
    assert fallback.reason is FallbackReason.NOT_RESIDENT
    assert fallback.detail == "user not resident, storage reads busy (8 tokens in flight)"
    s.update_connector_output(finished({"a"}))
    b2 = request("b2", REF, PROMPT)
    assert s.get_num_new_matched_tokens(b2, 0) == (8, True)


def test_a_request_whose_read_failed_is_prefilled_not_read_again():
    """A read from storage that fails (a version of another geometry, a damaged chunk)
    is reported failed; vLLM recomputes the request's blocks and asks the connector
    again: the request is prefilled from then on (before, it was admitted as a read
    again, failed again, forever), its answer naming the failure; other requests of
    the same user are still read. A finished request leaves nothing behind."""
    s = sched()
    req = request("r1", REF, PROMPT)
    assert s.get_num_new_matched_tokens(req, 0) == (8, True)
    s.update_state_after_alloc(req, blocks([7, 3, 9]), 8)
    s.build_connector_meta(output({}))
    why = "reading its facts from storage failed (GeometryMismatch: ...)"
    s.update_connector_output(finished({"r1"}))
    s.update_connector_output(KVOutput(ResidencyReport(failed_loads=[FailedLoad("r1", why)])))
    for _ in range(3):
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.build_connector_meta(output({})).fetches == []
    other = request("r2", REF, PROMPT)
    assert s.get_num_new_matched_tokens(other, 0) == (8, True)
    delay, params = s.request_finished(req, [7, 3, 9])
    assert delay is False
    reply = MemoryReply.from_params(params)
    assert reply.injected_tokens == 0 and reply.fallback.reason is FallbackReason.LOAD_ERROR
    assert reply.fallback.detail == f"memory load failed ({why}); recomputed"
    assert "r1" not in s._recompute


def KVOutput(report):
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(kv_connector_worker_meta=report)


@pytest.mark.parametrize("ref, why", [
    (dataclasses.replace(REF, lengths=()), "user not resident"),  # no lengths: only resident
    (dataclasses.replace(REF, lengths=(3, 50)), "user not resident"),  # longer than the prompt
])
def test_what_cannot_be_read_from_storage_prefills(ref, why):
    s = sched()
    req = request("r", ref, PROMPT)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.request_finished(req, [])[1]["inferscale"]["fallback"] == why


def test_a_full_host_tier_reported_at_placement_turns_admission_on_before_any_drop():
    """The serving task places users up to the budgets: the worker's add that leaves no
    room makes the first miss of a user asked for once a declined promotion, and the
    placed user counts promote_min_requests (promotion.py)."""
    s = sched()
    placed = ResidentInfo("bob", "v1", FP, {"prefix": PREFIX, "f1": FACT})
    s.update_connector_output(KVOutput(ResidencyReport([ResidentAdded(0, placed, True)])))
    assert s.reloads.promotions.full
    assert s.reloads.promotions.count("bob") == pytest.approx(1.5, rel=1e-3)
    req = request("r", REF, PROMPT)  # ann: in no tier, asked once
    s.get_num_new_matched_tokens(req, 0)
    assert s.reloads.take() == ([], 1)


def test_reads_are_off_without_a_store_or_budget():
    for s in (ConnectorScheduler(ConnectorConfig(FP), BS), sched(fetch_tokens=0)):
        assert s.get_num_new_matched_tokens(request("r", REF, PROMPT), 0) == (0, False)


def test_a_resident_user_loads_within_the_step():
    s = sched()
    info = ResidentInfo("ann", "v1", FP, {"prefix": PREFIX, "f1": FACT})
    s.update_connector_output(type("O", (), {"kv_connector_worker_meta": ResidencyReport(
        [ResidentAdded(0, info)])})())
    req = request("r", REF, PROMPT)
    assert s.get_num_new_matched_tokens(req, 0) == (8, False)
    s.update_state_after_alloc(req, blocks([5, 6, 7]), 8)
    assert s.request_finished(req, [])[0] is False


def test_stale_versions_are_read_only_when_the_request_supersedes():
    s = sched()
    old = ResidentInfo("ann", "v0", FP, {"prefix": PREFIX})
    s.update_connector_output(type("O", (), {"kv_connector_worker_meta": ResidencyReport(
        [ResidentAdded(0, old)])})())
    assert s.get_num_new_matched_tokens(request("r", REF, PROMPT), 0) == (8, True)
    plain = dataclasses.replace(REF, supersedes=False)
    assert s.get_num_new_matched_tokens(request("q", plain, PROMPT), 0) == (0, False)


def test_malformed_refs_are_type_errors():
    with pytest.raises(TypeError):
        MemoryRef.from_params({"inferscale": {"user": "a", "version": "v", "chunks": 5}})
    with pytest.raises(TypeError):
        MemoryRef.from_params({"inferscale": {"user": "a", "version": "v", "chunks": ["x"],
                                              "lengths": [True]}})
    with pytest.raises(ValueError, match="2 lengths for 1 chunks"):
        MemoryRef.from_params({"inferscale": {"user": "a", "version": "v", "chunks": ["x"],
                                              "lengths": [1, 2]}})
    assert MemoryRef.from_params(REF.to_params()) == REF
    assert MemoryRef.from_params(None) is None


def test_busy_steps_are_timed_and_idle_gaps_are_not():
    s = sched()
    req = request("r", None, [1, 2, 3])
    s.get_num_new_matched_tokens(req, 0)
    s.build_connector_meta(output({"r": 3}))
    meta = s.build_connector_meta(output({"r": 1}))  # r still runs: the interval counts
    assert len(meta.step_seconds) == 1 and meta.step_seconds[0] >= 0
    s.request_finished(req, [])  # r finished in that step: the engine may idle next
    assert s.build_connector_meta(output({"x": 2})).step_seconds == []
    assert s.build_connector_meta(output({})).step_seconds == [pytest.approx(0, abs=1)]
    assert s.build_connector_meta(output({})).step_seconds == []  # nothing ran


def test_each_step_carries_how_congested_prefill_is():
    """A step that leaves prompt tokens over (the budget could not fit the prompt) makes
    its time congested: the metadata's ``prefill_busy`` (ρ, backlog.py) rises from 0."""
    import time

    from vllm.v1.core.sched.output import NewRequestData

    s = sched()
    long = request("long", None, list(range(50)))
    s.get_num_new_matched_tokens(long, 0)
    first = dataclasses.replace(output({"long": 20}),
                                scheduled_new_reqs=[NewRequestData.from_request(long, ([],))])
    assert s.build_connector_meta(first).prefill_busy == 0.0  # nothing timed yet
    time.sleep(0.02)
    meta = s.build_connector_meta(output({"long": 20}))  # 30 left after the first step
    assert 0.0 < meta.prefill_busy <= 1.0
    assert s.backlog.tokens == 30  # not a cached request of this step's data: kept
    s.request_finished(long, [])
    assert s.backlog.tokens == 0


# ---------------------------------------------------------------- the compute-or-load split

FACT2 = (9, 10, 11)
SPLIT_REF = MemoryRef("ann", "v1", ("prefix", "f1", "f2"), (3, 5, 3), supersedes=True)
SPLIT_PROMPT = [*PREFIX, *FACT, *FACT2, 90, 91]


def finish(s, req):
    return MemoryReply.from_params(s.request_finished(req, [])[1])


def test_a_split_reads_only_the_leading_chunks_and_prefills_the_rest():
    s = sched()
    ref = dataclasses.replace(SPLIT_REF, cold_chunks=2, read_deadline_s=0.25)
    req = request("r", ref, SPLIT_PROMPT)
    assert s.get_num_new_matched_tokens(req, 0) == (8, True)  # prefix + f1; f2 prefilled
    s.update_state_after_alloc(req, blocks([7, 3, 9, 4]), 8)
    (spec,) = s.build_connector_meta(output({})).fetches
    assert spec.chunks == ["prefix", "f1"] and (spec.start, spec.end) == (0, 8)
    assert spec.expected == SPLIT_PROMPT[:8] and spec.deadline_s == 0.25
    assert s._fetching == {"r": 8}  # only the read counts against fetch_tokens
    reply = finish(s, req)
    assert reply.injected_tokens == 8 and reply.fallback is None
    assert (reply.cold.loaded, reply.cold.computed, reply.cold.read) == (1, 1, True)


def test_a_split_of_no_chunks_prefills_everything_without_a_fallback():
    s = sched()
    req = request("r", dataclasses.replace(SPLIT_REF, cold_chunks=0), SPLIT_PROMPT)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = s.build_connector_meta(output({}))
    assert meta.fetches == [] and [o.user for o in meta.reloads] == ["ann"]  # promoted still
    reply = finish(s, req)
    assert reply.fallback is None and reply.injected_tokens == 0
    assert (reply.cold.loaded, reply.cold.computed, reply.cold.read) == (0, 2, False)


def test_a_failed_read_is_computed_and_not_read_again():
    s = sched()
    req = request("r", dataclasses.replace(SPLIT_REF, cold_chunks=3), SPLIT_PROMPT)
    assert s.get_num_new_matched_tokens(req, 0) == (11, True)
    s.update_state_after_alloc(req, blocks([7, 3, 9, 4]), 11)
    assert len(s.build_connector_meta(output({})).fetches) == 1
    s.update_connector_output(type("O", (), {"kv_connector_worker_meta": ResidencyReport(
        failed_loads=[FailedLoad("r", "read from storage not done within its 0.1 s")])})())
    # vLLM frees the blocks of a load that left nothing valid and asks again: computed
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.build_connector_meta(output({})).fetches == []
    reply = finish(s, req)
    assert reply.injected_tokens == 0 and reply.fallback.reason is FallbackReason.LOAD_ERROR
    assert (reply.cold.loaded, reply.cold.computed, reply.cold.read) == (0, 2, True)
    assert s._recompute == set()


def test_a_resident_user_ignores_the_split():
    s = sched()
    info = ResidentInfo("ann", "v1", FP, {"prefix": PREFIX, "f1": FACT, "f2": FACT2})
    s.update_connector_output(type("O", (), {"kv_connector_worker_meta": ResidencyReport(
        [ResidentAdded(0, info)])})())
    req = request("r", dataclasses.replace(SPLIT_REF, cold_chunks=0), SPLIT_PROMPT)
    assert s.get_num_new_matched_tokens(req, 0) == (11, False)  # all of it, from memory
    s.update_state_after_alloc(req, blocks([5, 6, 7, 8]), 11)
    plan = s._to_load["r"]  # loaded within the step it is scheduled in: every chunk
    assert plan.ref.chunks == ("prefix", "f1", "f2") and (plan.start, plan.end) == (0, 11)
    reply = finish(s, req)
    assert reply.cold is None and reply.fallback is None


def test_the_read_budget_counts_only_the_split():
    s = sched(fetch_tokens=9)
    whole = request("a", SPLIT_REF, SPLIT_PROMPT)  # 11 tokens > 9: prefilled
    assert s.get_num_new_matched_tokens(whole, 0) == (0, False)
    busy = finish(s, whole).fallback
    assert busy.reason is FallbackReason.NOT_RESIDENT
    assert busy.detail.startswith("user not resident, storage reads busy")
    part = request("b", dataclasses.replace(SPLIT_REF, cold_chunks=2), SPLIT_PROMPT)
    assert s.get_num_new_matched_tokens(part, 0) == (8, True)


def test_split_fields_travel_and_are_checked():
    ref = dataclasses.replace(SPLIT_REF, cold_chunks=2, read_deadline_s=0.5)
    assert MemoryRef.from_params(ref.to_params()) == ref
    for bad in ({"cold_chunks": -1}, {"cold_chunks": True}, {"cold_chunks": 1.0},
                {"read_deadline_s": -0.1}, {"read_deadline_s": float("nan")},
                {"read_deadline_s": "1"}, {"read_deadline_s": float("inf")}):
        body = {**SPLIT_REF.to_params()["inferscale"], **bad}
        with pytest.raises(TypeError):
            MemoryRef.from_params({"inferscale": body})


def test_misses_promote_until_a_resident_is_dropped_for_room_then_only_frequent_users():
    """A miss orders a whole-user reload while the tiers have room; once the workers report
    a resident dropped for room, a user asked for once does not displace one asked for
    more (promotion.py); a user asked for more often than every resident does; a resident
    evicted leaves room again, a version replaced with no room left does not."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from inferscale.vllm_plugin.metadata import ResidentRemoved

    s = sched()

    def ask(req_id: str, user: str) -> list[str]:
        """A request of ``user`` (finished at once); the users it ordered reloaded."""
        req = request(req_id, dataclasses.replace(REF, user=user), PROMPT)
        s.get_num_new_matched_tokens(req, 0)
        s.get_num_new_matched_tokens(req, 0)  # asked again while waiting: counted once
        s.request_finished(req, [])
        meta = s.build_connector_meta(SchedulerOutput.make_empty())
        return [o.user for o in meta.reloads]

    assert ask("r1", "ann") == ["ann"]  # room: promoted at the first miss
    for i in range(3):
        s.update_connector_output(KVOutput(ResidencyReport([ResidentAdded(
            0, ResidentInfo("bob", "v1", FP, {"prefix": PREFIX, "f1": FACT}))])))
        s.get_num_new_matched_tokens(request(f"b{i}", dataclasses.replace(REF, user="bob"),
                                             PROMPT), 0)  # bob: resident, asked 3 times
    # a removal that is not for room (a new version, an admin) leaves admission off
    s.update_connector_output(KVOutput(ResidencyReport([ResidentRemoved(0, "zed", "v0")])))
    assert ask("r2", "cy") == ["cy"]
    s.update_connector_output(KVOutput(ResidencyReport([ResidentRemoved(0, "ann", "v1",
                                                                        for_room=True)])))
    assert ask("r3", "dan") == []  # asked once: not promoted
    assert s.build_connector_meta(SchedulerOutput.make_empty()).promotions_declined == 0
    assert ask("r4", "dan") == []  # twice, but bob (the only resident) was asked 3 times
    assert ask("r5", "eve") == []  # eve: once
    s.update_connector_output(KVOutput(ResidencyReport([ResidentRemoved(0, "bob", "v1",
                                                                        for_room=True)])))
    assert ask("r6", "eve") == ["eve"]  # twice, and nobody is resident now
    assert (s.reloads.promotions.admitted, s.reloads.promotions.declined) == (3, 3)
    # a new version: removed, then added with no room left: still full
    s.update_connector_output(KVOutput(ResidencyReport([
        ResidentRemoved(0, "cy", "v1"), ResidentAdded(0, ResidentInfo(
            "cy", "v2", FP, {"prefix": PREFIX, "f1": FACT}), full=True)])))
    assert ask("r7", "fay") == []  # asked once
    # an operator's eviction leaves room: a miss promotes again, until the tiers fill
    s.update_connector_output(KVOutput(ResidencyReport([ResidentRemoved(0, "cy", "v2")])))
    assert ask("r8", "gus") == ["gus"]  # asked once, and there is room
