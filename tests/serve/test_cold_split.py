"""The compute-or-load split of a cold request (``inferscale.serve.cold_split``): the rule
under Hypothesis (never beyond its bound, the largest run within it, monotonic in the
wait and the bandwidth, everything loaded when storage is faster, nothing when it is
hopeless) and the estimators fed as the server feeds them."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from inferscale.serve.backend import AnswerInfo
from inferscale.serve.cold_requests import ColdRequests
from inferscale.serve.cold_split import ColdSplitConfig, Estimates, LoadEstimator, split
from inferscale.serve.engine import Generation
from inferscale.vllm_plugin.failures import Fallback, FallbackReason
from inferscale.vllm_plugin.metadata import ColdSplit, MemoryReply

lengths_st = st.lists(st.integers(1, 400), min_size=1, max_size=60)
row_st = st.sampled_from([1, 64, 11_520, 65_536, 131_072])  # SmolLM2 fp8 .. 8B bf16
seconds = st.floats(0, 1.0, allow_nan=False)
per_token = st.floats(1e-7, 1e-2, allow_nan=False)
bandwidth = st.floats(1e3, 1e12, allow_nan=False)
queued = st.floats(0, 1e10, allow_nan=False)


@st.composite
def estimates(draw, **fixed):
    values = dict(wait_s=draw(seconds), compute_s_per_token=draw(per_token),
                  bandwidth=draw(bandwidth), queued_bytes=draw(queued),
                  overhead_s=draw(st.floats(0, 0.1, allow_nan=False)), fixed_s=0.0,
                  prefill_busy=draw(st.sampled_from([0.0, 0.0, 0.3, 0.75, 0.9])))
    values.update(fixed)
    return Estimates(**values)


def within(tokens: int, row: int, e: Estimates, slack: float) -> bool:
    """The rule's bound as the module states it, max(R, W) + D <= W + c T / (1 - ρ), give
    or take ``slack`` (relative): the implementation rearranges it, so rounding may
    differ."""
    read = (e.queued_bytes + tokens * row) / e.bandwidth
    left = max(read, e.wait_s) + e.overhead_s
    right = e.wait_s + e.compute_s_per_token / (1 - e.prefill_busy) * tokens
    return left <= right + slack * max(left, right, 1e-12)


def prefix(lengths, n):
    return sum(lengths[:n])


@given(lengths_st, row_st, estimates())
def test_the_split_is_the_largest_leading_run_within_the_bound(lengths, row, e):
    s = split(lengths, row, e)
    assert 0 <= s.chunks <= len(lengths)
    assert s.tokens == prefix(lengths, s.chunks) and s.bytes == s.tokens * row
    if s.chunks:  # never beyond the bound: the read is done when prefill would be
        assert within(s.tokens, row, e, 1e-9)
        assert s.deadline_s == pytest.approx(
            2.0 * (e.wait_s + e.compute_s_per_token / (1 - e.prefill_busy) * s.tokens))
        assert s.read_s == pytest.approx((e.queued_bytes + s.bytes) / e.bandwidth)
    else:
        assert s.deadline_s is None and s.read_s == 0.0
    for k in range(s.chunks + 1, len(lengths) + 1):  # no longer run is within it
        assert not within(prefix(lengths, k), row, e, -1e-9)
    assert s.compute_s == pytest.approx(e.compute_s_per_token * (sum(lengths) - s.tokens))


@given(lengths_st, row_st, estimates(), seconds)
def test_a_busier_engine_never_loads_less(lengths, row, e, more):
    busier = dataclasses.replace(e, wait_s=e.wait_s + more)
    assert split(lengths, row, busier).chunks >= split(lengths, row, e).chunks


@given(lengths_st, row_st, estimates(), st.floats(1.0, 1e6))
def test_faster_storage_never_loads_less(lengths, row, e, factor):
    faster = dataclasses.replace(e, bandwidth=e.bandwidth * factor)
    assert split(lengths, row, faster).chunks >= split(lengths, row, e).chunks


@given(lengths_st, row_st, estimates(), queued)
def test_busier_storage_never_loads_more(lengths, row, e, more):
    busier = dataclasses.replace(e, queued_bytes=e.queued_bytes + more)
    assert split(lengths, row, busier).chunks <= split(lengths, row, e).chunks


@given(lengths_st, row_st, estimates(), st.sampled_from([0.0, 0.3, 0.75, 0.9]))
def test_a_more_congested_engine_never_loads_less(lengths, row, e, busy):
    """ρ prices a computed token at c / (1 - ρ): more congestion, more loaded."""
    more = dataclasses.replace(e, prefill_busy=max(busy, e.prefill_busy))
    assert split(lengths, row, more).chunks >= split(lengths, row, e).chunks


@given(lengths_st, row_st, estimates(queued_bytes=0.0, overhead_s=0.0, prefill_busy=0.0),
       st.floats(0.0, 0.999))
def test_storage_faster_than_compute_loads_everything(lengths, row, e, ratio):
    """Per token, reading (b/B) takes less than the compute time c: all of it is read.
    (At b/B == c exactly the comparison is decided by rounding, so ratio stays below 1.)"""
    per_token_read = ratio * e.compute_s_per_token  # 0 for a subnormal ratio: infinite B
    fast = Estimates(e.wait_s, e.compute_s_per_token, row / per_token_read
                     if per_token_read else float("inf"), 0.0, 0.0)
    assert split(lengths, row, fast).chunks == len(lengths)


@given(lengths_st, row_st, estimates(), st.floats(1e-6, 1.0))
def test_hopeless_storage_loads_nothing(lengths, row, e, u):
    """Reading even the first chunk takes longer than the wait plus its compute."""
    first = lengths[0]
    slow = row / (e.compute_s_per_token + e.wait_s / first) / (1 + u)
    hopeless = Estimates(e.wait_s, e.compute_s_per_token, slow, e.queued_bytes, e.overhead_s)
    assume((first * row) / slow > e.wait_s + e.compute_s_per_token * first)
    s = split(lengths, row, hopeless)
    assert s.chunks == 0 and s.tokens == 0 and s.deadline_s is None
    assert split(lengths, row, Estimates(e.wait_s, e.compute_s_per_token, 0.0,
                                         e.queued_bytes, e.overhead_s)).chunks == 0


@given(lengths_st, row_st, estimates(), st.integers(0, 100))
def test_a_pinned_split_reads_that_many_chunks(lengths, row, e, n):
    s = split(lengths, row, e, pinned=n)
    assert s.chunks == min(n, len(lengths)) and s.deadline_s is None


def test_the_h200_numbers():
    """The issue's H200: bf16 8B rows (128 KiB), ~2,500 memory tokens at k = 50, ~25 us of
    prefill per token. From disk at 1.5 GB/s (85 us a token) an idle engine loads
    nothing; from the page cache at 7 GB/s (19 us) everything; fp8 halves the bytes."""
    lengths = [30] + [50] * 49
    idle = dict(wait_s=0.0, compute_s_per_token=25e-6, queued_bytes=0.0, overhead_s=0.015)
    assert split(lengths, 131_072, Estimates(bandwidth=1.5e9, **idle)).chunks == 0
    assert split(lengths, 131_072, Estimates(bandwidth=7.1e9, **idle)).chunks == 50
    # a busy engine (60 ms queued) hides part of a disk read: the leading chunks
    busy = {**idle, "wait_s": 0.06}
    part = split(lengths, 131_072, Estimates(bandwidth=1.5e9, **busy))
    assert 0 < part.chunks < 50
    assert split(lengths, 65_536, Estimates(bandwidth=1.5e9, **busy)).chunks > part.chunks


def test_the_h100_numbers():
    """Issue 30's second H100 run (``load-h100-llama31-8b-u200.json``, the estimates in its
    20 rps scrape): c ~18.7 us a token, D ~59 ms, 2.32 GB/s of O_DIRECT reads, ~2,240
    memory tokens. A bf16 token read (~56 us) costs three computed ones, so
    the rule without a price on congestion never loaded anything there; priced at
    c / (1 - ρ), a congested engine (ρ = 0.9) loads everything, a half-busy one nothing;
    fp8 rows (half the bytes) are loaded from ρ = 0.75."""
    lengths = [30] + [45] * 49
    at = dict(wait_s=0.0, compute_s_per_token=18.7e-6, bandwidth=2.32e9, queued_bytes=0.0,
              overhead_s=0.059)
    for busy, bf16, fp8 in ((0.0, 0, 0), (0.5, 0, 0), (0.75, 0, 50), (0.9, 50, 50)):
        e = Estimates(**at, prefill_busy=busy)
        assert (split(lengths, 131_072, e).chunks, split(lengths, 65_536, e).chunks) \
            == (bf16, fp8), busy
    # the deadline grows with the price: a congested engine waits longer for a read
    e = Estimates(**at, prefill_busy=0.9)
    assert split(lengths, 131_072, e).deadline_s == pytest.approx(
        2.0 * 18.7e-6 / 0.1 * sum(lengths))


def test_bad_inputs_are_refused():
    e = Estimates(0.0, 1e-5, 1e9, 0.0, 0.0)
    with pytest.raises(ValueError, match="row_bytes"):
        split([3], 0, e)
    for bad in ({"mode": "sometimes"}, {"bandwidth_prior": 0}, {"deadline_factor": 0.5},
                {"alpha": 0}, {"pinned_chunks": -1}, {"busy_cap": 1.0}, {"busy_cap": -0.1},
                {"busy_cap": float("nan")}, {"busy_tau_s": 0}):
        with pytest.raises(ValueError):
            ColdSplitConfig(**bad)


def test_settings_configure_it(monkeypatch):
    from inferscale.settings import Settings

    monkeypatch.setenv("INFERSCALE_COLD_SPLIT", "pinned")
    monkeypatch.setenv("INFERSCALE_COLD_SPLIT_CHUNKS", "3")
    monkeypatch.setenv("INFERSCALE_COLD_BANDWIDTH_PRIOR", "2e9")
    cfg = ColdSplitConfig.from_settings(Settings())
    assert (cfg.mode, cfg.pinned_chunks, cfg.bandwidth_prior) == ("pinned", 3, 2e9)
    assert ColdSplitConfig.from_settings(Settings(_env_file=None, cold_split="auto")).mode == "auto"
    monkeypatch.setenv("INFERSCALE_COLD_SPLIT", "maybe")
    with pytest.raises(ValueError):
        Settings()


# ---------------------------------------------------------------- the estimators

def test_before_any_data_the_priors_hold():
    cfg = ColdSplitConfig(bandwidth_prior=3e9, compute_prior_s=4e-5, wait_prior_s=0.01,
                          step_prior_s=0.02, overhead_steps=1.5)
    e = LoadEstimator(cfg).estimates(now=100.0)
    assert (e.bandwidth, e.compute_s_per_token, e.wait_s, e.queued_bytes) == (
        3e9, 4e-5, 0.01, 0.0)
    assert e.overhead_s == pytest.approx(0.03)


def test_the_compute_rate_is_the_slope_of_prefill_time_over_computed_tokens():
    est = LoadEstimator(ColdSplitConfig(compute_prior_s=1e-3))
    for i, x in enumerate([300, 2700, 500, 2500, 1200, 300, 2700, 900] * 4):
        est.observe(0.0, 0.012 + 2e-5 * x, x, read=False, now=float(i))
    e = est.estimates(now=40.0)
    # the prior (50x off) weighs as 4e6 tokens^2 against ~3e7 of spread
    assert e.compute_s_per_token == pytest.approx(2e-5 + 4e6 * (1e-3 - 2e-5) / (4e6 + 3.3e7),
                                                  rel=0.05)
    assert 0 <= e.fixed_s < 0.012


def test_equal_prompts_keep_the_compute_prior_and_old_samples_leave_the_window():
    est = LoadEstimator(ColdSplitConfig(compute_prior_s=3e-5, window_s=10.0))
    for i in range(20):
        est.observe(0.0, 0.05, 300, read=False, now=float(i))
    assert est.estimates(now=20.0).compute_s_per_token == pytest.approx(3e-5, rel=1e-6)
    est.observe(0.0, 9.0, 10_000, read=False, now=20.0)
    assert est.estimates(now=20.0).compute_s_per_token > 3e-5
    assert est.estimates(now=100.0).compute_s_per_token == 3e-5  # window emptied


@given(st.lists(st.tuples(st.integers(0, 10_000), st.floats(-1, 10, allow_nan=False)),
                max_size=80))
def test_the_compute_rate_is_never_negative(samples):
    est = LoadEstimator()
    for i, (x, y) in enumerate(samples):
        est.observe(0.0, y, x, read=False, now=float(i))
    c = est.estimates(now=float(len(samples))).compute_s_per_token
    assert c >= 0 and c == c


def test_the_wait_counts_requests_that_did_not_read_and_decays_when_idle():
    est = LoadEstimator(ColdSplitConfig(alpha=0.5, wait_half_life_s=1.0))
    est.observe(0.2, 0.01, 100, read=False, now=0.0)
    est.observe(5.0, 0.01, 100, read=True, now=0.0)  # its queue time includes its read
    assert est.estimates(now=0.0).wait_s == pytest.approx(0.1)
    assert est.estimates(now=1.0).wait_s == pytest.approx(0.05)


def test_a_stale_wait_is_dropped_while_nothing_waits():
    """A warm-up burst leaves long queue times in the average after its queue is gone:
    while vLLM's latest scheduler stats (fresh) say no request waits, W is 0, so no read
    is chosen to hide in a wait that no longer exists."""
    est = LoadEstimator(ColdSplitConfig(alpha=0.5, wait_half_life_s=5.0, queue_fresh_s=1.0))
    est.observe(0.6, 0.01, 100, read=False, now=0.0)  # a burst's request
    assert est.estimates(now=0.5).wait_s > 0.2
    est.queue(0, at=0.4)
    assert est.estimates(now=0.5).wait_s == 0.0  # the queue is empty now
    assert est.estimates(now=2.0).wait_s > 0.1  # that word is 1.6 s old: the average again
    est.queue(3, at=2.0)
    assert est.estimates(now=2.0).wait_s > 0.1  # requests wait: the average holds
    est.queue(None, at=3.0)  # no stats: the last word stands
    assert est.estimates(now=2.5).wait_s > 0.1
    lengths, row = (40,) * 50, 64 * 1024
    e = est.estimates(now=2.5)
    loads = split(lengths, row, e).chunks
    est.queue(0, at=2.5)
    assert split(lengths, row, est.estimates(now=2.5)).chunks <= loads


def test_an_answered_request_feeds_the_estimator_by_its_own_timestamps():
    """``ColdRequests.finished`` hands the estimator the answer's vLLM queue and prefill
    times and its computed tokens (prompt less cached); a request that waited for a read
    adds no queue time to ``W`` (its queue includes the read); an answer without vLLM's
    timestamps (stats off) feeds nothing."""
    cold = ColdRequests(ColdSplitConfig(alpha=1.0))
    est = cold.estimator

    def answer(stages, read=False):
        reply = MemoryReply(cold=ColdSplit(0, 10, read=read)) if read else MemoryReply()
        cold.finished(None, None, Generation([1], "x", 0.1, 900, 600, "stop", reply,
                                             stages), AnswerInfo("ann", "kv"))

    answer(None)
    assert est.estimates().wait_s == 0.0 and not est._samples
    answer((0.3, 0.02))
    assert est.estimates().wait_s == pytest.approx(0.3, rel=1e-3)
    answer((9.0, 0.02), read=True)
    assert est.estimates().wait_s == pytest.approx(0.3, rel=1e-3)  # it waited for a read
    assert [x for _, x, _ in est._samples] == [300, 300]


def test_bandwidth_queue_and_steps_come_from_the_workers():
    est = LoadEstimator(ColdSplitConfig(alpha=1.0, overhead_steps=2.0))
    ranks = [{"tp_rank": 0, "bytes": 0, "busy_s": 0.0, "queued_bytes": 0, "step_s": None},
             {"tp_rank": 1, "bytes": 0, "busy_s": 0.0, "queued_bytes": 0, "step_s": 0.01}]
    est.storage(ranks, now=0.0)
    assert est.estimates(now=0.0).bandwidth == 1e9  # no read measured yet: the prior
    est.storage([{**ranks[0], "bytes": 4e9, "busy_s": 2.0, "queued_bytes": 1e9,
                  "step_s": 0.02},
                 {**ranks[1], "bytes": 3e9, "busy_s": 2.0}], now=10.0)
    e = est.estimates(now=10.0)
    assert e.bandwidth == pytest.approx(1.5e9)  # the slowest rank decides
    assert e.queued_bytes == 1e9 and e.overhead_s == pytest.approx(0.04)
    assert est.estimates(now=10.5).queued_bytes == pytest.approx(1e9 - 0.75e9)  # draining
    assert est.estimates(now=20.0).queued_bytes == 0.0
    est.storage([{**ranks[0], "bytes": 4e9, "busy_s": 3.0, "queued_bytes": 0}], now=11.0)
    assert est.estimates(now=11.0).bandwidth == pytest.approx(1.5e9)  # no bytes: no sample


def test_congestion_comes_from_the_busiest_rank_and_fades_with_its_age():
    est = LoadEstimator(ColdSplitConfig(busy_tau_s=2.0))
    assert est.estimates(now=0.0).prefill_busy == 0.0  # nothing reported: not congested
    base = {"bytes": 0, "busy_s": 0.0, "queued_bytes": 0, "step_s": 0.02}
    est.storage([{**base, "tp_rank": 0, "prefill_busy": 0.5, "prefill_busy_age_s": 0.0},
                 {**base, "tp_rank": 1, "prefill_busy": 0.7, "prefill_busy_age_s": 2.0}],
                now=10.0)
    e = est.estimates(now=10.0)
    assert e.prefill_busy == pytest.approx(0.5)  # rank 1's 0.7 is 2 s old: 0.7 / e
    assert e.priced_s_per_token == pytest.approx(e.compute_s_per_token / 0.5)
    assert est.estimates(now=12.0).prefill_busy == pytest.approx(0.5 / math.e)
    est.storage([{**base, "tp_rank": 0, "prefill_busy": 1.0, "prefill_busy_age_s": 0.0}],
                now=13.0)
    assert est.estimates(now=13.0).prefill_busy == 0.9  # capped: at most 10 c a token
    assert "prefill_busy" in est.estimates(now=13.0).info()
    # prefill's share of time, tokens scheduled per second x c, when it is the larger: an
    # engine prefilling 20,000 tokens a second at 25 us a token (the prior) is half busy
    # though its steps leave nothing over
    rate = LoadEstimator(ColdSplitConfig(busy_tau_s=2.0))
    rate.storage([{**base, "tp_rank": 0, "prefill_busy": 0.0, "prefill_tokens_per_s": 2e4,
                   "prefill_busy_age_s": 0.0}], now=0.0)
    assert rate.estimates(now=0.0).prefill_busy == pytest.approx(0.5)
    assert rate.estimates(now=2.0).prefill_busy == pytest.approx(0.5 / math.e)
    rate.storage([{**base, "tp_rank": 0, "prefill_busy": 0.7, "prefill_tokens_per_s": 2e4,
                   "prefill_busy_age_s": 0.0}], now=3.0)
    assert rate.estimates(now=3.0).prefill_busy == pytest.approx(0.7)  # the larger
    # plus the bases of the steps that scheduled those tokens
    rate.storage([{**base, "tp_rank": 0, "prefill_busy": 0.0, "prefill_tokens_per_s": 2e4,
                   "prefill_base_share": 0.25, "prefill_busy_age_s": 0.0}], now=3.5)
    assert rate.estimates(now=3.5).prefill_busy == pytest.approx(0.75)
    for hostile in (float("nan"), float("inf"), -5e4):
        rate.storage([{**base, "tp_rank": 0, "prefill_busy": 0.0,
                       "prefill_tokens_per_s": hostile, "prefill_busy_age_s": 0.0}], now=4.0)
        assert rate.estimates(now=4.0).prefill_busy == 0.0, hostile
        rate.storage([{**base, "tp_rank": 0, "prefill_busy": 0.0,
                       "prefill_base_share": hostile, "prefill_busy_age_s": 0.0}], now=4.0)
        assert rate.estimates(now=4.0).prefill_busy == 0.0, hostile  # as rates are
    # hostile reports (a negative or NaN share, an age from the future) never price
    # compute below its own time nor above the cap
    for busy, age in ((-0.5, 0.0), (float("nan"), 0.0), (0.5, -3.0), (0.5, float("nan"))):
        bad = LoadEstimator()
        bad.storage([{**base, "tp_rank": 0, "prefill_busy": busy,
                      "prefill_busy_age_s": age}], now=20.0)
        assert 0.0 <= bad.estimates(now=20.0).prefill_busy <= 0.9, (busy, age)


# ---------------------------------------------------------------- on the real engine

@pytest.fixture(scope="module")
def cold_user(engine_env, embedder):
    """A limiting-case user (float32, each fact encoded with the whole memory before it)
    that the workers never hold: evicted by an admin, so nothing reloads it."""
    from engine_helpers import FACTS, publish_user

    version, table = publish_user(engine_env, embedder, "cold-split", FACTS)
    engine_env.loop.run(engine_env.engine.evict("cold-split"))
    return version, table


def lengths_of(tok, table):
    from inferscale.compose import Composer

    return (len(Composer(tok).prefix_ids()),
            *(len(t) for t in table.column("token_ids").to_pylist()))


@pytest.mark.parametrize("n", [3, 0, 7])
@pytest.mark.slow
@pytest.mark.engine
def test_a_cold_request_loads_its_first_chunks_and_prefills_the_rest(engine_env, cold_user, n):
    """vLLM's own counters: the first ``n`` chunks come from external KV transfer (read
    from storage), every other prompt token is computed; the greedy answer is the full
    prefill's (fp32 limiting case); n = 0 is a plain prefill, not a fallback."""
    from engine_helpers import QUESTIONS, gen, memory_prompt
    from inferscale.vllm_plugin.metadata import ColdSplit, MemoryRef

    env = engine_env
    version, table = cold_user
    tok = env.model.tokenizer
    lengths = lengths_of(tok, table)
    row_bytes = 2 * 30 * 3 * 64 * 4  # SmolLM2 (L=30, H=3, D=64), float32
    for q in QUESTIONS[:3]:
        ids, chunks = memory_prompt(tok, table, q)
        plain = gen(env, ids)
        env.loop.run(env.engine.llm.reset_prefix_cache())
        before = env.engine.prompt_token_counters()
        out = gen(env, ids, MemoryRef("cold-split", version, chunks, lengths, cold_chunks=n))
        after = env.engine.prompt_token_counters()
        delta = {k: after[k] - before[k] for k in after}
        loaded = sum(lengths[:n])
        assert out.reply.fallback is None and out.reply.injected_tokens == loaded
        assert delta == {"total": len(ids), "external_kv_transfer": loaded,
                         "local_cache_hit": 0, "computed": len(ids) - loaded}
        assert out.token_ids == plain.token_ids
        facts = len(chunks) - 1
        assert out.reply.cold == ColdSplit(max(0, n - 1), facts - max(0, n - 1), read=n > 0)
        assert out.reply.facts_by_tier == ({"storage": n - 1} if n else {})
        assert out.reply.storage_bytes == loaded * row_bytes


