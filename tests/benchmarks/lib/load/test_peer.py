"""The load benchmark against stock vLLM (benchmarks/load_peer.py) and what every load
result reports beside it, without an engine: the peer's rates and KV's rates at
multiples of the peer's goodput, goodput_vs_peer and KV's p99 TTFT at the peer's goodput,
whose memory each answer used, the requests by starting tier, the peer's result read
back (and refused when measured under other settings), the reuse of published users,
the server's memory-cache settings, the vllm serve command and the peer's prompts
composed by the library exactly as the prompt mode composes them."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import load_plan, load_setup, load_stats
from benchmarks import load_users as lu
from test_bench_load import _args, _conversation, _drive, _row  # noqa: F401 - fixtures

FP = "fp-peer-test"


# ------------------------------------------------------------------------ rates


def test_the_peer_rises_through_the_rates_until_its_first_miss():
    peer = _drive(_args(modes=["peer"]), lambda m, r: r <= 4)
    assert peer == [("peer", 2.0, True), ("peer", 4.0, True), ("peer", 8.0, False)]


def test_kv_runs_at_the_peer_goodput_and_its_multiples():
    args = _args(peer_goodput=6.0, kv_rate_multipliers=[3, 5])
    h = _drive(args, lambda m, r: r <= (4 if m == "prompt" else 30))
    # the peer's P = 6 (1 x P always) and its multiples, whatever the baseline's G = 4
    assert [(m, r) for m, r, _ in h] == [("prompt", 2.0), ("prompt", 4.0), ("prompt", 8.0),
                                         ("kv", 6.0), ("kv", 18.0), ("kv", 30.0)]
    # a later count without the baseline (--prompt-once): P and its multiples only
    kv_only = _drive(_args(modes=["kv"], peer_goodput=6.0, kv_rate_multipliers=[3, 5]),
                     lambda m, r: r < 30, given=4.0)
    assert [r for _, r, _ in kv_only] == [6.0, 18.0, 30.0]
    # KV misses at its lowest candidate: the rates below it, rising
    low = _drive(_args(modes=["kv"], peer_goodput=6.0), lambda m, r: r <= 2, given=None)
    assert [(r, ok) for _, r, ok in low] == [(6.0, False), (2.0, True), (4.0, False)]


def test_estimate_of_the_peer_run_and_of_kv_at_the_peer_multiples():
    args = _args(modes=["peer"], rates=[4.0, 8.0], requests=40, warmup_requests=8,
                 warmup_rate=8.0, estimate_start_s=100.0)
    est = load_plan.estimate(args, [24, 200], setup_s=10)

    def step(rate, n=40):
        return n / rate + 3 + 1

    by = {c["prompt_goodput"]: c["seconds"] for c in est["by_prompt_goodput"]}
    # one count only, no hydration, its warm-up burst, rising until the first miss
    assert by[4.0] == round(10 + 100 + step(8, 8) + step(4) + step(8))
    assert est["baseline"] == "peer" and "stock vLLM" in load_plan.estimate_line(est, [24])
    kv = _args(modes=["kv"], peer_goodput=4.0, kv_rate_multipliers=[2], requests=40,
               warmup_requests=8, warmup_rate=8.0, prompt_goodput=[4.0])
    est = load_plan.estimate(kv, [24], {24: 2}, setup_s=0)
    assert est["max_s"] == round(2 + step(8, 8) + step(4) + step(8))


# ------------------------------------------------------------------------ summaries


def _records(users_asked, used):
    out = []
    for i, (user, (m_user, version)) in enumerate(zip(users_asked, used)):
        out.append({"user": user, "scheduled": i * 0.5, "sent": 10.0 + i, "lag_ms": 1.0,
                    "ttft_ms": 50.0, "e2e_ms": 90.0, "end": 11.0 + i, "tokens": 4,
                    "memory_user": m_user, "memory_version": version,
                    "facts_by_tier": {"gpu": 45, "host": 0, "storage": 5 * (i == 2)}})
    return out


def test_memory_check_counts_answers_from_another_users_memory():
    users = {"u0": {"version": "v0", "tier": "gpu"}, "u1": {"version": "v1", "tier": "storage"}}
    fine = load_stats.step_summary(
        _records(["u0", "u1", "u1"], [("u0", "v0"), ("u1", "v1"), ("u1", "v1")]),
        "kv", 2.0, 100, users)
    assert fine["memory_check"]["foreign"] == 0 and fine["memory_check"]["answers"] == 3
    assert fine["memory_check"]["by_starting_tier"] == {"gpu": 1, "host": 0, "storage": 2}
    assert fine["served_from"] == {"gpu": 2, "host": 0, "storage": 1, "none": 0}
    # u1 answered from u0's memory, or from a version that is not u1's own, or without
    bad = load_stats.step_summary(
        _records(["u1", "u1", "u0"], [("u0", "v0"), ("u1", "v0"), (None, None)]),
        "kv", 2.0, 100, users)
    check = bad["memory_check"]
    assert check["foreign"] == 2 and check["without_memory"] == 1
    assert check["foreign_examples"][0] == {"user": "u1", "memory_user": "u0",
                                            "memory_version": "v0"}
    assert load_stats.step_summary(_records(["u0"], [("u0", "v0")]), "kv", 2.0, 100)[
        "memory_check"] is None  # no users given: not checked
    peer = load_stats.step_summary(_records(["u0"], [("u0", "v0")]), "peer", 2.0, 100,
                                   {"u0": {"version": "v0", "tier": None}})
    assert peer["memory_check"]["foreign"] == 0 and peer["served_from"] is None
    assert peer["memory_check"]["by_starting_tier"] is None  # stock vLLM has no tiers
    rows = [{**_row("kv", 8, True, 60), **fine}, {**_row("kv", 16, True, 80), **bad}]
    s = load_stats.summarize(rows, _args(peer_goodput=8.0, peer_source="peer.json"))
    assert s["memory"] == {"answers": 6, "foreign": 2, "without_memory": 1,
                           "no_foreign_memory": False}
    assert s["kv_requests_by_starting_tier"] == {"gpu": 0.3333, "host": 0.0, "storage": 0.6667}
    assert math.isclose(sum(s["kv_requests_served_from"].values()), 1.0)


def test_summary_against_the_peer():
    rows = [_row("prompt", 4, True, 200), _row("prompt", 8, False, 400),
            _row("kv", 4, True, 50), _row("kv", 6, True, 70), _row("kv", 18, True, 120),
            _row("kv", 30, True, 200), _row("kv", 36, False, 300)]
    s = load_stats.summarize(rows, _args(peer_goodput=6.0, peer_source="peer.json"))
    assert (s["goodput_peer_rps"], s["goodput_kv_rps"], s["goodput_vs_peer"]) == (6.0, 30, 5.0)
    assert s["goodput_vs_peer_is"] == "measured" and s["goodput_vs_prompt"] == 7.5
    assert s["kv_p99_ttft_at_peer_goodput_ms"] == 70
    assert s["kv_p99_ttft_at_prompt_goodput_ms"] == 50  # a KV step ran at G = 4 here
    assert s["peer"]["given"] == "peer.json"
    never = load_stats.summarize(rows[:-1], _args(peer_goodput=6.0))
    assert never["goodput_vs_peer_is"] == "a lower bound"
    unmissed = load_stats.summarize(rows, _args(peer_goodput=6.0, peer_lower_bound=True))
    assert unmissed["goodput_vs_peer_is"] == "an upper bound"  # the peer never missed
    zero = load_stats.summarize(rows, _args(peer_goodput=0.0, peer_first_miss=5.0))
    assert zero["goodput_vs_peer"] is None and zero["goodput_vs_peer_above"] == 6.0
    none = load_stats.summarize(rows, _args())
    assert none["goodput_vs_peer"] is None and none["kv_p99_ttft_at_peer_goodput_ms"] is None
    own = load_stats.summarize([_row("peer", 4, True, 200), _row("peer", 6, True, 240),
                                _row("peer", 8, False, 300)], _args(modes=["peer"]))
    assert own["goodput_peer_rps"] == 6 and own["peer"]["first_miss_rps"] == 8
    lines = load_stats.progress({"users": 24, "rows": rows, "summary": s})
    assert "goodput_vs_peer 5.0" in lines[-1]


# ------------------------------------------------------------------------ the peer's file


def _setup_args(tmp_path, *extra):
    conv = _conversation(tmp_path, "c0", 8)
    ap = load_setup.parser("test")
    return ap, lambda *more: load_setup.resolve(
        ap, ap.parse_args(["--conversations", conv, "--top-k", "5", *extra, *more]), False)


def test_the_peer_result_is_read_and_refused_under_other_settings(tmp_path):
    _, resolve = _setup_args(tmp_path)
    peer = {"command": "python benchmarks/load.py --peer", "model": "embedded", "top_k": 5,
            "max_tokens": 32, "objective_ms": 1000.0, "requests_per_step": 50, "zipf": 1.0,
            "facts_per_user": 400, "summary": {"goodput_peer_rps": 6.0}}
    path = tmp_path / "peer.json"
    path.write_text(json.dumps(peer))
    args = resolve("--peer-result", str(path), "--modes", "kv")
    assert args.peer_goodput == 6.0 and str(path) in args.peer_source
    assert args.peer_lower_bound is False
    path.write_text(json.dumps({**peer, "summary": {"goodput_peer_rps": 10.0,
                                                    "peer": {"lower_bound": True}}}))
    assert resolve("--peer-result", str(path)).peer_lower_bound is True
    path.write_text(json.dumps({**peer, "top_k": 50}))
    with pytest.raises(SystemExit):
        resolve("--peer-result", str(path))
    path.write_text(json.dumps({"summary": {}}))
    with pytest.raises(SystemExit):
        resolve("--peer-result", str(path))
    with pytest.raises(SystemExit):  # the peer run itself takes no peer goodput
        resolve("--peer", "--peer-goodput", "3")
    assert resolve("--peer").modes == ["peer"]
    with pytest.raises(SystemExit):  # KV alone needs some baseline's goodput
        resolve("--modes", "kv")
    assert resolve("--modes", "kv", "--peer-goodput", "6").peer_goodput == 6.0


def test_memory_cache_settings_build_the_servers_config(tmp_path):
    from inferscale.serve.memory_cache import MemoryCacheConfig

    _, resolve = _setup_args(tmp_path)
    cfg = MemoryCacheConfig(**load_setup.memory_cache_settings(resolve()))
    assert cfg.budget_bytes == 8 << 30 and cfg.misses_per_s >= 1e6  # never shed by default


def test_published_users_are_reused_only_with_the_same_settings(tmp_path):
    _, resolve = _setup_args(tmp_path)
    args = resolve("--reuse-memory", "--groups", "2")
    assert load_setup.reused_memory(args, tmp_path, 10) is None  # nothing published yet
    (tmp_path / load_setup.MEMORY_FILE).write_text(json.dumps(
        {"key": load_setup.memory_key(args, 10), "versions": {"load-0000": {"version": "v"}}}))
    assert load_setup.reused_memory(args, tmp_path, 10)["versions"]["load-0000"]["version"] == "v"
    with pytest.raises(ValueError, match="groups, users"):
        load_setup.reused_memory(resolve("--reuse-memory", "--groups", "3"), tmp_path, 12)
    assert load_setup.reused_memory(resolve(), tmp_path, 12) is None  # not asked to reuse


def test_vllm_serve_command_and_its_config_from_the_log(tmp_path):
    from benchmarks.load_peer import peer_argv, serve_entry, server_config

    memory = {"server": {"engine": {"model": "/w/llama-3.1-8b-shape"}, "tokenizer": "/w/tok"}}
    args = SimpleNamespace(model="llama-3.1-8b-shape", peer_serve_args="")
    argv = peer_argv(args, memory, 8123)
    assert argv[1:3] == ["-m", serve_entry()[1]] and argv[4:6] == ["/w/llama-3.1-8b-shape",
                                                                    "--tokenizer"]
    assert argv[-2:] == ["--load-format", "dummy"] and "--port" in argv
    real = peer_argv(SimpleNamespace(model="embedded", peer_serve_args="--max-model-len 4096"),
                     memory, 8123)
    assert "--load-format" not in real and real[-2:] == ["--max-model-len", "4096"]

    class NoServerInfo:  # a server without the dev endpoints answers 404
        def get(self, path):
            return (200, json.dumps({"version": "0.26.0"})) if path == "/version" else (404, "")

    log = tmp_path / "peer.log"
    log.write_text("INFO ... Chunked prefill is enabled with max_num_batched_tokens=8192.\n")
    cfg = server_config(NoServerInfo(), log)
    assert cfg == {"vllm_version": "0.26.0", "scheduler": {"max_num_batched_tokens": 8192},
                   "scheduler_source": "the server's log"}


def test_peer_prompts_are_the_prompt_modes(tmp_path, embedder):
    """The peer's prompt for (user, question) is the token ids the prompt mode composes:
    the same published facts, retrieval and composer."""
    from transformers import AutoTokenizer

    from benchmarks.load_peer import PeerPrompts
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.compose import Composer
    from inferscale.models import resolve_checkpoint
    from inferscale.settings import Settings

    tok_dir = resolve_checkpoint("embedded", Settings().home)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    convs = [_conversation(tmp_path, "c0", 8), _conversation(tmp_path, "c1", 6)]
    pool = lu.pool_turns(convs, tok)
    groups = lu.make_groups(len(pool), 2, 6, 3)
    store = StoreConfig(str(tmp_path / "artifacts"))
    embeddings = embedder.embed([t.text for t in pool]).float().cpu().numpy()
    versions = lu.publish_users(store, groups, pool, embeddings, lambda g, f: lu.group_memory(
        g, f, None, tok, pool, FP, shape=(2, 2, 8)), progress=lambda m: None)
    memory = {"server": {"engine": {"artifact_root": store.root, "model_fingerprint": FP},
                         "tokenizer": str(tok_dir)}}
    prompts = PeerPrompts(SimpleNamespace(top_k=3), memory, embedder)
    question = "c0 question 1?"
    prompts.compose([(0.1, "load-0001", question), (0.2, "load-0001", question)])
    ids, info = prompts.composed[("load-0001", question)]
    assert len(prompts.composed) == 1
    assert info["user"] == "load-0001" and info["version"] == versions["load-0001"]["version"]
    assert info["mode"] == "prompt" and len(info["facts"]) == 3
    # the same prompt, independently: the top 3 of the user's facts by cosine, as text
    q = embedder.embed([question])[0].float().cpu().numpy()
    group = groups[1]
    order = np.argsort(-(embeddings[group.turns] @ q))[:3]
    composer = Composer(tok)
    expected, _ = composer.compose([composer.prefix_ids()] + [
        pool[group.turns[i]].token_ids for i in order], question, [])
    assert ids == expected
