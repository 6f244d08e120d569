"""What loads cost beyond the rule (``inferscale.serve.load_excess``): the excess from
both branches' residuals, never negative, fading without loads, counted per congestion
and per wait;
the estimator and the server's cold requests feeding it; the rule loading less by it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferscale.serve.backend import AnswerInfo
from inferscale.serve.cold_requests import ColdRequests, branch
from inferscale.serve.cold_split import ColdSplitConfig, Estimates, LoadEstimator, split
from inferscale.serve.engine import Generation
from inferscale.serve.load_excess import ExcessConfig, LoadExcess, quantile
from inferscale.vllm_plugin.metadata import ColdSplit, MemoryReply, MemoryRef

residuals = st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=1, max_size=40)

# The H200 run's 2,000 users at 5 rps (load-h200-llama31-8b-u2000.json): fp8 rows of
# 64 KiB at ~1.19 GB/s, o ~4 ms, D ~7 ms, c ~20.7 us, ρ ~0.09, a cold request's 50 facts
# (~2,450 memory tokens) arriving during another's prefill (W up to ~60 ms).
LENGTHS = [100] + [48] * 49
H200 = dict(wait_s=0.06, compute_s_per_token=20.7e-6, bandwidth=1.19e9, queued_bytes=0.0,
            overhead_s=7.3e-3, read_overhead_s=4e-3, prefill_busy=0.09)


@given(residuals, st.floats(0, 1))
def test_the_quantile_is_numpys(xs, q):
    assert quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)), abs=1e-9)


@given(residuals, residuals, st.floats(0, 1e4))
def test_the_excess_is_never_negative_and_only_fades(loaded, computed, later):
    ex = LoadExcess(ExcessConfig(min_samples=1))
    for r in computed:
        ex.observe(False, r, now=0.0)
    for r in loaded:
        ex.observe(True, r, now=0.0)
    e0 = ex.excess(now=0.0)
    assert e0 >= 0.0
    assert e0 == pytest.approx(max(0.0, quantile(loaded[-32:], 0.9)
                                   - quantile(computed[-32:], 0.9)))
    assert 0.0 <= ex.excess(now=later) <= e0
    assert ex.excess(now=60.0) == pytest.approx(e0 / 2)


def test_nothing_until_both_branches_have_samples():
    ex = LoadExcess(ExcessConfig(min_samples=3))
    for i in range(3):
        assert ex.excess(now=0.0) == 0.0
        ex.observe(True, 0.1, now=0.0)
    assert ex.excess(now=0.0) == 0.0  # no computed request yet
    for _ in range(3):
        ex.observe(False, 0.0, now=0.0)
    ex.observe(False, float("nan"), now=0.0)  # dropped
    ex.observe(True, 5.0, now=0.0, busy=float("nan"))  # dropped: no congestion to count at
    assert ex.counts() == (3, 3)
    assert ex.excess(now=0.0) == pytest.approx(0.1)


samples = st.lists(st.tuples(st.booleans(), st.floats(-1.0, 1.0), st.floats(0.0, 0.9),
                             st.floats(0.0, 2.0)), max_size=80)


@given(samples, st.floats(0.0, 0.9), st.floats(0.0, 2.0))
def test_the_excess_counts_only_residuals_of_a_near_congestion_and_wait(xs, busy, wait):
    """E at ``busy`` and ``wait`` is what the residuals decided within ``busy_band`` of
    that ``ρ`` and, by their splits' ``W'``, within ``wait_ratio`` of that ``W`` (up to
    ``wait_floor_s``) alone give (the newest ``window`` per branch)."""
    cfg = ExcessConfig(min_samples=2)
    ex, near = LoadExcess(cfg), LoadExcess(cfg)
    for loaded, r, rho, w in xs:
        ex.observe(loaded, r, now=0.0, busy=rho, wait_s=w)
    for loaded in (True, False):
        kept = [(r, rho, w) for was, r, rho, w in xs if was == loaded][-cfg.window:]
        for r, rho, w in kept:
            lo, hi = sorted((w, wait))
            if abs(rho - busy) <= cfg.busy_band and \
                    hi <= cfg.wait_ratio * lo + cfg.wait_floor_s:
                near.observe(loaded, r, now=0.0, busy=busy, wait_s=wait)
    assert ex.excess(0.0, busy, wait) == pytest.approx(near.excess(0.0, busy, wait))


def test_an_overload_burst_does_not_price_loads_at_a_quiet_engine():
    """The H100 run's warm-up (64 rps, ρ near its cap) left loaders ~330 ms later than
    the computed requests; at 5 rps (ρ ~0.1) that says nothing, so E is 0 there until
    requests decided there finish, and then theirs counts."""
    ex = LoadExcess()
    for i in range(8):
        ex.observe(True, 0.40, now=float(i), busy=0.8)
        ex.observe(False, 0.07, now=float(i), busy=0.75)
    assert ex.excess(now=8.0, busy=0.8) == pytest.approx(0.33 * 0.5 ** (1 / 60))
    assert ex.excess(now=8.0, busy=0.1) == 0.0
    for i in range(3):
        ex.observe(True, 0.03, now=9.0 + i, busy=0.1)
        ex.observe(False, 0.01, now=9.0 + i, busy=0.12)
    assert ex.excess(now=11.0, busy=0.1) == pytest.approx(0.02)
    assert ex.excess(now=11.0, busy=0.8) > 0.3


def test_a_burst_behind_a_second_of_prefill_does_not_price_a_read_hidden_in_50_ms():
    """The eleventh H100 run (200 users, ``load-h100-llama31-8b-run11-u200.json``): the
    warm-up's nine loaders' residuals (its ``split_state``, ρ 0.011-0.032: the workers'
    report lags a burst) priced loads at 5 rps (ρ 0.09) so that a cold request with 46 ms
    ahead loaded nothing. Their splits' waits are not in the record, only the warm-up's
    (p50 481 ms, at most 1,019), so they are spread like it here; the computed requests' ~35 ms
    residuals at waits of both kinds. By ρ alone E prices the 46 ms split; per wait it
    prices only splits with a wait like the loaders', and the 46 ms split reads a run."""
    loaders = (0.1626, 0.127, -0.0129, 0.3851, 0.1328, -0.075, -0.1008, -0.1861, -0.147)
    waits = (0.141, 0.254, 0.451, 0.662, 0.998, 0.3, 0.5, 0.8, 1.019)
    by_wait, by_rho = LoadExcess(), LoadExcess(ExcessConfig(wait_ratio=1e9))
    for ex in (by_wait, by_rho):
        for r, w in zip(loaders, waits):
            ex.observe(True, r, now=0.0, busy=0.03, wait_s=w)
        for w in (0.0, 0.0, 0.01, 0.03, 0.05, 0.07, 0.4, 0.5, 0.7):
            ex.observe(False, 0.035, now=0.0, busy=0.09, wait_s=w)
    assert by_rho.excess(0.0, busy=0.09, wait_s=0.046) > 0.1  # what held the 5 rps step
    assert by_wait.excess(0.0, busy=0.09, wait_s=0.046) == 0.0  # no loader near 46 ms
    assert by_wait.excess(0.0, busy=0.09, wait_s=0.5) > 0.1
    est = {**H200, "wait_s": 0.046, "compute_s_per_token": 11e-6,
           "bandwidth": 1.38e9, "overhead_s": 9.3e-3, "read_overhead_s": 6e-3}
    assert split(LENGTHS, 65_536, Estimates(
        **est, load_excess_s=by_rho.excess(0.0, busy=0.09, wait_s=0.046))).chunks == 0
    assert split(LENGTHS, 65_536, Estimates(
        **est, load_excess_s=by_wait.excess(0.0, busy=0.09, wait_s=0.046))).chunks > 0


