"""Staging pieces of the injection path that run without an engine."""

import pytest

from builders import make_resident
from inferscale.vllm_plugin.inject import row_index


def test_row_index_follows_request_order():
    r = make_resident("u")  # prefix rows 0-2, a rows 3-6, b rows 7-8
    assert row_index(r, ["b", "prefix", "a"], 0, 9).tolist() == [7, 8, 0, 1, 2, 3, 4, 5, 6]
    assert row_index(r, ["b", "prefix", "a"], 1, 4).tolist() == [8, 0, 1]



def test_a_range_without_memory_tokens_is_refused():
    """Nothing to load is an error (a load of no rows fails the step's load of it)."""
    r = make_resident("u")
    for start, end in ((4, 4), (9, 12), (5, 2)):
        with pytest.raises(ValueError, match="no memory tokens"):
            row_index(r, ["b", "prefix", "a"], start, end)
