"""The run's identity: its record (what manifests store and version ids hash) and how
serving reads a version's layout from it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferscale.compose import ComposeError, memory_layout
from inferscale.encode.identity import (
    EncodeError, EncoderConfig, EncodingIdentity, MemoryLayout, RunIdentity, served_layout,
)
from inferscale.facts.extractor import FactsConfig
from inferscale.types import MEMORY_ORDERS

ENC = EncodingIdentity(EncoderConfig(), "fp", "float32", "cpu")


def test_the_record_is_the_encoders_and_the_facts_config():
    run = RunIdentity.of(FactsConfig(mode="raw"), ENC)
    assert run.record() == {**ENC.record(), "facts": FactsConfig(mode="raw").identity()}
    assert run.changed_settings(json.loads(json.dumps(run.record()))) == []  # read back
    other = RunIdentity.of(FactsConfig(mode="raw", max_fact_tokens=9), ENC)
    assert run.changed_settings(other.record()) == ["facts.max_fact_tokens"]
    with pytest.raises(EncodeError, match="not JSON"):
        RunIdentity({"x": object()}, ENC)


ANY = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
                st.lists(st.integers(), max_size=2), st.sampled_from(MEMORY_ORDERS))


@given(st.dictionaries(st.sampled_from(MemoryLayout._fields), ANY))
def test_served_layout_of_any_record(record):
    """A version's encoder config, whatever its layout fields hold: either a layout
    memory_layout serves (missing fields: the values older versions were encoded with)
    or ComposeError, nothing else."""
    implicit = {"memory_order": "relevance", "text_tail": 0, "tail_max_k": 0}
    try:
        layout = served_layout(record)
    except ComposeError:
        ok = record.get("memory_order", "relevance") in MEMORY_ORDERS and all(
            type(record.get(k, 0)) is int and record.get(k, 0) >= 0
            for k in ("text_tail", "tail_max_k"))
        assert not ok, record
        return
    assert layout == MemoryLayout(*({**implicit, **record}[k] for k in MemoryLayout._fields))
    memory_layout(["a", "b", "c"], layout.memory_order, layout.text_tail,
                  {"a": 0, "b": 1, "c": 2}, layout.tail_max_k)


def test_a_record_serves_the_layout_it_was_encoded_with():
    enc = EncoderConfig(memory_order="chronological", text_tail=2, tail_max_k=4)
    record = RunIdentity.of(FactsConfig(mode="raw"), EncodingIdentity(
        enc, "fp", "float32", "cpu")).record()
    assert served_layout(record) == MemoryLayout("chronological", 2, 4)


@pytest.mark.parametrize("facts", [None, "raw", 5, ["mode"], True])
def test_a_record_whose_facts_config_is_not_a_mapping_is_stale_on_it(facts):
    """A version's record is read from its manifest: a ``facts`` entry that is not an
    object (hand-edited, or written by something else) is a changed facts config, never
    an error and never up to date."""
    run = RunIdentity.of(FactsConfig(mode="raw"), ENC)
    record = {**run.record(), "facts": facts}
    assert run.changed_settings(record) == ["facts"]
