"""The memory cache's rate limit: a token bucket whose waits are booked in arrival order."""

from __future__ import annotations

from inferscale.serve.token_bucket import TokenBucket


def test_a_burst_then_bookings_in_arrival_order_then_refusals():
    bucket = TokenBucket(rate=1.0, burst=2)
    assert [bucket.reserve(0.0), bucket.reserve(0.0)] == [0.0, 0.0]  # the burst, at once
    assert bucket.reserve(0.5) is None  # the next token is about 1 s away: nothing taken
    first, second = bucket.reserve(5.0), bucket.reserve(5.0)  # booked one after the other
    assert 0.5 < first <= 1.0 and 1.5 < second <= 2.0 and second - first > 0.9
    assert bucket.reserve(1.5) is None  # the third booking would wait ~3 s


def test_a_zero_rate_never_refills():
    bucket = TokenBucket(rate=0.0, burst=1)
    assert bucket.reserve(0.0) == 0.0 and bucket.reserve(1e9) is None
