"""The LoCoMo benchmark's KV variants (``benchmarks.lib.locomo_variants``): specs,
variants files with sections (the committed one parses), shared encodings, a sweep's
parts."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.lib.locomo_variants import encoding_key, parse_variant, part_of, read_specs


def test_parse_variant():
    v = parse_variant("m20:context=memory,window=20,text_tail=5,key_temperature=0.9")
    assert v.name == "m20"
    cfg = v.encoder_config()
    assert (cfg.context, cfg.window, cfg.text_tail, cfg.key_temperature) == ("memory", 20, 5, 0.9)
    with pytest.raises(ValueError, match="unknown encoder field"):
        parse_variant("x:colour=red")
    with pytest.raises(ValueError, match="bad variant name"):
        parse_variant("prompt:window=1")


def test_variants_file_sections_and_shared_encodings():
    text = "a:window=1\n[one]\nb:window=2  # note\n\n[two]\nc:window=3\n"
    assert read_specs(text) == ["a:window=1", "b:window=2", "c:window=3"]
    assert read_specs(text, "one") == ["b:window=2"]
    with pytest.raises(ValueError, match="no \\[three\\] section"):
        read_specs(text, "three")
    plain = [parse_variant(f"x:text_tail={t}").encoder_config() for t in (0, 5)]
    assert encoding_key(plain[0]) == encoding_key(plain[1])  # layout only: one encoding
    cal = [parse_variant(f"x:text_tail={t},key_calibration=head").encoder_config()
           for t in (0, 5)]
    assert encoding_key(cal[0]) != encoding_key(cal[1])  # the probes follow the layout


def test_the_issue_27_section_parses():
    text = (Path(__file__).resolve().parents[3] / "benchmarks/locomo_variants.txt").read_text()
    specs = [parse_variant(s) for s in read_specs(text, "issue-27")]
    cfgs = [v.encoder_config() for v in specs]
    assert len(specs) == len({v.name for v in specs}) <= 18  # one device call (README)
    assert any(c.key_calibration == "head" for c in cfgs) and any(c.tail_max_k for c in cfgs)
    assert all({"context", "window", "memory_order", "text_tail", "tail_max_k",
                "key_calibration"} <= dict(v.fields).keys() for v in specs)
    assert len(read_specs(text, "issue-18")) == 21


@given(n_variants=st.integers(1, 40), parts=st.integers(1, 40))
def test_the_parts_of_a_sweep_cover_it_once_in_order(n_variants, parts):
    names = [f"v{i}" for i in range(n_variants)]
    if parts > n_variants:
        with pytest.raises(ValueError):
            part_of(names, f"1/{parts}")
        return
    got = [part_of(names, f"{i}/{parts}") for i in range(1, parts + 1)]
    assert sum(got, []) == names
    assert max(map(len, got)) - min(map(len, got)) <= 1


@pytest.mark.parametrize("bad", ["0/3", "4/3", "1", "a/b", "1/0", "-1/2", ""])
def test_a_bad_part_is_refused(bad):
    with pytest.raises(ValueError):
        part_of(["a", "b", "c"], bad)