@pytest.mark.slow
@pytest.mark.engine
def test_a_read_past_its_deadline_is_recomputed(engine_env, cold_user):
    from engine_helpers import QUESTIONS, gen, memory_prompt
    from inferscale.vllm_plugin.metadata import ColdSplit, MemoryRef

    env = engine_env
    version, table = cold_user
    ids, chunks = memory_prompt(env.model.tokenizer, table, QUESTIONS[1])
    plain = gen(env, ids)
    env.loop.run(env.engine.llm.reset_prefix_cache())
    out = gen(env, ids, MemoryRef("cold-split", version, chunks,
                                  lengths_of(env.model.tokenizer, table), cold_chunks=4,
                                  read_deadline_s=0.0))
    assert out.reply.injected_tokens == 0 and out.token_ids == plain.token_ids
    assert out.reply.fallback == Fallback(
        FallbackReason.LOAD_ERROR, "memory load failed (reading its facts from storage failed "
        "(no time left for a read)); recomputed")
    assert out.reply.cold == ColdSplit(0, len(chunks) - 1, read=True)


@pytest.mark.slow
@pytest.mark.engine
def test_a_resident_user_ignores_the_split(engine_env, embedder):
    from engine_helpers import FACTS, QUESTIONS, gen, memory_prompt, publish_user
    from inferscale.vllm_plugin.metadata import MemoryRef

    env = engine_env
    version, table = publish_user(env, embedder, "cold-split-held", FACTS)
    env.loop.run(env.engine.hydrate("cold-split-held", version=version, tier="host"))
    try:
        ids, chunks = memory_prompt(env.model.tokenizer, table, QUESTIONS[0])
        env.loop.run(env.engine.llm.reset_prefix_cache())
        out = gen(env, ids, MemoryRef("cold-split-held", version, chunks,
                                      lengths_of(env.model.tokenizer, table), cold_chunks=1))
        assert out.reply.cold is None and out.reply.fallback is None
        assert out.reply.injected_tokens == sum(lengths_of(env.model.tokenizer, table))
        assert out.reply.facts_by_tier == {"host": len(FACTS)} and out.reply.storage_bytes == 0
    finally:
        env.loop.run(env.engine.evict("cold-split-held"))


