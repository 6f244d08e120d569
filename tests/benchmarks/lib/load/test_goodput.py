"""The load benchmark's pieces without an engine: users in memory groups whose linked
artifacts hydrate and verify like any other, their questions and popularity, the tier
plan, the rates each mode runs, the statistics that decide goodput, the reading of the
server's /metrics (a real scrape of the CPU server, plus the worker metrics' lines), and
finding vLLM's engine-core process (benchmarks/load*.py)."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks import load_plan, load_stats
from benchmarks import load_users as lu
from inferscale.artifacts.layout import KV_FILE, StoreConfig
from inferscale.artifacts.blobs import Location
from inferscale.hydrate.slab import hydrate

FP = "fp-load-test"


def _conversation(path, name: str, turns: int) -> str:
    """A LoCoMo-format conversation of ``turns`` turns in two sessions, with questions."""
    half = turns // 2
    session = lambda s, n: [  # noqa: E731
        {"speaker": "Ann" if i % 2 == 0 else "Bob", "dia_id": f"D{s}:{i + 1}",
         "text": f"{name} session {s} turn {i}: I went hiking near lake {i}."} for i in range(n)]
    conv = {"speaker_a": "Ann", "speaker_b": "Bob",
            "session_1_date_time": "1:56 pm on 8 May, 2023", "session_1": session(1, half),
            "session_2_date_time": "2:00 pm on 9 May, 2023", "session_2": session(2, turns - half)}
    qa = [{"question": f"{name} question {i}?", "answer": "x", "evidence": [], "category": c}
          for i, c in enumerate((1, 2, 3, 4, 5, 2))]
    out = path / f"{name}.json"
    out.write_text(json.dumps({"sample_id": name, "conversation": conv, "qa": qa}))
    return str(out)


@pytest.fixture
def users(tmp_path):
    """Two small conversations pooled with the embedded model's tokenizer."""
    from transformers import AutoTokenizer

    from inferscale.models import resolve_checkpoint
    from inferscale.settings import Settings

    tok = AutoTokenizer.from_pretrained(resolve_checkpoint("embedded", Settings().home))
    convs = [_conversation(tmp_path, "c0", 8), _conversation(tmp_path, "c1", 6)]
    return convs, lu.pool_turns(convs, tok), tok


def _kv_path(store, resident) -> str:
    name = resident.manifest.files[KV_FILE].stored_name(KV_FILE)
    return Location(store, resident.user, FP).file(resident.version, name)


def test_groups_windows_and_users():
    groups = lu.make_groups(pool_size=10, groups=3, facts=4, users=7)
    assert [g.turns for g in groups] == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert [g.users for g in groups] == [["load-0000", "load-0003", "load-0006"],
                                         ["load-0001", "load-0004"], ["load-0002", "load-0005"]]
    assert lu.make_groups(10, 2, 8, 2)[1].turns == [5, 6, 7, 8, 9, 0, 1, 2]  # wraps around
    with pytest.raises(ValueError, match="facts per user"):
        lu.make_groups(10, 2, 11, 4)
    with pytest.raises(ValueError, match="groups <= users"):
        lu.make_groups(10, 5, 4, 4)


def test_linked_users_hydrate_verified_and_share_one_file(tmp_path, users):
    convs, pool, tok = users
    assert len(pool) == 14 and pool[8].conversation == 1
    store = StoreConfig(str(tmp_path / "artifacts"))
    groups = lu.make_groups(len(pool), 2, 9, 5)
    embeddings = np.random.default_rng(0).standard_normal((len(pool), 4)).astype(np.float32)

    def memory_of(group, fids):
        return lu.group_memory(group, fids, None, tok, pool, FP, shape=(2, 2, 8))

    versions = lu.publish_users(store, groups, pool, embeddings, memory_of, progress=lambda m: None)
    assert sorted(versions) == [f"load-{i:04d}" for i in range(5)]
    for group in groups:
        first, *others = group.users
        a = hydrate(store, first, FP, device="cpu")  # checksums, sizes, fingerprint verified
        assert a.nbytes == versions[first]["slab_bytes"]
        inode = os.stat(_kv_path(store, a)).st_ino
        for user in others:
            b = hydrate(store, user, FP, device="cpu")
            assert b.user == user and b.version == versions[user]["version"] != a.version
            assert torch.equal(a.slab, b.slab) and a.index == b.index
            assert os.stat(_kv_path(store, b)).st_ino == inode
        # the group's facts, in its pooled order; every user's table names that user
        assert len(a.index) == 1 + len(group.turns)
    # two groups hold different memories
    a, b = (hydrate(store, g.users[0], FP, device="cpu") for g in groups)
    assert not torch.equal(a.slab[: min(len(a.slab), len(b.slab))],
                           b.slab[: min(len(a.slab), len(b.slab))])


