"""``benchmarks.fact_reads`` at a tiny shape whose rows are whole 4 KiB blocks (2 layers,
2 KV heads, head dim 256, float32: 8 KiB a token): the user is built once and reused, the
index and the three ways of reading are timed, and the result records its command."""

from __future__ import annotations

import json

import pytest

from benchmarks import fact_reads


def test_a_tiny_run_times_the_index_and_each_way_of_reading(tmp_path, conversations):
    out = tmp_path / "reads.json"
    argv = ["--conversations", *conversations, "--facts", "10", "--shape", "2", "2", "256",
            "--dtype", "float32", "--k", "4", "--samples", "2", "--threads", "2",
            "--workdir", str(tmp_path / "work"), "--out", str(out)]
    result = fact_reads.main(argv)
    row = result["rows"][0]
    assert row["chunks"] == 10 and row["row_bytes"] == 8192
    assert set(row["reads_gb_per_s"]) == {"bounced", "in_place", "raw"}
    assert all(v["n"] == 2 and v["p50"] > 0 for v in row["reads_gb_per_s"].values())
    assert row["index_ms"]["n"] == 2 and row["index_ms"]["p50"] > 0
    assert row["storage"]["bandwidth_bytes_per_s"]["sequential"] > 0
    assert json.loads(out.read_text())["command"].startswith("python -m benchmarks.fact_reads")
    again = fact_reads.main(argv[:-2])  # the user is reused, not published again
    assert again["setup_seconds"] < result["setup_seconds"] + 1
    assert (tmp_path / "work" / "user.json").exists()


@pytest.mark.parametrize("bad", [["--k", "0"], ["--shape", "2", "0", "8"], ["--samples", "0"]])
def test_bad_settings_are_refused(tmp_path, bad):
    with pytest.raises(SystemExit):
        fact_reads.parse(["--workdir", str(tmp_path), *bad])


def test_a_tokenizer_directory_can_be_named(tmp_path, conversations):
    """``--tokenizer``: the GPU staging's LEAN=1 has the tokenizer files alone (no GGUF to
    convert): a directory of them serves, and the result is the same kind."""
    import shutil

    from inferscale.models import TOKENIZER_FILES, resolve_checkpoint
    from inferscale.settings import Settings

    ckpt = resolve_checkpoint("embedded", Settings().home)
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    for name in TOKENIZER_FILES:
        if (ckpt / name).exists():
            shutil.copy(ckpt / name, tok / name)
    result = fact_reads.main(["--conversations", *conversations, "--facts", "6", "--shape",
                              "2", "2", "256", "--dtype", "float32", "--k", "2",
                              "--samples", "1", "--threads", "1", "--tokenizer", str(tok),
                              "--workdir", str(tmp_path / "work")])
    assert result["rows"][0]["chunks"] == 6 and "--tokenizer" in result["command"]
