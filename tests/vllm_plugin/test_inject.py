"""Staging pieces of the injection path that run without an engine."""

from inferscale.vllm_plugin.inject import row_index
from builders import make_resident


def test_row_index_follows_request_order():
    r = make_resident("u")  # prefix rows 0-2, a rows 3-6, b rows 7-8
    assert row_index(r, ["b", "prefix", "a"], 0, 9).tolist() == [7, 8, 0, 1, 2, 3, 4, 5, 6]
    assert row_index(r, ["b", "prefix", "a"], 1, 4).tolist() == [8, 0, 1]

