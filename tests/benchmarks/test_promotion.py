"""The promotion replay (``benchmarks.promotion``): the connector's own rule against the
one before it, on the same arrivals."""

from __future__ import annotations

import json

import pytest

from benchmarks.promotion import main, replay


def test_a_long_tail_promotes_less_and_keeps_more_in_the_tiers(tmp_path):
    out = tmp_path / "replay.json"
    result = main(["--users", "400", "--gpu-slots", "4", "--host-slots", "12", "--rates", "4",
                   "12", "--requests", "200", "--seeds", "6", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    before, now = result["rules"]["before"], result["rules"]["now"]
    assert now["reloads_per_replay"] < before["reloads_per_replay"]
    assert all(n >= b for n, b in zip(now["served_from_tiers"][1:],
                                      before["served_from_tiers"][1:]))
    assert before["served_from_tiers"][0] == now["served_from_tiers"][0]  # warm-up: placed


def test_a_replay_is_its_seed():
    args = ("now", 3, 100, 2, 6, [(4.0, 50)], 5.0, 2)
    assert replay(*args) == replay(*args)


@pytest.mark.parametrize("argv", [["--users", "10", "--host-slots", "51"], ["--rates", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        main(argv)
