"""``benchmarks.inject_host_cost`` at tiny sizes: every stage is timed for both memory
dtypes, the fp8 steps pack their chunks' scales, and the result records its command."""

from __future__ import annotations

import json

import pytest

from benchmarks import inject_host_cost


def test_both_dtypes_and_every_stage_are_timed(tmp_path):
    out = tmp_path / "cost.json"
    result = inject_host_cost.main(["--facts", "12", "--tokens", "10", "--prefix", "3",
                                    "--ks", "2", "5", "--shape", "2", "2", "4",
                                    "--queries", "3", "--repeats", "3", "--out", str(out)])
    rows = {(r["memory"], r["k"]): r for r in result["rows"]}
    assert set(rows) == {(m, k) for m in ("fp8", "bf16") for k in (2, 5)}
    for r in rows.values():
        assert all(r[f"{s}_us"] > 0 for s in ("build", "check", "batches", "pack", "total"))
    # per step: the prefix's and k facts' scale rows of 2 x L x H floats, bf16 none
    assert rows["fp8", 5]["scale_floats_per_step"] == 6 * 2 * 2 * 2
    assert rows["bf16", 5]["scale_floats_per_step"] == 0
    assert "fp8_minus_bf16_us_k5" in result["summary"]
    assert json.loads(out.read_text())["command"].startswith(
        "python -m benchmarks.inject_host_cost")


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        inject_host_cost.main(["--ks", "401"])
