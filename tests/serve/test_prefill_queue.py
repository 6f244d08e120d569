"""The server's own account of the prefill ahead of a new request (PrefillQueue)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.serve.prefill_queue import PrefillQueue


def test_a_long_prefill_in_flight_is_a_wait_and_a_first_token_recounts_the_rest():
    """A cold request's 60 ms prefill handed over at t=0: a request at t=0.02 has 40 ms
    ahead (vLLM would report nothing waiting); a second request queues behind it; the
    first's first token (early, at 0.05) counts the second's 30 ms from then; the last
    one back leaves nothing ahead, and later requests start from their own time."""
    q = PrefillQueue()
    assert q.ahead(0.0) == 0.0
    a = q.submit(0.060, now=0.0)
    assert q.ahead(0.02) == pytest.approx(0.040)
    b = q.submit(0.030, now=0.02)
    assert q.ahead(0.02) == pytest.approx(0.070)
    q.done(a, now=0.05)
    assert q.ahead(0.05) == pytest.approx(0.030) and len(q) == 1
    q.done(a, now=0.06)  # again: nothing
    assert q.ahead(0.05) == pytest.approx(0.030)
    assert q.ahead(0.5) == 0.0  # overdue: never negative
    q.done(b, now=0.5)
    assert q.ahead(0.5) == 0.0 and len(q) == 0
    q.submit(0.010, now=1.0)  # idle since: from now, not from the old finish
    assert q.ahead(1.0) == pytest.approx(0.010)


@pytest.mark.parametrize("work", [-0.001, math.inf, math.nan])
def test_a_prediction_that_is_no_duration_is_refused(work):
    with pytest.raises(ValueError, match="work_s"):
        PrefillQueue().submit(work, now=0.0)


@settings(max_examples=200, deadline=None, database=None)
@given(events=st.lists(st.tuples(st.booleans(), st.floats(0, 0.2), st.floats(0, 0.05)),
                       max_size=40))
def test_ahead_is_never_negative_nor_more_than_the_pending_work(events):
    """Any interleaving of submissions and first tokens (out of order too) at rising
    times: what is ahead lies in [0, the pending predictions' sum], and once every
    request came back nothing is ahead."""
    q, now, pending = PrefillQueue(), 0.0, {}
    for submit, work, dt in events:
        now += dt
        if submit or not pending:
            pending[q.submit(work, now=now)] = work
        else:
            handle = sorted(pending)[len(pending) // 2]
            pending.pop(handle)
            q.done(handle, now=now)
            assert q.ahead(now) == pytest.approx(sum(pending.values()))
        assert 0.0 <= q.ahead(now) <= sum(pending.values()) + 1e-9
    for handle in list(pending):
        q.done(handle, now=now)
    assert q.ahead(now) == 0.0 and len(q) == 0