@pytest.mark.slow
@pytest.mark.engine
def test_the_server_prefetches_the_split_before_the_engine_sees_the_request(
        engine_env, embedder, cold_user):
    """Through the server: the workers start reading the split's chunks on the prefetch
    RPC, sent before the request (vLLM keeps their order), and the request's read adopts
    it; the answer reports the split; ``off`` reads every chunk without a prefetch; the
    estimator has vLLM's stats and the workers' storage statistics."""
    from engine_helpers import QUESTIONS
    from inferscale.serve.backend import AnswerRequest
    from inferscale.serve.server import ServerConfig, build_server

    env = engine_env
    tok = env.model.tokenizer
    servers = {mode: build_server(env.engine, tok, embedder, env.store, ServerConfig(
                   top_k=6, cold=ColdSplitConfig(mode=mode, pinned_chunks=3)))
               for mode in ("pinned", "off")}

    def prefetches():
        return env.loop.run(env.engine.worker_metrics())[0]["prefetch"]

    def ask(mode, q):
        env.loop.run(env.engine.llm.reset_prefix_cache())
        return env.loop.run(servers[mode].answer(AnswerRequest("cold-split", q, max_tokens=12)))

    for q in QUESTIONS[:2]:
        before = prefetches()
        out = ask("pinned", q)
        after = prefetches()
        assert after["started"] - before["started"] == 1
        assert after["adopted"] - before["adopted"] == 1 and after["dropped"] == before["dropped"]
        info, gen = out.info, out.generation
        cold = info.cold
        assert (cold["facts_loaded"], cold["facts_computed"]) == (2, 4)
        assert cold["bytes_read"] == gen.reply.storage_bytes > 0 and cold["split"]["chunks"] == 3
        assert info.injected_tokens == cold["split"]["tokens"] > 0  # 3 chunks, served order
        whole = ask("off", q)  # every chunk read once the engine schedules it
        assert prefetches()["started"] == after["started"]
        assert whole.info.cold["facts_loaded"] == 6
        # the same prompt (the served order is by relevance, not the limiting case's
        # encoding order, so only the engine-level test above compares answers)
        assert whole.generation.prompt_tokens == gen.prompt_tokens
    est = servers["pinned"].cold.estimator
    assert est.storage_at is not None and len(est._samples) > 0
    assert est.estimates().bandwidth != ColdSplitConfig().bandwidth_prior  # measured
    waiting, at = env.engine.waiting_now()  # vLLM's own count, from its scheduler stats
    assert waiting == 0 and at > 0 and est._waiting is not None


