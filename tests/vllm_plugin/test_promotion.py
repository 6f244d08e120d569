"""Which misses promote their user (``inferscale.vllm_plugin.promotion``): every miss
while the tiers have room; once they are full, only users asked for at least
``min_requests`` times and ``margin`` more than the least-asked resident, a resident
counting at least ``min_requests`` from when it became resident. Counts decay."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from inferscale.vllm_plugin.promotion import Promotions


def test_every_miss_promotes_while_the_tiers_have_room():
    p = Promotions(min_requests=2)
    p.seen("ann", now=0.0)
    assert p.admit("ann", ["bob", "cy"], now=0.0)  # asked once, but nobody was dropped
    assert (p.admitted, p.declined) == (1, 0)


def test_once_full_a_user_must_be_asked_for_more_than_the_coldest_resident():
    p = Promotions(half_life_s=100.0, min_requests=2)
    for _ in range(3):
        p.seen("bob", now=0.0)  # resident, asked 3 times
    p.seen("cy", now=0.0)  # resident, asked once
    p.dropped()
    p.seen("ann", now=0.0)
    assert not p.admit("ann", ["bob", "cy"], now=0.0)  # once: below min_requests
    p.seen("ann", now=0.0)
    assert p.admit("ann", ["bob", "cy"], now=0.0)  # 2 > cy's 1
    assert not p.admit("ann", ["bob"], now=0.0)  # 2 < bob's 3
    assert (p.admitted, p.declined) == (1, 2)


def test_a_resident_never_asked_for_is_the_coldest():
    p = Promotions(min_requests=2)
    p.dropped()
    p.seen("ann", now=0.0)
    p.seen("ann", now=0.0)
    assert p.admit("ann", ["placed-by-an-admin"], now=0.0)


def test_counts_halve_per_half_life():
    p = Promotions(half_life_s=10.0)
    p.seen("ann", now=0.0)
    p.seen("ann", now=0.0)
    assert p.count("ann", now=10.0) == pytest.approx(1.0)
    p.seen("ann", now=10.0)
    assert p.count("ann", now=20.0) == pytest.approx(1.0)
    assert p.count("nobody", now=5.0) == 0.0


def test_old_interest_loses_to_recent_interest():
    p = Promotions(half_life_s=10.0, min_requests=1)
    for _ in range(4):
        p.seen("old", now=0.0)  # 4 requests long ago: 0.5 after 30 s
    p.dropped()
    p.seen("new", now=30.0)
    assert not p.admit("new", ["old"], now=30.0)  # 1 < 0.5 + the margin of 1
    p.seen("new", now=30.0)
    assert p.admit("new", ["old"], now=30.0)


def test_a_new_resident_counts_the_admission_threshold():
    """A placed user (never asked for yet) is not displaced by a miss asked for twice, but
    is by one asked for three times; its own count decays from min_requests."""
    p = Promotions(half_life_s=100.0, min_requests=1.5)
    p.resident("placed", now=0.0)
    p.dropped()
    for _ in range(2):
        p.seen("ann", now=0.0)
    assert not p.admit("ann", ["placed"], now=0.0)  # 2 < 1.5 + 1
    p.seen("ann", now=0.0)
    assert p.admit("ann", ["placed"], now=0.0)  # 3 >= 2.5
    assert p.count("placed", now=100.0) == pytest.approx(0.75)
    p.seen("bob", now=0.0)
    p.seen("bob", now=0.0)
    p.seen("bob", now=0.0)
    p.resident("bob", now=0.0)  # already asked for more: kept
    assert p.count("bob", now=0.0) == pytest.approx(3.0)


def test_the_margin_is_one_request_by_default_and_zero_keeps_the_strict_rule():
    for margin, admitted in ((1.0, False), (0.0, True)):
        p = Promotions(min_requests=1.5, margin=margin)
        p.dropped()
        p.resident("res", now=0.0)
        p.seen("ann", now=0.0)
        p.seen("ann", now=0.0)
        assert p.admit("ann", ["res"], now=0.0) is admitted  # 2 against 1.5
    p = Promotions(min_requests=0, margin=0.0)
    p.dropped()
    assert not p.admit("nobody", ["res"], now=0.0)  # 0 is not more than 0


def test_the_counts_are_bounded():
    p = Promotions(max_users=3)
    for i in range(10):
        p.seen(f"u{i}", now=float(i))
    assert p.count("u0", now=10.0) == 0.0 and p.count("u9", now=10.0) > 0


@pytest.mark.parametrize("kw", [{"half_life_s": 0}, {"min_requests": -1}, {"max_users": 0},
                                {"margin": -1}, {"margin": float("nan")}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        Promotions(**kw)


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.floats(0, 1e4)), max_size=60),
       st.sampled_from("abcdef"), st.sets(st.sampled_from("abcdef"), max_size=4))
def test_admission_is_monotone_in_the_users_own_requests(events, user, residents):
    """One more request of the user never turns an admission into a refusal."""
    p = Promotions(half_life_s=50.0, min_requests=2)
    for u, t in sorted(events, key=lambda e: e[1]):
        p.seen(u, now=t)
    p.dropped()
    now = max((t for _, t in events), default=0.0)
    before = p.admit(user, residents, now=now)
    p.seen(user, now=now)
    assert p.admit(user, residents, now=now) or not before
