"""``benchmarks.plots`` writes PNGs from result files and skips missing or broken ones."""

from __future__ import annotations

import json

from benchmarks import plots


def _ttft_rows():
    return [{"k": k, "prompt_ttft_ms": 10.0 * k, "inject_gpu_ttft_ms": 5.0 + k,
             "inject_host_ttft_ms": 6.0 + k, "cached_ttft_ms": 4.0 + k,
             "prompt_q2ft_ms": 12.0 * k, "inject_gpu_q2ft_ms": 7.0 + k,
             "inject_host_q2ft_ms": 8.0 + k} for k in (5, 10, 20, 50)]


def _locomo_rows():
    rows = []
    for mode, w, n in (("prompt", None, 20), ("kv_w0", 0, 20), ("kv_w50", 50, 1)):
        for k in (5, 10, 20, 50):
            row = {"mode": mode, "window": w, "k": k, "questions": n, "f1": 0.1 + k / 1000}
            if mode != "prompt":
                row["f1_prompt_same_questions"] = 0.12
            rows.append(row)
    return rows


def _load_rows():
    rows = []
    for mode, worst in (("prompt", 2.0), ("kv", 8.0)):
        for rate in (0.5, 1.0, 2.0, 4.0, 8.0):
            if rate > worst:
                break
            rows.append({"mode": mode, "rate": rate, "ttft_p50_ms": 100.0 * rate,
                         "ttft_p99_ms": None if rate == worst else 300.0 * rate})
    return rows


def test_plots_from_synthetic_results(tmp_path):
    results, figures = tmp_path / "results", tmp_path / "figures"
    results.mkdir()
    (results / "ttft-cpu-test.json").write_text(json.dumps(
        {"model": "m", "device": "cpu", "rows": _ttft_rows(), "summary": {}}))
    (results / "locomo-cpu-test.json").write_text(json.dumps(
        {"model": "m", "conversation": "c.json", "rows": _locomo_rows(), "summary": {}}))
    (results / "load-cpu-test.json").write_text(json.dumps(
        {"users": 4, "top_k": 50, "objective_ms": 1000.0, "rows": _load_rows(),
         "summary": {"goodput_vs_prompt": 4.0}}))
    for name in ("u24", "u48", "u48-tail0"):  # one run's user counts and a variant
        (results / f"load-h200-test-{name}.json").write_text(json.dumps(
            {"users": int(name[1:3]), "top_k": 50, "objective_ms": 250.0, "rows": _load_rows(),
             "requests_per_step": 400, "summary": {"goodput_vs_prompt": 3.0}}))
    (results / "ttft-broken.json").write_text("{not json")
    (results / "locomo-empty.json").write_text(json.dumps({"rows": []}))
    written = plots.main(["--results", str(results), "--figures", str(figures)])
    names = sorted(p.name for p in written)
    assert names == ["load-cpu-test.png", "load-h200-test-goodput-users.png",
                     "load-h200-test-u24.png", "load-h200-test-u48-tail0.png",
                     "load-h200-test-u48.png", "load-h200-test-users.png", "locomo-cpu-test.png",
                     "ttft-cpu-test.png"]
    for p in written:
        assert p.stat().st_size > 1000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_without_results(tmp_path, capsys):
    assert plots.main(["--results", str(tmp_path / "none"),
                       "--figures", str(tmp_path / "figures")]) == []
    assert "skipped" in capsys.readouterr().err


def _scenario(users, kv, kv_never_missed, prompt, prompt_given):
    summary = {"goodput_kv_rps": kv, "goodput_prompt_rps": prompt,
               "kv": {"goodput_rps": kv, "lower_bound": kv_never_missed},
               "prompt": {"goodput_rps": prompt, **({"given": "the 24-user scenario"}
                                                     if prompt_given else {})}}
    return {"users": users, "model": "m", "top_k": 50, "objective_ms": 250.0,
            "requests_per_step": 400, "rows": _load_rows(), "summary": summary}


def test_goodput_against_users_with_stock_vllm(tmp_path):
    """Three scenario files and the peer's: goodput per user count for KV injection, the
    prompt mode (measured in the first file only) and stock vLLM; p99 against the rate
    with the peer's rows."""
    results, figures = tmp_path / "results", tmp_path / "figures"
    results.mkdir()
    for users, kv, never, given in ((24, 32.0, True, False), (200, 30.0, False, True),
                                    (2000, 18.0, False, True)):
        (results / f"load-h200-fixture-u{users}.json").write_text(
            json.dumps(_scenario(users, kv, never, 4.0, given)))
    peer_rows = [{"mode": "peer", "rate": r, "ttft_p50_ms": 90.0, "ttft_p99_ms": 100.0 * r}
                 for r in (1.0, 2.0, 3.0)]
    (results / "peer-h200-fixture.json").write_text(json.dumps(
        {"users": 24, "rows": peer_rows, "summary": {"goodput_peer_rps": 2.0}}))
    paths = sorted(results.glob("load-h200-fixture-u*.json"))
    peer = plots.peer_of("load-h200-fixture", results)
    g = plots.goodput_series(plots._scenarios(paths), peer)
    assert g == {"users": [24, 200, 2000], "kv": [32.0, 30.0, 18.0],
                 "kv_lower_bound": [True, False, False], "prompt": [4.0, 4.0, 4.0],
                 "prompt_measured_here": [True, False, False],
                 "prompt_from_another_run": [False, False, False], "peer": 2.0,
                 "peer_lower_bound": False}
    # a peer that met every rate it ran (a deadline cut it short) is a lower bound
    bounded = {**peer, "summary": {"goodput_peer_rps": 2.0, "peer": {"lower_bound": True}}}
    assert plots.goodput_series(plots._scenarios(paths), bounded)["peer_lower_bound"]
    assert plots.peer_of("load-h200-other", results) is None
    # a family run against an earlier peer file (--peer-result) draws that peer
    other = results / "load-h200-other-u200.json"
    other.write_text(json.dumps({**_scenario(200, 12.0, False, 4.0, True),
                                 "peer_source": "benchmarks/results/peer-h200-fixture.json: "
                                                "python -m benchmarks.load --peer"}))
    assert plots.peer_of("load-h200-other", results, [other]) == peer
    written = plots.main(["--results", str(results), "--figures", str(figures)])
    assert {p.name for p in written} >= {"load-h200-fixture-goodput-users.png",
                                         "load-h200-fixture-users.png"}
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_goodput_against_users_says_a_prompt_goodput_from_another_run():
    """``--prompt-goodput`` (the prompt mode measured in another run): flagged, so the
    figure's legend says so."""
    data = _scenario(200, 12.0, False, 7.0, False)
    data["summary"]["prompt"]["given"] = "measured in another run (--prompt-goodput)"
    g = plots.goodput_series([(200, "", data)], None)
    assert g["prompt_measured_here"] == [False] and g["prompt_from_another_run"] == [True]