@pytest.mark.engine
def test_congested_prefill_is_measured_on_the_engine(engine_env):
    """Prompts that together overflow a step's token budget: a step leaves prompt tokens
    over, so the scheduler half's ρ (backlog.py) rises above 0 and comes back with the
    workers' storage statistics, as the split reads it. (Sent while another request
    decodes, so the engine finds them queued together; any two of the three overflow.)"""
    import asyncio

    env = engine_env
    budget = env.engine.scheduler_limits()["max_num_batched_tokens"]
    n = min(budget, 2048 - 8) * 7 // 10  # each fits the context, any two overflow
    assert 2 * n > budget, "the test engine's budget outgrew its context"
    long = [[100 + (i + j) % 5000 for j in range(n)] for i in range(3)]

    async def run():
        first = asyncio.ensure_future(env.engine.generate([7] * 16, None, max_tokens=64))
        await asyncio.sleep(0.5)  # decoding by now
        await asyncio.gather(*(env.engine.generate(p, None, max_tokens=2) for p in long))
        await first

    env.loop.run(env.engine.llm.reset_prefix_cache())
    env.loop.run(run())
    (stats,) = env.loop.run(env.engine.storage_stats())
    assert 0.0 < stats["prefill_busy"] <= 1.0 and stats["prefill_busy_age_s"] >= 0.0
    est = LoadEstimator()
    est.storage([stats])
    assert est.estimates().prefill_busy > 0.0


