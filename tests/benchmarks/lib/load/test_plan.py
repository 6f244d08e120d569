"""What the load benchmark runs (``benchmarks.lib.load.plan``): the users' starting
tiers, the rates each mode runs (the prompt baseline, KV at multiples of a baseline's
goodput, stock vLLM rising until its first miss) and how long a run takes."""

from __future__ import annotations

from benchmarks.lib.load import plan
from tests.benchmarks.load_helpers import load_args


def test_tier_plan_fills_gpu_then_host():
    args = load_args(gpu_budget_gib=2.0, host_budget_gib=1.5)
    users = ["u0", "u1", "u2", "u3", "u4"]
    tiers = plan.tier_plan(users, dict.fromkeys(users, 3 * plan.GIB // 4), args)
    assert tiers == {"gpu": ["u0", "u1"], "host": ["u2", "u3"], "storage": ["u4"]}


def _drive(args, passes, given=None):
    """The steps the planner runs against ``passes(mode, rate) -> met``, in order."""
    history = []
    while (step := plan.next_step(history, args, given)) is not None:
        history.append((*step, passes(*step)))
        assert len(history) < 40
    return history


def test_adaptive_rates_baseline_until_its_miss_then_kv_at_multiples_of_its_goodput():
    h = _drive(load_args(), lambda m, r: r <= (4 if m == "prompt" else 12))
    assert h == [("prompt", 2.0, True), ("prompt", 4.0, True), ("prompt", 8.0, False),
                 ("kv", 4.0, True), ("kv", 8.0, True), ("kv", 12.0, True), ("kv", 16.0, False)]
    never = _drive(load_args(), lambda m, r: m == "kv" or r <= 4)  # KV never misses
    assert [r for m, r, _ in never if m == "kv"] == [4, 8, 12, 16, 20]
    # KV misses at G: the baseline's rates below G, rising, until KV's first miss
    at_g = _drive(load_args(), lambda m, r: r <= (8 if m == "prompt" else 2))
    assert [(r, ok) for m, r, ok in at_g if m == "kv"] == [(8, False), (2, True), (4, False)]
    # the baseline misses at its lowest rate (G = 0): KV rises through --rates
    zero = _drive(load_args(), lambda m, r: m == "kv" and r <= 4)
    assert zero == [("prompt", 2.0, False), ("kv", 2.0, True), ("kv", 4.0, True),
                    ("kv", 8.0, False)]


def test_kv_only_same_rates_own_rates_and_skipped_steps():
    assert _drive(load_args(modes=["kv"]), lambda m, r: r < 30, given=10.0) == [
        ("kv", 10.0, True), ("kv", 20.0, True), ("kv", 30.0, False)]
    assert _drive(load_args(modes=["prompt"]), lambda m, r: r < 8) == [
        ("prompt", 2.0, True), ("prompt", 4.0, True), ("prompt", 8.0, False)]
    same = _drive(load_args(kv_rates="same"), lambda m, r: r <= (4 if m == "prompt" else 8))
    assert same == [("prompt", 2, True), ("kv", 2, True), ("kv", 4, True), ("prompt", 4, True),
                    ("prompt", 8, False), ("kv", 8, True), ("kv", 16, False)]
    own = _drive(load_args(kv_rates=[3.0, 6.0]), lambda m, r: True)
    assert [r for m, r, _ in own if m == "kv"] == [3.0, 6.0]
    skipped = [("prompt", 2.0, True), ("prompt", 4.0, None)]  # past the deadline: mode over
    assert plan.next_step(skipped, load_args()) == ("kv", 2.0)


def test_the_peer_rises_through_the_rates_until_its_first_miss():
    peer = _drive(load_args(modes=["peer"]), lambda m, r: r <= 4)
    assert peer == [("peer", 2.0, True), ("peer", 4.0, True), ("peer", 8.0, False)]


def test_kv_runs_at_the_peer_goodput_and_its_multiples():
    args = load_args(peer_goodput=6.0, kv_rate_multipliers=[3, 5])
    h = _drive(args, lambda m, r: r <= (4 if m == "prompt" else 30))
    # the peer's P = 6 (1 x P always) and its multiples, whatever the baseline's G = 4
    assert [(m, r) for m, r, _ in h] == [("prompt", 2.0), ("prompt", 4.0), ("prompt", 8.0),
                                         ("kv", 6.0), ("kv", 18.0), ("kv", 30.0)]
    # a later count without the baseline (--prompt-once): P and its multiples only
    kv_only = _drive(load_args(modes=["kv"], peer_goodput=6.0, kv_rate_multipliers=[3, 5]),
                     lambda m, r: r < 30, given=4.0)
    assert [r for _, r, _ in kv_only] == [6.0, 18.0, 30.0]
    # KV misses at its lowest candidate: the rates below it, rising
    low = _drive(load_args(modes=["kv"], peer_goodput=6.0), lambda m, r: r <= 2, given=None)
    assert [(r, ok) for _, r, ok in low] == [(6.0, False), (2.0, True), (4.0, False)]


def test_estimate_adds_arrivals_drains_warmups_and_hydration():
    args = load_args(rates=[10.0, 20.0], kv_rate_multipliers=[1, 2], requests=100,
                 warmup_requests=10, warmup_rate=10.0)
    est = plan.estimate(args, [4], {4: 3}, setup_s=60)

    def step(rate, n=100):
        return n / rate + 3 + 1  # arrivals, drain and scrapes, settle

    fixed = 60 + 3 * 1.0 + 2 * step(10, 10)
    by = {c["prompt_goodput"]: c["seconds"] for c in est["by_prompt_goodput"]}
    assert by[10.0] == round(fixed + step(10) + step(20) + step(10) + step(20))
    assert by[20.0] == round(fixed + step(10) + step(20) + step(20) + step(40))
    assert by[0.0] == round(fixed + step(10) + step(10) + step(20))  # KV through --rates
    assert (est["min_s"], est["max_s"]) == (min(by.values()), max(by.values()))
    assert "min" in plan.estimate_line(est, [4])
    once = plan.estimate(load_args(**{**vars(args), "prompt_once": True}), [4, 4], {4: 3})
    twice = plan.estimate(args, [4, 4], {4: 3})
    by_once = {c["prompt_goodput"]: c["seconds"] for c in once["by_prompt_goodput"]}
    by_twice = {c["prompt_goodput"]: c["seconds"] for c in twice["by_prompt_goodput"]}
    # the second count runs no baseline: its steps and its warm-up burst are saved
    assert by_twice[10.0] - by_once[10.0] == round(step(10) + step(20) + step(10, 10))


def test_estimate_of_the_peer_run_and_of_kv_at_the_peer_multiples():
    args = load_args(modes=["peer"], rates=[4.0, 8.0], requests=40, warmup_requests=8,
                 warmup_rate=8.0, estimate_start_s=100.0)
    est = plan.estimate(args, [24, 200], setup_s=10)

    def step(rate, n=40):
        return n / rate + 3 + 1

    by = {c["prompt_goodput"]: c["seconds"] for c in est["by_prompt_goodput"]}
    # one count only, no hydration, its warm-up burst, rising until the first miss
    assert by[4.0] == round(10 + 100 + step(8, 8) + step(4) + step(8))
    assert est["baseline"] == "peer" and "stock vLLM" in plan.estimate_line(est, [24])
    kv = load_args(modes=["kv"], peer_goodput=4.0, kv_rate_multipliers=[2], requests=40,
               warmup_requests=8, warmup_rate=8.0, prompt_goodput=[4.0])
    est = plan.estimate(kv, [24], {24: 2}, setup_s=0)
    assert est["max_s"] == round(2 + step(8, 8) + step(4) + step(8))
