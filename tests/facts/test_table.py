"""The facts table built from (source turn, text) pairs, and the raw fact mode's table."""

from __future__ import annotations

import pyarrow as pa
import pytest

from inferscale.compose import Composer
from inferscale.facts.table import fact_id, facts_table, raw_facts
from storage_schemas import facts as facts_schema


@pytest.fixture(scope="module")
def tokenizer(inferscale_home):
    from transformers import AutoTokenizer

    from inferscale.models import resolve_checkpoint

    return AutoTokenizer.from_pretrained(resolve_checkpoint("embedded", inferscale_home))


def turns(*rows) -> pa.Table:
    return pa.table({
        "user": ["ann"] * len(rows), "turn_id": [r[0] for r in rows],
        "turn_index": [r[1] for r in rows], "speaker": ["Ann"] * len(rows),
        "text": [r[2] for r in rows], "timestamp": ["2024-03-29T10:00:00"] * len(rows)})


def test_texts_are_normalized_and_repeats_and_empty_facts_dropped(tokenizer):
    t1, t2 = {"turn_id": "t1", "turn_index": 0}, {"turn_id": "t2", "turn_index": 1}
    table = facts_table("ann", [(t1, "Ann  keeps\nbees."), (t1, "ann keeps bees."),
                                (t2, "  "), (t2, "Ann lives by the sea.")],
                        [[1.0, 0.0]] * 4, tokenizer, max_tokens=64)
    assert table.schema == facts_schema.schema(2)
    assert table["text"].to_pylist() == ["Ann keeps bees.", "Ann lives by the sea."]
    assert table["source_turn_id"].to_pylist() == ["t1", "t2"]
    assert table["fact_id"].to_pylist() == [fact_id("ann", "t1", "Ann keeps bees."),
                                            fact_id("ann", "t2", "Ann lives by the sea.")]
    assert table["token_ids"].to_pylist()[0] == Composer(tokenizer).fact_ids("Ann keeps bees.", 64)


def test_an_empty_table_needs_its_embedding_size_and_sizes_must_agree(tokenizer):
    import numpy as np

    assert facts_table("ann", [], [], tokenizer, dims=3).schema == facts_schema.schema(3)
    two = [({"turn_id": f"t{i}", "turn_index": i}, f"fact {i}") for i in range(2)]
    rows = facts_table("ann", two, np.eye(2, dtype=np.float32), tokenizer)  # an array too
    assert rows["embedding"].to_pylist() == [[1.0, 0.0], [0.0, 1.0]]
    with pytest.raises(ValueError, match="dims"):
        facts_table("ann", [], [], tokenizer)
    with pytest.raises(ValueError, match="1 facts but 2 embeddings"):
        facts_table("ann", [({"turn_id": "t", "turn_index": 0}, "x")], [[0.0], [1.0]],
                    tokenizer)


def test_raw_facts_are_the_dated_turns_in_turn_order(tokenizer):
    got = raw_facts(turns(("b", 1, "Second  one."), ("a", 0, "First.")), tokenizer,
                    lambda texts: [[float(len(t)), 0.0] for t in texts])
    assert got["text"].to_pylist() == ["[2024-03-29] Ann: First.", "[2024-03-29] Ann: Second one."]
    assert got["source_index"].to_pylist() == [0, 1]
    # each embedding belongs to its own text (made from the text before normalizing)
    assert [e[0] for e in got["embedding"].to_pylist()] == [24.0, 30.0]
    with pytest.raises(ValueError, match="one user's turns"):
        raw_facts(pa.concat_tables([turns(("a", 0, "x")), turns(("b", 1, "y")).set_column(
            0, "user", pa.array(["bob"]))]), tokenizer, lambda t: [[0.0]] * len(t))
