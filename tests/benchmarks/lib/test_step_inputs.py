"""The injection-step benchmarks' shared inputs (``benchmarks.lib.step_inputs``): a
resident's chunks tile its slab, retrievals are the prefix then k distinct facts, and bad
sizes are refused by the parser."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks.lib import step_inputs


def test_a_residents_chunks_tile_its_slab_and_retrievals_start_with_the_prefix():
    res = step_inputs.resident(12, 10, 3, step_inputs.FP8, 2, 2, 4)
    spans = sorted(res.index.values())
    assert spans[0] == (0, 3) and all(o + n == o2 for (o, n), (o2, _) in zip(spans, spans[1:]))
    assert res.slab.shape[0] == sum(n for _, n in spans) and res.slab.stride(0) == 0  # a view
    assert res.scales.shape == (13, 2, 2, 2)
    assert step_inputs.resident(12, 10, 3, torch.bfloat16, 2, 2, 4).scales is None
    picks, widths, _ = step_inputs.retrievals(res, 5, 4)
    for p, w in zip(picks, widths):
        assert p[0] == "prefix" and len(set(p[1:])) == 5
        assert w == sum(res.index[c][1] for c in p)
    assert step_inputs.retrievals(res, 5, 4)[0] == picks  # seeded by k


@pytest.mark.parametrize("bad", [["--ks", "13"], ["--ks", "0"], ["--tokens", "8"],
                                 ["--shape", "2", "0", "4"], ["--repeats", "0"]])
def test_bad_sizes_are_refused(bad):
    ap = argparse.ArgumentParser()
    step_inputs.add_size_args(ap, repeats=5)
    args = ap.parse_args(["--facts", "12", *bad])
    with pytest.raises(SystemExit):
        step_inputs.check_sizes(ap, args)
    step_inputs.check_sizes(ap, ap.parse_args(["--facts", "12", "--ks", "12"]))  # fine