@given(lengths_st, row_st, estimates(), st.floats(0.0, 0.5))
def test_a_costlier_read_never_loads_more(lengths, row, e, extra):
    """A read's time besides its rows (``o``) only adds to the read side."""
    more = dataclasses.replace(e, read_overhead_s=e.read_overhead_s + extra)
    assert split(lengths, row, more).chunks <= split(lengths, row, e).chunks


def test_the_steps_price_a_token_and_the_reads_their_overhead():
    """The workers' step fit (``prefill_token_s``) is ``c`` once reported, with its base
    and request cost reported from the same rank, the requests' own fit kept beside it
    and ``c`` again once every rank reports its fit unknown (0: stale); ``o`` is the
    moving average of the reads' seconds outside their rows, per read timed, from the
    slowest rank."""
    est = LoadEstimator(ColdSplitConfig(alpha=1.0, compute_prior_s=2e-5))
    base = {"bytes": 0, "busy_s": 0.0, "queued_bytes": 0, "step_s": 0.007,
            "reads_timed": 0, "overhead_s": 0.0}
    est.storage([{**base, "tp_rank": 0}, {**base, "tp_rank": 1}], now=0.0)
    e = est.estimates(now=0.0)
    assert (e.compute_s_per_token, e.read_overhead_s) == (2e-5, 0.0)  # priors
    assert (e.step_base_s, e.request_cost_s) == (0.0, 0.0)  # not known
    est.storage([{**base, "tp_rank": 0, "prefill_token_s": 3.3e-5, "reads_timed": 4,
                  "overhead_s": 0.08, "prefill_step_base_s": 6.3e-3, "prefill_request_s": 5e-3},
                 {**base, "tp_rank": 1, "prefill_token_s": 3.1e-5, "reads_timed": 2,
                  "overhead_s": 0.06, "prefill_step_base_s": 9e-3,
                  "prefill_request_s": float("inf")}], now=1.0)
    e = est.estimates(now=1.0)
    assert e.compute_s_per_token == 3.3e-5 and e.request_fit_s_per_token == 2e-5
    assert (e.step_base_s, e.request_cost_s) == (6.3e-3, 5e-3)  # rank 0's, as c
    assert e.info()["request_cost_ms"] == pytest.approx(5.0)
    assert e.read_overhead_s == pytest.approx(0.03)  # rank 1: 60 ms over 2 reads
    assert e.info()["read_overhead_ms"] == pytest.approx(30.0)
    assert e.info()["request_fit_us_per_token"] == pytest.approx(20.0)
    est.storage([{**base, "tp_rank": 0, "prefill_token_s": 0.0},  # rank 0's fit went stale
                 {**base, "tp_rank": 1, "prefill_token_s": 3.1e-5}], now=2.0)
    e = est.estimates(now=2.0)
    assert e.compute_s_per_token == 3.1e-5  # rank 1's, its infinite request cost not kept
    assert (e.step_base_s, e.request_cost_s) == (0.0, 0.0)
    est.storage([{**base, "tp_rank": 0, "prefill_token_s": 0.0},
                 {**base, "tp_rank": 1, "prefill_token_s": float("nan")}], now=3.0)
    assert est.estimates(now=3.0).compute_s_per_token == 2e-5  # the requests' fit again


