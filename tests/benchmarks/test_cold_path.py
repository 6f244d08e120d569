"""``benchmarks.cold_path`` at tiny sizes (two small conversations, a few users of a few
facts): every scenario runs through the real server, the stages are timed, the loop's
lag is sampled, and the result records its command; the settings are checked first."""

from __future__ import annotations

import json

import pytest

from benchmarks import cold_path


def test_a_tiny_run_reports_every_stage_and_scenario(tmp_path, conversations):
    out = tmp_path / "cold.json"
    argv = ["--users", "40", "--groups", "2", "--facts", "5", "--resident", "4",
            "--samples", "3", "--burst", "3", "--bursts", "2", "--rate", "20", "--seconds", "0.5",
            "--idle-s", "0.1", "--top-k", "3", "--embed", "cached", "--no-direct-io",
            "--conversations", *conversations, "--workdir", str(tmp_path / "work"),
            "--out", str(out)]
    result = cold_path.main(argv)
    stages = result["rows"][0]["ms"]
    assert {"latest", "manifest", "facts_read", "fact_index", "read_user", "embed",
            "retrieve", "compose", "cold_total_but_embed"} <= set(stages)
    assert all(stages[s]["n"] == 3 for s in ("read_user", "embed", "compose"))
    by = {r["scenario"]: r for r in result["rows"][1:]}
    assert set(by) == {"idle", "burst_1", "burst_3", "open_loop"}
    assert by["burst_3"]["requests"] == 6 and by["burst_3"]["loop_lag_ms"]["n"] > 0
    assert by["burst_3"]["slowest_per_burst_ms"]["n"] == 2 and by["burst_1"]["requests"] == 2
    assert by["open_loop"]["requests"] >= 1 and "dispatch_lag_ms" in by["open_loop"]
    s = result["summary"]
    assert s["users"] == 40 and s["embed"] == "cached" and s["burst_memory_max_ms"] > 0
    assert json.loads(out.read_text())["command"].startswith("python -m benchmarks.cold_path")
    # published once: a second run with the same settings reuses the users
    again = cold_path.main(argv[:-2])
    assert again["rows"][0]["ms"]["read_user"]["n"] == 3


@pytest.mark.parametrize("bad", [["--users", "0"], ["--cold-share", "2"],
                                 ["--users", "10", "--resident", "9"],
                                 ["--groups", "50", "--users", "40", "--resident", "1"]])
def test_bad_settings_are_refused(bad):
    with pytest.raises(SystemExit):
        cold_path.main(bad)
