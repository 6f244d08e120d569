"""``benchmarks.gc_pause`` at tiny sizes: the users as the server holds them leave the
collector's view (a count, not a timing), and the result records its command."""

from __future__ import annotations

import json

import pytest

from benchmarks import gc_pause


def test_held_users_track_fewer_objects_than_lists(tmp_path):
    out = tmp_path / "gc.json"
    result = gc_pause.main(["--users", "20", "--facts", "30", "--tokens", "8",
                            "--repeats", "1", "--out", str(out)])
    s = result["summary"]
    # the lists form keeps 20 x 30 token-id lists (and 40 more) tracked; held: none of them
    assert s["tracked_objects_lists"] - s["tracked_objects_user_memory"] >= 20 * 30
    assert [r["form"] for r in result["rows"]] == ["lists", "user_memory"]
    assert json.loads(out.read_text())["command"].startswith("python -m benchmarks.gc_pause")


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        gc_pause.main(["--users", "0"])