@pytest.mark.parametrize("bad", [dict(window=0), dict(min_samples=0),
                                 dict(window=2, min_samples=3), dict(quantile=1.5),
                                 dict(half_life_s=0.0), dict(busy_band=-0.1),
                                 dict(wait_ratio=0.5), dict(wait_floor_s=-0.01)])
def test_bad_configs_are_refused(bad):
    with pytest.raises(ValueError):
        ExcessConfig(**bad)


def test_the_h200_run_loads_nothing_once_loads_came_late():
    """At the margin the rule predicts a tie, so the H200 run's loaders (about 20 facts
    read during another's prefill) took p50 171 ms against computed p99 99 ms. With
    those loaders ~80 ms later than predicted beyond the computed ones, nothing is loaded
    at 5 rps; a saturated engine (ρ at its cap) still loads."""
    base = split(LENGTHS, 65_536, Estimates(**H200))
    assert 10 <= base.chunks < len(LENGTHS)
    late = Estimates(**{**H200, "load_excess_s": 0.08})
    assert split(LENGTHS, 65_536, late).chunks == 0
    assert split(LENGTHS, 65_536, Estimates(**{**H200, "load_excess_s": 0.08,
                                                  "prefill_busy": 0.9})).chunks > 0
    assert late.info()["load_excess_ms"] == pytest.approx(80.0)


def test_the_estimator_measures_the_excess_from_finished_requests():
    """Each finished request with its split's branch: loaders 90 ms later than
    ``max(R, W) + D + c T`` and computed requests 10 ms later than ``W + c T`` give E ~80
    ms, and the split then loads nothing; requests without a branch (resident users)
    add no residual."""
    est = LoadEstimator(ColdSplitConfig(compute_prior_s=20e-6, prior_sxx=1e18))
    c = 20e-6
    for i in range(6):
        loaded = i % 2 == 0
        computed = 1_300 if loaded else 2_500
        base = 0.07 if loaded else 0.0
        late = 0.09 if loaded else 0.01
        est.finished(0.0, base + c * computed + late, computed, loaded,
                     (loaded, base, 0.0, 0.0), now=float(i))
    est.finished(0.0, 0.5, 100, False, None, now=6.0)
    assert est.excess.counts() == (3, 3)
    e = est.estimates(now=6.0)
    assert e.load_excess_s == pytest.approx(0.08 * 0.5 ** (2 / 60), abs=1e-6)  # last at 4
    assert est.estimates(now=4.0 + 60.0).load_excess_s == pytest.approx(0.04, abs=1e-6)


