"""benchmarks.rescore: peer runs merged by the goodput rule, load results rescored from
their own rows, mismatched runs refused."""

import json

import pytest

from benchmarks import rescore

SETTINGS = {"model": "llama-3.1-8b-shape", "top_k": 50, "max_tokens": 32,
            "objective_ms": 250.0, "requests_per_step": 400, "zipf": 1.0,
            "facts_per_user": 400, "device": "NVIDIA H200", "memory_dtype": "float8_e4m3fn"}


def row(mode: str, rate: float, p99: float) -> dict:
    return {"mode": mode, "rate": rate, "ttft_p99_ms": p99, "meets_objective": p99 <= 250,
            "memory_check": {"answers": 400, "foreign": 0, "without_memory": 0,
                             "by_starting_tier": {"gpu": 300, "storage": 100}}}


def peer_run(rates_p99: dict, counts=(200, 2000)) -> dict:
    return {**SETTINGS, "modes": ["peer"], "user_counts": list(counts), "command": "peer",
            "rows": [row("peer", r, p) for r, p in rates_p99.items()]}


def load_run() -> dict:
    rows = [row("kv", r, p) for r, p in ((5, 173.0), (6, 130.0), (10, 214.0), (21, 340.0))]
    return {**SETTINGS, "modes": ["kv"], "user_counts": [200, 2000], "command": "load",
            "rows": rows, "summary": {"goodput_peer_rps": 0.0, "goodput_vs_peer": None,
                                      "prompt": {"goodput_rps": 7.0,
                                                 "given": "measured in another run"}}}


def test_merged_peer_takes_the_highest_rate_met_below_the_first_miss():
    merged = rescore.merge_peers([("a", peer_run({5: 270.3})), ("b", peer_run({4: 236.6}, (200,)))],
                                 "cmd")
    assert merged["rates"] == [4, 5]
    assert merged["summary"]["peer"] == {"goodput_rps": 4, "first_miss_rps": 5,
                                         "lower_bound": False, "below_lowest_rate": False}
    assert [m["file"] for m in merged["merged_from"]] == ["a", "b"]


@pytest.mark.parametrize("change", [{"device": "NVIDIA H100"}, {"top_k": 20},
                                    {"user_counts": [24]}, {"modes": ["kv"]}])
def test_peers_of_other_settings_are_refused(change):
    with pytest.raises(ValueError):
        rescore.merge_peers([("a", peer_run({5: 270.3})),
                             ("b", {**peer_run({4: 236.6}), **change})], "cmd")


def test_a_rate_run_twice_is_refused():
    with pytest.raises(ValueError, match="twice"):
        rescore.merge_peers([("a", peer_run({5: 270.3})), ("b", peer_run({5: 240.0}))], "cmd")


def test_load_is_scored_from_its_rows_against_the_merged_peer():
    peer = rescore.merge_peers([("a", peer_run({5: 270.3})), ("b", peer_run({4: 236.6}))],
                               "cmd")
    out = rescore.rescore(load_run(), peer, "peer.json", "cmd")
    s = out["summary"]
    assert s["goodput_kv_rps"] == 10 and s["goodput_peer_rps"] == 4
    assert s["goodput_vs_peer"] == 2.5 and s["goodput_vs_peer_is"] == "measured"
    assert s["kv_p99_ttft_at_peer_goodput_ms"] is None  # KV never ran at 4 rps
    assert s["goodput_prompt_rps"] == 7.0 and s["goodput_vs_prompt"] == round(10 / 7, 2)
    assert out["rows"] == load_run()["rows"]
    assert out["rescored"]["goodput_vs_peer_before"] is None
    with pytest.raises(ValueError, match="other settings"):
        rescore.rescore({**load_run(), "top_k": 20}, peer, "peer.json", "cmd")


def test_cli_writes_both_and_never_overwrites_its_inputs(tmp_path, capsys):
    a, b, load = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "load-u2000.json"
    a.write_text(json.dumps(peer_run({5: 270.3})))
    b.write_text(json.dumps(peer_run({4: 236.6})))
    load.write_text(json.dumps(load_run()))
    with pytest.raises(SystemExit):
        rescore.main(["--peers", str(a), "--peer-out", str(tmp_path / "p.json"),
                      "--out-dir", str(tmp_path), str(load)])
    out = tmp_path / "out"
    out.mkdir()
    assert rescore.main(["--peers", str(a), str(b), "--peer-out", str(out / "p.json"),
                         "--out-dir", str(out), str(load)]) == 0
    assert json.loads((out / "load-u2000.json").read_text())["summary"]["goodput_vs_peer"] == 2.5
    assert json.loads((out / "p.json").read_text())["summary"]["goodput_peer_rps"] == 4
    assert "goodput_vs_peer 2.5" in capsys.readouterr().out
    assert rescore.main(["--peers", str(a), str(a), "--peer-out", str(out / "q.json")]) == 2
    assert not (out / "q.json").exists()


@pytest.mark.parametrize("content", ["[1, 2]", "{\"rows\": 3}", "{\"rows\": [1]}", "not json",
                                     "{\"modes\": [\"peer\"], \"rows\": []}", ""])
def test_hostile_files_end_in_a_message_and_write_nothing(tmp_path, capsys, content):
    bad, good = tmp_path / "bad.json", tmp_path / "good.json"
    bad.write_text(content)
    good.write_text(json.dumps(peer_run({4: 236.6})))
    out = tmp_path / "out"
    out.mkdir()
    for peers, loads in (([bad], []), ([good], [bad]), ([bad, good], [])):
        assert rescore.main(["--peers", *map(str, peers), "--peer-out", str(out / "p.json"),
                             "--out-dir", str(out), *map(str, loads)]) == 2
        assert list(out.iterdir()) == []
        assert capsys.readouterr().err.startswith("rescore: ")