def test_the_fourth_h100_run_numbers():
    """Issue 30's fourth H100 run, 200 users (``load-h100-llama31-8b-run4-u200.json``): the
    steps cost ~33 us a prompt token; the engine scheduled ~3,000 / 11,700 / 20,400 prompt
    tokens a second at 7 / 21 / 35 rps; fp8 rows of 64 KiB read at 1.84 GB/s; ~2,300
    memory tokens a cold request; D ~10 ms. Priced with the steps' c, a cold request at
    7 rps prefills (its read, ~80 ms of rows, would be the slower) and at 35 rps, where
    prefill takes two thirds of the time, it loads; the requests' own fit (~18 us), which
    the split used in that run, prefilled at 35 rps too and saturated the engine."""
    lengths = [100] + [45] * 49
    at = dict(wait_s=0.0, bandwidth=1.84e9, queued_bytes=0.0, overhead_s=0.010,
              read_overhead_s=0.010)
    for rate, tokens_per_s, c, loads in ((7, 3_000, 33e-6, False), (35, 20_400, 33e-6, True),
                                         (35, 20_400, 18e-6, False)):
        e = Estimates(compute_s_per_token=c, prefill_busy=min(0.9, tokens_per_s * c), **at)
        assert (split(lengths, 65_536, e).chunks > 0) == loads, (rate, c)