def test_questions_follow_the_users_conversations(users):
    convs, pool, _ = users
    questions = lu.locomo_questions(convs)
    assert questions[0] == [f"c0 question {i}?" for i in (0, 1, 2, 3, 5)]  # category 5 left out
    only_c1 = lu.Group(0, [8, 9, 10])
    assert lu.shares(only_c1, pool) == {1: 1.0}
    deck = lu.QuestionDeck(questions, lu.shares(only_c1, pool), seed=3)
    asked = [deck.next() for _ in range(10)]
    assert set(asked[:5]) == set(questions[1]) and asked[5:] == asked[:5]  # cycles
    again = lu.QuestionDeck(questions, lu.shares(only_c1, pool), seed=3)
    assert [again.next() for _ in range(10)] == asked  # same seed, same questions
    with pytest.raises(ValueError, match="no questions"):
        lu.QuestionDeck({0: []}, {0: 1.0}, seed=0)


def test_popularity_is_zipf():
    w = lu.popularity(4, 1.0)
    assert w.sum() == pytest.approx(1.0)
    assert w[0] / w[3] == pytest.approx(4.0)
    assert np.allclose(lu.popularity(3, 0.0), 1 / 3)


def test_tier_plan_fills_gpu_then_host():
    args = SimpleNamespace(gpu_budget_gib=2.0, host_budget_gib=1.5)
    users = ["u0", "u1", "u2", "u3", "u4"]
    plan = load_plan.tier_plan(users, dict.fromkeys(users, 3 * load_stats.GIB // 4), args)
    assert plan == {"gpu": ["u0", "u1"], "host": ["u2", "u3"], "storage": ["u4"]}


def test_percentile_counts_failures_as_largest():
    assert load_stats.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert load_stats.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert load_stats.percentile([1.0] * 99 + [math.inf], 50) == 1.0
    assert load_stats.percentile([1.0] * 99 + [math.inf], 99) == math.inf
    assert math.isnan(load_stats.percentile([], 50))


def _records(ttfts, error_at=None):
    out = []
    for i, t in enumerate(ttfts):
        r = {"scheduled": i * 0.5, "sent": 100.0 + i * 0.5, "lag_ms": 1.0}
        if i == error_at:
            r["error"] = "APIConnectionError: refused"
        else:
            r.update(ttft_ms=t, e2e_ms=t + 100, end=100.0 + i * 0.5 + (t + 100) / 1e3, tokens=8,
                     q2ft_ms=t - 2, engine_ttft_ms=t - 5, injected=100, memory_tokens=120,
                     fallback_reason="not_resident" if i == 0 else None)
        out.append(r)
    return out


def test_step_summary_and_goodput():
    ok = load_stats.step_summary(_records([50.0, 60.0, 70.0, 80.0]), "kv", 2.0,
                                 objective_ms=100)
    assert ok["completed"] == 4 and ok["meets_objective"] and ok["ttft_p50_ms"] == 65.0
    assert ok["fallbacks"] == {"not_resident": 1} and ok["injected_share"] == 1.0
    assert ok["output_tokens_per_s"] == pytest.approx(32 / (1.5 + 0.18), rel=1e-3)
    failed = load_stats.step_summary(_records([50.0] * 4, error_at=2), "prompt", 4.0,
                                     objective_ms=100)
    assert failed["ttft_p99_ms"] is None and not failed["meets_objective"]
    assert failed["errors"] == ["APIConnectionError: refused"]
    rows = [dict(mode="kv", rate=r, meets_objective=r <= 8) for r in (2, 4, 8, 16)]
    rows += [dict(mode="prompt", rate=r, meets_objective=r <= 2) for r in (2, 4)]
    s = load_stats.summarize(rows, SimpleNamespace(objective_ms=250.0, rates=[2, 4, 8, 16]))
    assert (s["goodput_kv_rps"], s["goodput_prompt_rps"], s["goodput_vs_prompt"]) == (8, 2, 4.0)
    assert s["goodput_vs_prompt_is"] == "measured"
    rows_kv_never_missed = [r for r in rows if r["rate"] != 16]
    s = load_stats.summarize(rows_kv_never_missed, SimpleNamespace(objective_ms=250.0,
                                                                   rates=[2, 4, 8, 16]))
    assert s["goodput_vs_prompt"] == 4.0 and s["goodput_vs_prompt_is"] == "a lower bound"
    rows_prompt_never_met = [r for r in rows if r["mode"] == "kv"] + [
        dict(mode="prompt", rate=2, meets_objective=False)]
    s = load_stats.summarize(rows_prompt_never_met, SimpleNamespace(objective_ms=250.0,
                                                                    rates=[2, 4, 8, 16]))
    assert s["goodput_vs_prompt"] is None and s["goodput_vs_prompt_above"] == 4.0
    assert s["kv"]["first_miss_rps"] == 16 and not s["kv"]["lower_bound"]
    never = load_stats.goodput([dict(mode="kv", rate=1, meets_objective=True)], "kv", [1])
    assert never["lower_bound"] and never["goodput_rps"] == 1
    below = load_stats.goodput([dict(mode="kv", rate=1, meets_objective=False)], "kv", [1])
    assert below["below_lowest_rate"] and below["goodput_rps"] == 0.0


def test_step_counts_requests_over_the_objective_and_memory_sources():
    recs = _records([50.0, 150.0, 90.0, 300.0], error_at=1)
    recs[0].update(facts_by_tier={"gpu": 45, "host": 0, "storage": 0}, storage_bytes=0)
    recs[2].update(facts_by_tier={"gpu": 0, "host": 20, "storage": 25}, storage_bytes=4096)
    row = load_stats.step_summary(recs, "kv", 2.0, objective_ms=100)
    assert row["over_objective"] == 2  # the failed request and the 300 ms one
    assert row["facts_by_tier"] == {"gpu": 45, "host": 20, "storage": 25}
    assert row["storage_bytes"] == 4096 and row["requests_reading_storage"] == 1
    old_server = load_stats.step_summary(_records([50.0]), "kv", 2.0, objective_ms=100)
    assert old_server["facts_by_tier"] is None and old_server["storage_bytes"] is None


# ------------------------------------------------------------------------ rates


def _args(**kw):
    base = dict(modes=["prompt", "kv"], rates=[2.0, 4.0, 8.0, 16.0], kv_rates="adaptive",
                kv_rate_multipliers=[1, 2, 3, 4, 5], requests=400, settle_s=1.0,
                warmup_requests=64, warmup_rate=64.0, estimate_hydrate_s=1.0,
                prompt_goodput=None, objective_ms=250.0)
    return SimpleNamespace(**{**base, **kw})


def _drive(args, passes, given=None):
    """The steps the planner runs against ``passes(mode, rate) -> met``, in order."""
    history = []
    while (step := load_plan.next_step(history, args, given)) is not None:
        history.append((*step, passes(*step)))
        assert len(history) < 40
    return history


def test_adaptive_rates_baseline_until_its_miss_then_kv_at_multiples_of_its_goodput():
    h = _drive(_args(), lambda m, r: r <= (4 if m == "prompt" else 12))
    assert h == [("prompt", 2.0, True), ("prompt", 4.0, True), ("prompt", 8.0, False),
                 ("kv", 4.0, True), ("kv", 8.0, True), ("kv", 12.0, True), ("kv", 16.0, False)]
    never = _drive(_args(), lambda m, r: m == "kv" or r <= 4)  # KV never misses
    assert [r for m, r, _ in never if m == "kv"] == [4, 8, 12, 16, 20]
    # KV misses at G: the baseline's rates below G, rising, until KV's first miss
    at_g = _drive(_args(), lambda m, r: r <= (8 if m == "prompt" else 2))
    assert [(r, ok) for m, r, ok in at_g if m == "kv"] == [(8, False), (2, True), (4, False)]
    # the baseline misses at its lowest rate (G = 0): KV rises through --rates
    zero = _drive(_args(), lambda m, r: m == "kv" and r <= 4)
    assert zero == [("prompt", 2.0, False), ("kv", 2.0, True), ("kv", 4.0, True),
                    ("kv", 8.0, False)]


def test_kv_only_same_rates_own_rates_and_skipped_steps():
    assert _drive(_args(modes=["kv"]), lambda m, r: r < 30, given=10.0) == [
        ("kv", 10.0, True), ("kv", 20.0, True), ("kv", 30.0, False)]
    assert _drive(_args(modes=["prompt"]), lambda m, r: r < 8) == [
        ("prompt", 2.0, True), ("prompt", 4.0, True), ("prompt", 8.0, False)]
    same = _drive(_args(kv_rates="same"), lambda m, r: r <= (4 if m == "prompt" else 8))
    assert same == [("prompt", 2, True), ("kv", 2, True), ("kv", 4, True), ("prompt", 4, True),
                    ("prompt", 8, False), ("kv", 8, True), ("kv", 16, False)]
    own = _drive(_args(kv_rates=[3.0, 6.0]), lambda m, r: True)
    assert [r for m, r, _ in own if m == "kv"] == [3.0, 6.0]
    skipped = [("prompt", 2.0, True), ("prompt", 4.0, None)]  # past the deadline: mode over
    assert load_plan.next_step(skipped, _args()) == ("kv", 2.0)


def test_estimate_adds_arrivals_drains_warmups_and_hydration():
    args = _args(rates=[10.0, 20.0], kv_rate_multipliers=[1, 2], requests=100,
                 warmup_requests=10, warmup_rate=10.0)
    est = load_plan.estimate(args, [4], {4: 3}, setup_s=60)

    def step(rate, n=100):
        return n / rate + 3 + 1  # arrivals, drain and scrapes, settle

    fixed = 60 + 3 * 1.0 + 2 * step(10, 10)
    by = {c["prompt_goodput"]: c["seconds"] for c in est["by_prompt_goodput"]}
    assert by[10.0] == round(fixed + step(10) + step(20) + step(10) + step(20))
    assert by[20.0] == round(fixed + step(10) + step(20) + step(20) + step(40))
    assert by[0.0] == round(fixed + step(10) + step(10) + step(20))  # KV through --rates
    assert (est["min_s"], est["max_s"]) == (min(by.values()), max(by.values()))
    assert "min" in load_plan.estimate_line(est, [4])
    once = load_plan.estimate(_args(**{**vars(args), "prompt_once": True}), [4, 4], {4: 3})
    twice = load_plan.estimate(args, [4, 4], {4: 3})
    by_once = {c["prompt_goodput"]: c["seconds"] for c in once["by_prompt_goodput"]}
    by_twice = {c["prompt_goodput"]: c["seconds"] for c in twice["by_prompt_goodput"]}
    # the second count runs no baseline: its steps and its warm-up burst are saved
    assert by_twice[10.0] - by_once[10.0] == round(step(10) + step(20) + step(10, 10))


# ------------------------------------------------------------------------ summary


def _row(mode, rate, met, p99, step=(10.0, 12.0)):
    return {"mode": mode, "rate": rate, "meets_objective": met, "ttft_p99_ms": p99,
            "requests": 400, "over_objective": 0 if met else 9,
            "step_p50_ms": step[0] if step else None, "step_p99_ms": step[1] if step else None,
            "step_p99_over_p50": round(step[1] / step[0], 3) if step else None}


def test_summary_kv_at_the_baseline_goodput_and_step_times():
    rows = [_row("prompt", 4, True, 200), _row("prompt", 8, True, 240),
            _row("prompt", 12, False, 400), _row("kv", 8, True, 60), _row("kv", 16, True, 80),
            _row("kv", 24, True, 120, step=(10.0, 14.0)), _row("kv", 32, False, 300,
                                                             step=(10.0, 40.0))]
    s = load_stats.summarize(rows, _args())
    assert (s["goodput_prompt_rps"], s["goodput_kv_rps"], s["goodput_vs_prompt"]) == (8, 24, 3.0)
    assert s["goodput_vs_prompt_is"] == "measured"
    assert s["kv_p99_ttft_at_prompt_goodput_ms"] == 60
    assert s["kv_meets_objective_at_prompt_goodput"] is True
    # below KV's goodput (8 and 16 rps) p99/p50 = 1.2; the 24 rps step (1.4) is at it;
    # reported, no longer a pass/fail target
    assert "kv_step_p99_within_1_5x_p50_below_goodput" not in s
    assert s["kv_step_p99_over_p50_max_below_goodput"] == 1.2
    assert s["kv_step_rates_checked"] == [8, 16]
    assert s["step_time_ms"]["kv"]["32"] == {"p50_ms": 10.0, "p99_ms": 40.0, "p99_over_p50": 4.0,
                                             "queue_mean_ms": None, "prefill_mean_ms": None}
    assert "kv_profiles" not in s
    rows[4]["profile"] = {"files": {"engine": "e16.raw"}}
    rows[6]["profile"] = {"files": {"engine": "e32.raw"}}
    s = load_stats.summarize(rows, _args())
    assert s["kv_profiles"] == {"at_goodput": None, "at_first_miss": {"engine": "e32.raw"}}
    jitter = rows[:3] + [_row("kv", 8, True, 60, step=(10.0, 16.0)), _row("kv", 16, True, 80),
                         _row("kv", 24, False, 300)]
    s = load_stats.summarize(jitter, _args())
    assert s["kv_step_p99_over_p50_max_below_goodput"] == 1.6
    unknown = rows[:3] + [_row("kv", 8, True, 60, step=None), _row("kv", 16, False, 300)]
    s = load_stats.summarize(unknown, _args())  # a server without the step-time histogram
    assert s["kv_step_p99_over_p50_max_below_goodput"] is None


def test_summary_with_the_baseline_goodput_of_another_run():
    rows = [_row("kv", 8, True, 90), _row("kv", 16, True, 95), _row("kv", 24, True, 99)]
    s = load_stats.summarize(rows, _args(modes=["kv"]), prompt_goodput=8.0)
    assert s["goodput_vs_prompt"] == 3.0 and s["goodput_vs_prompt_is"] == "a lower bound"
    assert s["prompt"]["given"] and s["kv_p99_ttft_at_prompt_goodput_ms"] == 90
    lines = load_stats.progress({"users": 48, "rows": rows, "summary": s})
    assert lines[0] == "users 48: 3 steps (running)" and "MISSED" not in "\n".join(lines)
    assert "goodput_vs_prompt 3.0" in lines[-1]


def test_same_seed_same_requests_in_both_modes(users):
    from benchmarks.load_client import Load

    convs, pool, _ = users
    groups = lu.make_groups(len(pool), 2, 9, 4)
    shares = {u: lu.shares(g, pool) for g in groups for u in g.users}
    load = Load(SimpleNamespace(requests=30, request_timeout_s=5.0), "http://127.0.0.1:9",
                lu.locomo_questions(convs), shares)
    load.users, load.weights = ["load-0000", "load-0001", "load-0002"], [0.6, 0.3, 0.1]
    a, b = load.schedule(4.0, seed=7), load.schedule(4.0, seed=7)
    assert a == b and len(a) == 30 and load.schedule(4.0, seed=8) != a
    assert all(t1 < t2 for (t1, *_), (t2, *_) in zip(a, a[1:]))  # rising arrival times
    assert {u for _, u, _ in a} <= set(load.users)
    questions = lu.locomo_questions(convs)
    for _, user, q in a:  # a user asks about the conversations its facts come from
        assert any(q in questions[c] for c in shares[user])
    assert len(load.schedule(64.0, seed=1, n=5)) == 5
    # the warm-up's one request per distinct query length, from the most active user
    lengths = {q: len(q) % 3 for qs in questions.values() for q in qs}
    per_length = load.every_length(lengths, rate=4.0)
    assert sorted(lengths[q] for _, _, q in per_length) == sorted(set(lengths.values()))
    assert [t for t, _, _ in per_length] == [0.25 * (i + 1) for i in range(len(per_length))]
    assert {u for _, u, _ in per_length} == {"load-0000"}  # its facts span both conversations


# ------------------------------------------------------------------------ /metrics


def _worker_families(step_buckets: dict[str, list[float]], scheduler_s: float, worker_s: float,
                     facts: dict[str, int], read_bytes: int) -> str:
    """The worker metrics the connector adds, rendered by prometheus_client the way the
    server's collector renders its worker families (one sample per rank)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    class Families:
        def collect(self):
            hist = HistogramMetricFamily("inferscale_engine_step_seconds", "busy steps",
                                         labels=["rank"])
            for rank, counts in step_buckets.items():
                bounds = ["0.005", "0.01", "0.02", "0.05", "+Inf"]
                running, buckets = 0.0, []
                for bound, n in zip(bounds, counts):
                    running += n
                    buckets.append((bound, running))
                hist.add_metric([rank], buckets, sum_value=running * 0.01)
            yield hist
            side = CounterMetricFamily("inferscale_connector_seconds", "hooks",
                                       labels=["rank", "side"])
            side.add_metric(["0", "scheduler"], scheduler_s)
            side.add_metric(["0", "worker"], worker_s)
            yield side
            tier = CounterMetricFamily("inferscale_memory_facts", "facts", labels=["rank", "tier"])
            for t, n in facts.items():
                tier.add_metric(["0", t], n)
            yield tier
            read = CounterMetricFamily("inferscale_storage_read_bytes", "reads", labels=["rank"])
            read.add_metric(["0"], read_bytes)
            yield read

    registry = CollectorRegistry()
    registry.register(Families())
    return generate_latest(registry).decode()


def test_histogram_quantiles_interpolate_within_buckets():
    from benchmarks.load_metrics import quantile, summarize_histogram

    buckets = [(0.01, 0.0), (0.02, 50.0), (0.05, 99.0), (0.1, 100.0), (math.inf, 100.0)]
    assert quantile(0.5, buckets) == (pytest.approx(0.02), False)
    assert quantile(0.99, buckets) == (pytest.approx(0.05), False)
    assert quantile(0.25, buckets) == (pytest.approx(0.015), False)  # halfway in (0.01, 0.02]
    assert quantile(0.5, [(0.1, 1.0), (math.inf, 100.0)]) == (0.1, True)  # past the last bound
    assert quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) == (None, False)
    s = summarize_histogram({"count": 100.0, "sum": 2.5, "buckets": buckets})
    assert s == {"count": 100, "mean_ms": 25.0, "p50_ms": 20.0, "p99_ms": 50.0,
                 "p50_within_ms": [10.0, 20.0], "p99_within_ms": [20.0, 50.0]}
    capped = summarize_histogram({"count": 100.0, "sum": 9.0,
                                  "buckets": [(0.1, 1.0), (math.inf, 100.0)]})
    assert capped["p99_ms"] == 100.0 and capped["p99_capped"] is True
    assert capped["p99_within_ms"] == [100.0, None]
    assert summarize_histogram(None) is None


_PARENT = """
import subprocess, sys, time
wait = "import time; print('ready', flush=True); time.sleep(60)"
big = "x = bytearray(300 << 20); import time; print('ready', flush=True); time.sleep(60)"
kids = [subprocess.Popen([sys.executable, "-c", big if k == "big" else wait, *title],
                         stdout=subprocess.PIPE, text=True)
        for k, *title in (a.split(":", 1) for a in sys.argv[1:])]
for k in kids:
    assert k.stdout.readline().strip() == "ready"
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(60)
"""


def _server(*kids: str):
    """A stand-in server process (a plain Python parent, so this test's own children, e.g.
    the session's engine, never count) whose children are ``kind[:title]`` each
    (``big``: 300 MiB resident); returns it and its children's pids."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _PARENT, *kids], stdout=subprocess.PIPE,
                            text=True)
    return proc, [int(x) for x in proc.stdout.readline().split()]


def test_engine_core_is_found_among_the_servers_children():
    from benchmarks.load_server import descendants, engine_core_pid, worker_pids

    server, (small, large) = _server("wait", "big")
    try:  # no process named EngineCore: the largest Python child holds the engine
        assert set(descendants(server.pid)) == {small, large}
        assert engine_core_pid(server.pid) == large
        assert engine_core_pid(small) is None  # no children
    finally:
        server.kill()
        server.wait()
    server, (worker, named) = _server("big:VLLM::Worker", "wait:VLLM::EngineCore")
    try:  # vLLM's process titles, in the command line
        assert worker_pids(server.pid) == [worker]
        assert engine_core_pid(server.pid) == named
    finally:
        server.kill()
        server.wait()


def test_step_metrics_from_a_real_scrape_and_the_worker_metrics():
    """Two scrapes of the CPU server around a KV step of 4 requests (one for a user not
    resident, who was reloaded), trimmed to the families the benchmark reads; then the
    same with the connector's worker metrics added, as a server exporting them renders
    them."""
    from pathlib import Path

    from benchmarks.load_metrics import parse, step_metrics, step_time

    data = Path(__file__).parent / "data"
    start = (data / "load-scrape-cpu-start.prom").read_text()
    end = (data / "load-scrape-cpu-end.prom").read_text()
    m = step_metrics(parse(start), parse(end))
    h = m["histograms"]
    assert [h[k]["count"] for k in ("vllm_ttft", "vllm_queue", "vllm_prefill")] == [4, 4, 4]
    assert h["vllm_inter_token"]["count"] == 12  # 3 more tokens per request
    assert h["vllm_prefill"]["mean_ms"] > h["vllm_queue"]["mean_ms"] > 0
    assert h["vllm_ttft"]["p50_ms"] <= h["vllm_ttft"]["p99_ms"]
    lo, hi = h["vllm_ttft"]["p99_within_ms"]
    assert lo <= h["vllm_ttft"]["p99_ms"] <= hi
    assert m["reloads"] == 1 and m["fallbacks"] == {"not_resident": 1.0}
    assert h["reload"]["count"] == 1 and m["preemptions"] == 0
    assert m["resident_users"] == {"gpu": 1.0, "host": 1.0}
    # what this server does not export: None, never an error
    assert h["engine_step"] is None and h["inject_kernel"] is None and h["storage_fetch"] is None
    assert m["connector_seconds"] is None and m["connector_ms_per_busy_step"] is None
    assert m["memory_facts"] is None and m["storage_read_bytes"] is None
    assert step_time(m) == {"step_p50_ms": None, "step_p99_ms": None, "engine_steps": None,
                            "step_p99_over_p50": None, "queue_mean_ms": h["vllm_queue"]["mean_ms"],
                            "prefill_mean_ms": h["vllm_prefill"]["mean_ms"]}

    before = start + _worker_families({"0": [10, 0, 0, 0, 0], "1": [5, 0, 0, 0, 0]}, 1.0, 2.0,
                                      {"gpu": 10, "host": 0, "storage": 0}, 0)
    after = end + _worker_families({"0": [70, 30, 10, 0, 0], "1": [45, 40, 9, 1, 0]}, 1.5, 3.0,
                                   {"gpu": 100, "host": 30, "storage": 15}, 5 << 20)
    m = step_metrics(parse(before), parse(after))
    # both ranks' steps, this step's only: per bucket 100, 70, 19, 1 -> 190 steps
    step = m["histograms"]["engine_step"]
    assert step["count"] == 190 and step["mean_ms"] == pytest.approx(10.0)
    assert step["p50_ms"] == pytest.approx(4.75)  # rank 95 of 100 in (0, 5 ms]
    assert step["p99_ms"] == pytest.approx(10 + 10 * 18.1 / 19, abs=1e-3)  # in (10, 20 ms]
    assert m["connector_seconds"] == {"scheduler": 0.5, "worker": 1.0}
    assert m["connector_ms_per_busy_step"] == {"scheduler": pytest.approx(2.6316, abs=1e-4),
                                               "worker": pytest.approx(5.2632, abs=1e-4)}
    assert m["memory_facts"] == {"gpu": 90, "host": 30, "storage": 15}
    assert m["storage_read_bytes"] == 5 << 20
    t = step_time(m)
    assert (t["step_p50_ms"], t["engine_steps"]) == (4.75, 190)
    assert t["step_p99_over_p50"] == pytest.approx(t["step_p99_ms"] / 4.75, abs=1e-3)


def test_cold_split_flag_is_checked_and_reaches_the_servers_config():
    from benchmarks.load_setup import cold_split_settings, parser

    p = parser("load")
    assert cold_split_settings(p.parse_args([])) == {"mode": "auto", "pinned_chunks": 0}
    assert cold_split_settings(p.parse_args(["--cold-split", "pinned:7"])) == \
        {"mode": "pinned", "pinned_chunks": 7}
    for bad in ("pinned", "pinned:x", "off:3", "sometimes"):
        with pytest.raises(SystemExit):
            p.parse_args(["--cold-split", bad])
