"""The load benchmark's open-loop client (``benchmarks.lib.load.client``): the same seed
gives both modes the same arrivals, users and questions."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.lib.load.client import Load


def test_same_seed_same_requests_in_both_modes(workload):
    shares, questions = workload.shares, workload.questions
    load = Load(SimpleNamespace(requests=30, request_timeout_s=5.0), "http://127.0.0.1:9",
                questions, shares)
    load.users, load.weights = ["load-0000", "load-0001", "load-0002"], [0.6, 0.3, 0.1]
    a, b = load.schedule(4.0, seed=7), load.schedule(4.0, seed=7)
    assert a == b and len(a) == 30 and load.schedule(4.0, seed=8) != a
    assert all(t1 < t2 for (t1, *_), (t2, *_) in zip(a, a[1:]))  # rising arrival times
    assert {u for _, u, _ in a} <= set(load.users)
    for _, user, q in a:  # a user asks about the conversations its facts come from
        assert any(q in questions[c] for c in shares[user])
    assert len(load.schedule(64.0, seed=1, n=5)) == 5
    # the warm-up's one request per distinct query length, from the most active user
    lengths = {q: len(q) % 3 for qs in questions.values() for q in qs}
    per_length = load.every_length(lengths, rate=4.0)
    assert sorted(lengths[q] for _, _, q in per_length) == sorted(set(lengths.values()))
    assert [t for t, _, _ in per_length] == [0.25 * (i + 1) for i in range(len(per_length))]
    assert {u for _, u, _ in per_length} == {"load-0000"}  # its facts span both conversations
