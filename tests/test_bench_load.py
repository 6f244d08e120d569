"""The load benchmark's pieces without an engine: users in memory groups whose linked
artifacts hydrate and verify like any other, their questions and popularity, the tier
plan, and the statistics that decide goodput (benchmarks/load.py, load_users.py, load_stats.py)."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks import load, load_stats
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
    plan = load.tier_plan(users, dict.fromkeys(users, 3 * load_stats.GIB // 4), args)
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
