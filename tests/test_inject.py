"""Staging pieces of the injection path that run without an engine."""

import pytest
import torch

from inferscale.inject import _groups, _pitched_copy, row_index
from tests.test_resident import make_resident


def test_layer_groups_cover_every_layer_once():
    for layers in (1, 2, 30, 32, 40):
        for groups in (1, 4, 64):
            bounds = _groups(layers, groups)
            covered = [i for a, b in bounds for i in range(a, b)]
            assert covered == list(range(layers)) and all(a < b for a, b in bounds)


def test_row_index_follows_request_order():
    r = make_resident("u")  # prefix rows 0-2, a rows 3-6, b rows 7-8
    assert row_index(r, ["b", "prefix", "a"], 0, 9).tolist() == [7, 8, 0, 1, 2, 3, 4, 5, 6]
    assert row_index(r, ["b", "prefix", "a"], 1, 4).tolist() == [8, 0, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pitched_copy_moves_exactly_the_layer_group_of_each_run():
    copy = _pitched_copy()
    if copy is None:
        pytest.skip("CuPy not installed")
    src = torch.randn(20, 2, 6, 2, 8).to(torch.bfloat16).pin_memory()  # [T, 2, L, H, D]
    dst = torch.zeros(7, 2, 6, 2, 8, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.current_stream()
    copy(dst, 1, src, 12, 4, 2, 5, stream.cuda_stream)  # rows 12..15 -> 1..4, layers 2..4
    torch.cuda.synchronize()
    want = torch.zeros_like(dst).cpu()
    want[1:5, :, 2:5] = src[12:16, :, 2:5]
    assert torch.equal(dst.cpu(), want)