def test_the_fifth_h100_run_numbers():
    """Issue 30's fifth H100 run (``load-h100-llama31-8b-run5-u{200,2000}.json``, their
    scrapes): the split's c read ~21 us; the engine computed ~2,700 / 17,000 / 30,300
    prompt tokens a second at 5 / 15 / 25 rps (200 / 2,000 / 2,000 users) in at most 5 /
    15 / 41 steps a second that scheduled prompt tokens (a request's prompt fits one step;
    at 25 rps, 41 steps a second in all), of ~6.3 ms of base each; fp8 rows of
    64 KiB at 2.05 GB/s, o ~44 ms, D ~2 steps of ~25 ms. Tokens times c alone read ~0.65
    at 25 rps, where the engine was saturated (steps back to back, the p50 TTFT 189 ms),
    and every cold request was computed; with the steps' bases a cold request loads
    there, and still prefills at 5 and 15 rps, where computing is the faster."""
    lengths = [100] + [48] * 49
    at = dict(wait_s=0.0, bandwidth=2.05e9, queued_bytes=0.0, overhead_s=0.05,
              read_overhead_s=0.044, compute_s_per_token=21e-6)
    for tokens_per_s, steps_per_s, with_bases, loads in (
            (2_700, 5, True, False), (17_000, 15, True, False),
            (30_300, 41, False, False), (30_300, 41, True, True)):
        rho = tokens_per_s * 21e-6 + (steps_per_s * 6.3e-3 if with_bases else 0.0)
        e = Estimates(prefill_busy=min(0.9, rho), **at)
        assert (split(lengths, 65_536, e).chunks > 0) == loads, (tokens_per_s, with_bases)


def test_the_prefill_ahead_is_a_floor_of_the_wait():
    """While vLLM's fresh stats say nothing waits, W is 0, yet a request arriving during
    another's long prefill step waits for the rest of it: the server's own prefill queue
    (``ahead_s``) is a floor of W; a larger average wins; a non-finite or negative one
    counts as none."""
    est = LoadEstimator(ColdSplitConfig(alpha=1.0))
    est.queue(0, at=0.0)
    assert est.estimates(now=0.1).wait_s == 0.0
    e = est.estimates(now=0.1, ahead_s=0.04)
    assert (e.wait_s, e.prefill_ahead_s, e.info()["prefill_ahead_ms"]) == (0.04, 0.04, 40.0)
    for bad in (math.inf, math.nan, -1.0):
        assert est.estimates(now=0.1, ahead_s=bad).wait_s == 0.0
    est.observe(0.3, 0.01, 100, read=False, now=2.0)  # requests waited 0.3 s of late
    assert est.estimates(now=2.0, ahead_s=0.04).wait_s == pytest.approx(0.3)


