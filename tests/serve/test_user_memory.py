"""A user's token ids held as one array (``inferscale.serve.user_memory``): for any ids,
chunk ids (repeated, empty, named like the prefix) and however Arrow chunks or slices
the column, the table answers what the dict the server built before answered; what the
schema forbids is refused; the garbage collector tracks none of it."""

from __future__ import annotations

import gc

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.serve.user_memory import TokenTable
from inferscale.types import PREFIX_ID

token_ids = st.lists(st.integers(-2**31, 2**31 - 1), max_size=12)
chunk_ids = st.sampled_from(["a", "b", "c", PREFIX_ID, "", "é", "a\x00"])
rows = st.lists(st.tuples(chunk_ids, token_ids), max_size=10)


def as_dict(pairs, extra=()) -> dict[str, tuple[int, ...]]:
    """What the server held before: ``dict(zip(ids, lists))``, the prefix set after."""
    out = {c: tuple(t) for c, t in pairs}
    for c, t in extra:
        out[c] = tuple(t)
    return out


def check(table: TokenTable, want: dict) -> None:
    assert dict(table) == want and list(table) == list(want) and len(table) == len(want)
    for c, t in want.items():
        assert c in table and table[c] == t and type(table[c]) is tuple
        assert table.length(c) == len(t)
        assert all(type(x) is int for x in table[c])
    assert "missing" not in table
    with pytest.raises(KeyError):
        table["missing"]


@settings(max_examples=300, deadline=None, database=None)
@given(pairs=rows, prefix=token_ids, split=st.integers(0, 10), lo=st.integers(0, 3),
       hi=st.integers(0, 3))
def test_the_arrow_column_gives_what_the_dict_gave(pairs, prefix, split, lo, hi):
    """Any rows, chunked at any point and sliced at either end, with the prefix added
    as the server adds it (a fact named like it is replaced by it, as in the dict)."""
    padded = [("pad", [7])] * lo + pairs + [("pad", [8, 9])] * hi
    arr = pa.array([t for _, t in padded], pa.list_(pa.int32()))
    arr = arr.slice(lo, len(pairs))
    at = min(split, len(pairs))
    column = pa.chunked_array([arr.slice(0, at), arr.slice(at)], pa.list_(pa.int32()))
    ids = [c for c, _ in pairs]
    table = TokenTable.from_arrow(ids, column, {PREFIX_ID: prefix})
    check(table, as_dict(pairs, [(PREFIX_ID, prefix)]))
    assert table.tokens == sum(len(t) for _, t in pairs) + len(prefix)
    assert table.nbytes == 4 * table.tokens + 8 * (len(pairs) + 2)


@settings(max_examples=200, deadline=None, database=None)
@given(pairs=st.lists(st.tuples(chunk_ids, st.lists(st.integers(-2**63, 2**63 - 1),
                                                    max_size=8)), max_size=8))
def test_lists_give_what_the_dict_gave(pairs):
    chunks = as_dict(pairs)
    check(TokenTable.from_lists(chunks), chunks)


def test_what_the_schema_forbids_is_refused():
    ints = pa.list_(pa.int32())
    with pytest.raises(ValueError, match="null rows"):
        TokenTable.from_arrow(["a", "b"], pa.array([[1], None], ints))
    with pytest.raises(ValueError, match="null token ids"):
        TokenTable.from_arrow(["a"], pa.array([[1, None]], ints))
    with pytest.raises(ValueError, match="must be integers"):
        TokenTable.from_arrow(["a"], pa.array([[1.5]], pa.list_(pa.float32())))
    with pytest.raises(ValueError, match="must be integers"):
        TokenTable.from_arrow(["a"], pa.array([[1]], ints), {PREFIX_ID: [0.5]})
    with pytest.raises(ValueError, match="rows of token ids"):
        TokenTable.from_arrow(["a", "b"], pa.array([[1]], ints))
    with pytest.raises(ValueError, match="beyond int64"):
        TokenTable.from_arrow(["a"], pa.array([[2**64 - 1]], pa.list_(pa.uint64())))
    with pytest.raises(ValueError, match="offsets"):
        TokenTable(["a"], np.arange(3), np.array([0, 2]))
    with pytest.raises(ValueError, match="offsets"):
        TokenTable(["a", "b"], np.arange(3), np.array([0, 2, 1]))
    with pytest.raises(ValueError, match="flat integer"):
        TokenTable(["a"], np.zeros((1, 1), np.int32), np.array([0, 1]))


def test_an_empty_table_and_wide_ids():
    empty = TokenTable.from_arrow([], pa.chunked_array([], pa.list_(pa.int32())))
    check(empty, {})
    wide = TokenTable.from_lists({"a": [2**40, -1]})
    assert wide["a"] == (2**40, -1) and wide.nbytes == 2 * 8 + 2 * 8


def test_the_collector_tracks_nothing_per_token():
    table = TokenTable.from_arrow([f"f{i}" for i in range(400)],
                                  pa.array([list(range(40))] * 400, pa.list_(pa.int32())),
                                  {PREFIX_ID: [1, 2, 3]})
    gc.collect()
    held = [r for r in gc.get_referents(table) if not isinstance(r, type)]
    assert len(held) == 3 and not any(gc.is_tracked(r) for r in held)  # rows, arrays
    assert table.nbytes == 4 * (400 * 40 + 3) + 8 * 402