def test_a_finished_cold_request_gives_its_branch():
    """ColdRequests.finished hands the estimator the split's branch for a cold request
    (loading: ``max(R, W) + D``; computing: ``W``) and none for a resident one."""
    s_load = split(LENGTHS, 65_536, Estimates(**H200))
    s_none = split(LENGTHS, 65_536, Estimates(**{**H200, "load_excess_s": 1.0}))
    assert branch(s_load) == (True, pytest.approx(max(s_load.read_s, 0.06) + 7.3e-3), 0.09,
                              0.06)
    assert branch(s_none) == (False, 0.06, 0.09, 0.06)
    cold = ColdRequests(ColdSplitConfig(excess=ExcessConfig(min_samples=1)))
    ref = MemoryRef("ann", "a" * 32, tuple(f"f{i}" for i in range(50)), tuple(LENGTHS))
    for s, reply in (
            (s_load, MemoryReply(cold=ColdSplit(s_load.chunks - 1, 50 - s_load.chunks,
                                                read=True))),
            (s_none, MemoryReply(cold=ColdSplit(0, 49))),
            (None, MemoryReply(facts_by_tier={"gpu": 49}))):
        gen = Generation([1], "x", 0.1, 2_600, 0, "stop", reply, (0.0, 0.3))
        cold.finished(ref, s, gen, AnswerInfo("ann", "kv"))
    assert cold.estimator.excess.counts() == (1, 1)


def test_a_residual_counts_at_the_congestion_it_finished_in_when_larger():
    """A cold request decided at a quiet start of a burst finishes inside it: its
    residual counts at the larger ``ρ`` (the workers' report at its finish), so the
    burst's residuals do not price loads at a quiet engine."""
    est = LoadEstimator(ColdSplitConfig(compute_prior_s=20e-6, prior_sxx=1e18,
                                        excess=ExcessConfig(min_samples=1)))
    est.storage([{"bytes": 0, "busy_s": 0.0, "queued_bytes": 0, "prefill_busy": 0.8,
                  "prefill_busy_age_s": 0.0}], now=0.0)
    for loaded, late in ((True, 0.4), (False, 0.05)):
        est.finished(late, 0.0, 0, loaded, (loaded, 0.0, 0.0, 0.0), now=0.0)
    assert est.excess.excess(0.0, busy=0.0) == 0.0
    assert est.excess.excess(0.0, busy=0.8) == pytest.approx(0.35)
    assert est.estimates(now=0.0).load_excess_s == pytest.approx(0.35)  # ρ 0.8 now
    assert est.estimates(now=30.0).load_excess_s == 0.0  # ρ decayed: a quiet engine


def test_the_residuals_are_reported_as_held():
    """``snapshot`` (``/admin/status``'s record of what ``E`` stands on) gives each held
    residual as ``[ρ, ms, age s, W ms]`` per branch, oldest first, within the window."""
    ex = LoadExcess(ExcessConfig(window=2, min_samples=1))
    ex.observe(True, 0.25, now=1.0, busy=0.5)
    ex.observe(False, 0.01, now=2.0, busy=0.1, wait_s=0.03)
    ex.observe(True, float("nan"), now=2.5)  # dropped
    ex.observe(True, 0.5, now=2.6, wait_s=float("inf"))  # dropped: no wait to count at
    ex.observe(True, 0.125, now=3.0, busy=0.0)
    ex.observe(True, 0.05, now=4.0, busy=0.2, wait_s=0.4)  # the window keeps the last two
    assert ex.snapshot(now=5.0) == {"loaded": [[0.0, 125.0, 2.0, 0.0],
                                               [0.2, 50.0, 1.0, 400.0]],
                                    "computed": [[0.1, 10.0, 3.0, 30.0]]}


def test_the_split_state_is_reported_in_json():
    """``ColdRequests.status``: the estimates of now (a non-finite one as None: the
    admin answer is JSON) and the residuals, from a fresh estimator."""
    import json

    cold = ColdRequests(ColdSplitConfig(excess=ExcessConfig(min_samples=1)))
    cold.estimator.excess.observe(True, 0.3, now=0.0, busy=0.2)
    got = cold.status()
    assert got["mode"] == cold.config.mode
    assert got["excess_residuals"]["loaded"][0][:2] == [0.2, 300.0]
    assert got["estimates"]["bandwidth_bytes_per_s"] == cold.config.bandwidth_prior
    json.dumps(got, allow_nan=False)
