"""What one CUDA launch reads besides the slab, built on the host: runs of scale rows,
launch batches and the packed index columns and fp8 scales. Each is checked against the
straightforward computation it replaced (``np.unique`` over every token), on hostile
inputs too."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.vllm_plugin.kernels.indices import (
    Source, _fitting, batches, pack, run_starts, unique_runs,
)

SLAB = torch.zeros(1, 2, 2, 3, 4)  # only its shape is read here
PER_ROW = 2 * 2 * 3  # floats of one chunk's scales [2, L, H]


def fitting_reference(rows: np.ndarray, distinct: int) -> int:
    """The longest prefix with at most ``distinct`` distinct values (``np.unique``)."""
    _, first = np.unique(rows, return_index=True)
    return len(rows) if len(first) <= distinct else int(np.sort(first)[distinct])


def batches_reference(sources: list[Source], capacity: int, scale_capacity: int):
    """The launch cuts as they were, as (source index, first row, rows) per launch."""
    out, room, scale_room = [[]], capacity, scale_capacity
    for i, src in enumerate(sources):
        per_row = PER_ROW if src.scales is not None else 0
        at = 0
        while at < len(src.rows):
            k = min(room, len(src.rows) - at)
            if per_row:
                k = min(k, fitting_reference(src.scale_rows[at:at + k],
                                             scale_room // per_row))
            if k == 0:
                if not out[-1]:
                    raise ValueError("one chunk's scales exceed the capacity")
                out.append([])
                room, scale_room = capacity, scale_capacity
                continue
            out[-1].append((i, at, k))
            if per_row:
                scale_room -= per_row * len(np.unique(src.scale_rows[at:at + k]))
            at += k
            room -= k
    return [b for b in out if b]


def pack_reference(sources: list[Source], n: int, size: int):
    """The packing as it was: ``np.unique`` over each fp8 source's tokens."""
    out, packed, floats, at = np.zeros((4, n), dtype=np.int64), np.zeros(size), 0, 0
    for s in sources:
        k = len(s.rows)
        out[:3, at:at + k] = s.rows, s.positions, s.slots
        if s.scales is not None:
            used, inverse = np.unique(s.scale_rows, return_inverse=True)
            got = s.scales.numpy().reshape(len(s.scales), -1)[used]
            packed[floats:floats + got.size] = got.reshape(-1)
            out[3, at:at + k] = floats // PER_ROW + inverse
            floats += got.size
        at += k
    return out, packed[:floats]


# hostile: any order, repeats far apart, negative and huge values, empty
values = st.lists(st.one_of(st.integers(-3, 6), st.integers(-2**62, 2**62)), max_size=60)
# scale rows as requests have them: runs of chunks, a chunk now and then again later
runs = st.lists(st.tuples(st.integers(0, 9), st.integers(1, 5)), max_size=15).map(
    lambda r: np.repeat([c for c, _ in r], [n for _, n in r]).astype(np.int64))


@settings(max_examples=300, deadline=None)
@given(values)
def test_unique_runs_is_np_unique(v):
    a = np.asarray(v, dtype=np.int64)
    used, inverse = unique_runs(a)
    want_used, want_inverse = np.unique(a, return_inverse=True)
    assert used.tolist() == want_used.tolist() and inverse.tolist() == want_inverse.tolist()
    starts = run_starts(a)
    assert all(a[i] != a[i - 1] for i in starts[1:]) and (len(a) == 0 or starts[0] == 0)
    assert len(starts) == (len(a) and 1 + int(np.count_nonzero(a[1:] != a[:-1])))


@settings(max_examples=300, deadline=None)
@given(runs, st.integers(0, 12))
def test_fitting_is_the_np_unique_prefix(rows, distinct):
    k, used = _fitting(rows, distinct)
    assert k == fitting_reference(rows, distinct)
    assert used == len(np.unique(rows[:k])) <= distinct


def fp8_source(chunk_rows: np.ndarray, chunks: int = 10) -> Source:
    n = len(chunk_rows)
    scales = torch.arange(chunks * PER_ROW, dtype=torch.float32).view(chunks, 2, 2, 3)
    return Source(SLAB, np.arange(n) + 3, np.arange(n) + 1, np.arange(n) + 20, scales,
                  chunk_rows)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(runs, st.integers(0, 4)), min_size=1, max_size=4),
       st.integers(1, 40), st.integers(1, 8))
def test_batches_and_pack_are_what_np_unique_gave(parts, capacity, scale_rows_room):
    """Mixed fp8 and float sources: the same cuts as before, every launch within its
    capacities, and each launch packed exactly as before."""
    sources = [fp8_source(p) if isinstance(p, np.ndarray) else
               Source(SLAB, np.arange(p), np.arange(p), np.arange(p)) for p in parts]
    scale_capacity = scale_rows_room * PER_ROW
    try:
        want_cut = batches_reference(sources, capacity, scale_capacity)
    except ValueError:
        with pytest.raises(ValueError):  # one chunk's scales over the capacity, as before
            batches(sources, capacity, scale_capacity)
        return
    cut = batches(sources, capacity, scale_capacity)
    assert [[len(s.rows) for s in b] for b in cut] == [[k for _, _, k in b] for b in want_cut]
    for b, want_b in zip(cut, want_cut):
        for s, (i, at, k) in zip(b, want_b):
            assert s.rows.tolist() == sources[i].rows[at:at + k].tolist()
        n = sum(len(s.rows) for s in b)
        assert 0 < n <= capacity
        out, packed = np.full((4, n), -1, dtype=np.int64), np.zeros(scale_capacity, np.float32)
        floats = pack(b, out, packed)
        want_out, want_packed = pack_reference(b, n, scale_capacity)
        assert floats <= scale_capacity and packed[:floats].tolist() == want_packed.tolist()
        assert out.tolist() == want_out.tolist()
    got = [s.scale_rows for b in cut for s in b if s.scales is not None]
    want = [s.scale_rows for s in sources if s.scales is not None and len(s.rows)]
    assert np.concatenate(got or [[]]).tolist() == np.concatenate(want or [[]]).tolist()


def test_pack_writes_each_used_chunks_scales_once():
    """A token's fourth column names the packed row of its own chunk's scales, each used
    chunk's packed once (in order of its row); float sources read row 0."""
    chunk = np.array([7, 7, 2, 2, 2, 9, 7])  # chunk 7 twice, not in a row
    fp8 = fp8_source(chunk)
    plain = Source(SLAB, np.arange(2), np.arange(2), np.arange(2))
    out = np.full((4, 9), -1, dtype=np.int64)
    packed = np.zeros(64, dtype=np.float32)
    assert pack([plain, fp8], out, packed) == 3 * PER_ROW  # chunks 2, 7, 9
    assert out[:, :2].tolist() == [[0, 1]] * 3 + [[0, 0]]
    assert out[:3, 2:].tolist() == [fp8.rows.tolist(), fp8.positions.tolist(),
                                   fp8.slots.tolist()]
    assert out[3, 2:].tolist() == [1, 1, 0, 0, 0, 2, 1]
    rows = packed[:3 * PER_ROW].reshape(3, PER_ROW)
    for t, c in enumerate(chunk):
        assert rows[out[3, 2 + t]].tolist() == fp8.scales[c].reshape(-1).tolist()
    with pytest.raises(ValueError, match="scale capacity"):
        pack([fp8], out[:, :7], np.zeros(3 * PER_ROW - 1, dtype=np.float32))
    with pytest.raises(IndexError):  # a scale row outside the table is never read
        pack([fp8_source(np.array([3, 10]))], out[:, :2], packed)
