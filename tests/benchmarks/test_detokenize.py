"""``benchmarks.detokenize`` at tiny sizes: both primings give the same text for every kind
of output, and the result records its command (figures only printed, never asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks import detokenize


def test_both_primings_give_the_same_text(tmp_path):
    out = tmp_path / "detok.json"
    result = detokenize.main(["--prompt-tokens", "300", "--outputs", "12", "--requests", "4",
                              "--out", str(out)])
    assert [r["outputs"] for r in result["rows"]] == ["text", "no_text", "mixed"]
    assert all(r["same_text"] for r in result["rows"]) and result["summary"]["same_text"]
    saved = json.loads(out.read_text())
    assert saved["command"].startswith("python -m benchmarks.detokenize")
    assert saved["prompt_tokens"] == 300


def test_the_prompt_has_the_length_asked(inferscale_home):
    from transformers import AutoTokenizer

    from inferscale.models import resolve_checkpoint
    from inferscale.serve.detokenize import backend_of

    backend = backend_of(AutoTokenizer.from_pretrained(
        resolve_checkpoint("embedded", inferscale_home)))
    assert len(detokenize.prompt_ids(backend, 5000)) == 5000


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        detokenize.main(["--requests", "0"])