def test_a_cold_request_behind_another_loads_during_its_prefill():
    """The fifth H100 run's 5 rps (c 21 us, fp8 rows of 64 KiB at 2.05 GB/s, steps of
    ~7.7 ms: D ~12 ms, ρ ~0.1): a cold request arriving alone prefills everything; one
    arriving 10 ms into another cold request's ~60 ms prefill reads its facts during the
    50 ms it waits, once a read's overhead is the chunk index held (~5.5 ms: staging and
    placing) rather than read (~44 ms, which leaves nothing worth loading)."""
    lengths = [100] + [48] * 49
    at = dict(bandwidth=2.05e9, queued_bytes=0.0, overhead_s=1.5 * 7.7e-3,
              compute_s_per_token=21e-6, prefill_busy=0.1)
    for o, ahead, loads in ((5.5e-3, 0.0, False), (5.5e-3, 0.05, True),
                            (44e-3, 0.05, False)):
        s = split(lengths, 65_536, Estimates(wait_s=ahead, read_overhead_s=o, **at))
        assert (s.chunks > 0) == loads, (o, ahead)
        if loads:  # its first token no later than computing it all behind the other
            assert s.read_s + at["overhead_s"] <= ahead + 21e-6 / 0.9 * sum(lengths)


def test_a_request_enters_the_prefill_queue_with_what_it_computes():
    """ColdRequests.handed_over: a busy step plus c a computed token: all of its prompt
    for a user in storage (or never seen), its prompt less the memory for a resident
    (an admin hydrate says so), less the split's tokens for a cold user whose split
    reads; a prompt-mode request computes everything; each leaves at its first token."""
    from inferscale.serve.cold_requests import ColdRequests
    from inferscale.vllm_plugin.metadata import MemoryRef

    cold = ColdRequests(ColdSplitConfig(compute_prior_s=20e-6, step_prior_s=0.01))
    ref = MemoryRef("ann", "a" * 32, ("prefix", "f1", "f2"), (100, 900, 1000))
    s = split([100, 900, 1000], 65_536, Estimates(0.0, 20e-6, 1e12, 0.0, 0.0))
    assert s.tokens == 2000  # storage faster than compute: all of it read
    ahead = []
    for resident, split_ in ((None, None), (True, None), (False, s), (False, None)):
        if resident is not None:
            cold.seen("ann", resident)
        h = cold.handed_over(2_100, ref, split_)
        ahead.append(cold.queue.ahead())
        cold.came_back(h)
        assert cold.queue.ahead() == 0.0 and len(cold.queue) == 0
    h = cold.handed_over(2_100, None, None)
    ahead.append(cold.queue.ahead())
    cold.came_back(h)
    full, less = 0.01 + 20e-6 * 2_100, 0.01 + 20e-6 * 100
    assert ahead == pytest.approx([full, less, less, full, full], abs=5e-3)  # drains in real time


def test_a_burst_of_cold_requests_queues_its_reads_before_the_workers_report():
    """The warm-up burst of the tenth H100 run: ten cold requests within a second split
    their facts as if the disk were idle (the workers' ``Q`` comes with their reports,
    polled), and their loads came ~240 ms late. The server counts the reads it asked
    for: a second cold request's split sees the first one's bytes queued (at ``B``,
    a floor of the workers' ``Q``) and loads less; once the first request's first token
    comes its read is over."""
    from inferscale.serve.cold_requests import ColdRequests
    from inferscale.vllm_plugin.metadata import MemoryRef

    cold = ColdRequests(ColdSplitConfig(compute_prior_s=20e-6, step_prior_s=0.01,
                                        bandwidth_prior=1.3e9))
    lengths = [100] + [48] * 49
    ref = MemoryRef("ann", "a" * 32, tuple(f"f{i}" for i in range(50)), tuple(lengths))
    quiet = cold.estimator.estimates(ahead_s=0.1)  # a wait to hide a read in
    first = split(lengths, 65_536, quiet)
    assert first.chunks > 0
    # the read queue drains in real time: bound it by the seconds the test itself took
    t0 = time.monotonic()
    h = cold.handed_over(2_600, ref, first)
    ahead = cold.reads.ahead()
    elapsed = time.monotonic() - t0
    assert first.bytes / 1.3e9 - elapsed <= ahead <= first.bytes / 1.3e9 + 1e-9  # rounding
    behind = cold.estimator.estimates(ahead_s=0.1, reads_ahead_s=ahead)
    assert behind.queued_bytes == pytest.approx(ahead * 1.3e9)
    assert split(lengths, 65_536, behind).chunks < first.chunks
    cold.came_back(h)
    assert cold.reads.ahead() == 0.0 and len(cold.reads) == 0
    # the workers' own report stays the floor when it is larger
    cold.estimator.storage([{"bytes": 0, "busy_s": 0.0, "queued_bytes": 5e8}], now=0.0)
    assert cold.estimator.estimates(now=0.0, reads_ahead_s=0.1).queued_bytes == 5e8
    assert cold.estimator.estimates(now=0.0, reads_ahead_s=1.0).queued_bytes == 1.3e9
