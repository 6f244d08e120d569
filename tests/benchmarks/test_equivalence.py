"""The equivalence benchmark's tally (``benchmarks.equivalence``) with --memory-dtype (no
engine)."""

from __future__ import annotations

from benchmarks.equivalence import tally


def _row(kind, lim, win, lim8, win8, lim8_mem, win8_mem):
    row = {"kind": kind, "prefill_correct": True if kind == "factual" else None}
    for enc, vs, vs_mem in (("limiting", lim, None), ("window", win, None),
                            ("limiting_float8_e4m3fn", lim8, lim8_mem),
                            ("window_float8_e4m3fn", win8, win8_mem)):
        row[f"{enc}_vs_prefill"] = vs
        row[f"{enc}_correct"] = True if kind == "factual" else None
        row[f"{enc}_fallback"] = None
        if vs_mem is not None:
            row[f"{enc}_vs_memory"] = vs_mem
    return row


def test_fp8_memory_is_tallied_against_the_engine_dtype_memory():
    rows = [_row("factual", "token_identical", "differs", "token_identical", "differs",
                 "token_identical", "equivalent"),
            _row("open", "token_identical", "equivalent", "equivalent", "differs",
                 "differs", "token_identical")]
    got = tally(rows)
    assert got["limiting"]["token_identical"] == 2 and "vs_memory" not in got["limiting"]
    assert got["limiting_float8_e4m3fn"]["vs_memory"] == {
        "token_identical": 1, "equivalent": 0, "differs": 1}
    assert got["window_float8_e4m3fn"]["vs_memory"] == {
        "token_identical": 1, "equivalent": 1, "differs": 0}
    assert got["window_float8_e4m3fn"]["differs"] == 2  # against prefill
    assert got["prefill"] == {"factual_correct": 1, "factual_queries": 1}
