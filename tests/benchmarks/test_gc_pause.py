"""``benchmarks.gc_pause`` at tiny sizes: the users as the server holds them, and their
chunk indexes as the engine holds them, leave the collector's view (a count, not a
timing), and the result records its command."""

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
    assert [r["form"] for r in result["rows"]] == [
        "lists", "user_memory", "chunk_indexes_per_chunk", "chunk_indexes", "serving_imports",
        "serving_imports_frozen"]
    # the engine's chunk indexes: a scales tensor per chunk, tracked; one per user now
    assert s["tracked_objects_chunk_indexes_per_chunk"] - s["tracked_objects_chunk_indexes"] \
        >= 20 * 30
    # vLLM and torch bring hundreds of thousands of tracked objects; frozen, a full
    # collection walks none of them (and the benchmark leaves the heap unfrozen)
    assert s["tracked_objects_serving_imports"] > 100_000
    assert s["tracked_objects_serving_imports_frozen"] < s["tracked_objects_serving_imports"] / 10
    assert result["rows"][5]["frozen_objects"] > 100_000
    import gc

    assert gc.get_freeze_count() == 0
    assert json.loads(out.read_text())["command"].startswith("python -m benchmarks.gc_pause")


def test_the_serving_imports_can_be_left_out():
    result = gc_pause.main(["--users", "2", "--facts", "2", "--tokens", "2", "--repeats", "1",
                            "--no-serving-imports"])
    assert [r["form"] for r in result["rows"]] == ["lists", "user_memory",
                                                   "chunk_indexes_per_chunk", "chunk_indexes"]


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        gc_pause.main(["--users", "0"])
