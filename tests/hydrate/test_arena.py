"""The tiers' memory: a first-fit arena allocated once, its fences, and the heap variant."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.hydrate.arena import ALIGN, Arena, ArenaFull, Fence, HeapArena


def test_regions_are_aligned_disjoint_views_of_one_buffer():
    arena = Arena(10 * ALIGN)
    a, b = arena.alloc(1), arena.alloc(ALIGN + 1)
    assert (a.offset, a.nbytes, b.offset, b.nbytes) == (0, ALIGN, ALIGN, 2 * ALIGN)
    assert a.data.data_ptr() == arena.buffer.data_ptr()
    assert b.data.data_ptr() == arena.buffer.data_ptr() + ALIGN
    assert arena.used == 3 * ALIGN and arena.free_bytes == 7 * ALIGN
    with pytest.raises(ArenaFull, match="no free extent"):
        arena.alloc(8 * ALIGN)
    arena.free(a)
    with pytest.raises(ValueError, match="free already"):
        arena.free(a)


def test_freed_neighbours_merge_and_keep_the_newest_fence():
    arena = Arena(4 * ALIGN)
    regions = [arena.alloc(ALIGN) for _ in range(4)]
    arena.free(regions[1], Fence(5, None))
    arena.free(regions[2], Fence(9, None))
    arena.free(regions[0], Fence(2, None))
    big = arena.alloc(3 * ALIGN)  # only possible once the three merged
    assert big.offset == 0 and big.fence.seq == 9


def test_views_lay_dimensions_out_in_the_order_asked():
    arena = Arena(4096)
    r = arena.alloc(2 * 3 * 4 * 4)
    t = r.view((2, 3, 4), torch.float32, order=(1, 2, 0))  # dim 1 outermost in memory
    assert t.shape == (2, 3, 4) and t.stride() == (1, 8, 2)
    with pytest.raises(ValueError, match="needs"):
        r.view((100,), torch.float32)


def test_heap_arena_accounts_without_a_buffer():
    heap = HeapArena(3 * ALIGN)
    a = heap.alloc(10)
    assert a.nbytes == ALIGN and a.data.numel() == ALIGN and heap.used == ALIGN
    heap.alloc(2 * ALIGN)
    with pytest.raises(ArenaFull):
        heap.alloc(1)
    heap.free(a)
    assert heap.free_bytes == ALIGN


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN)), max_size=60))
def test_any_sequence_keeps_regions_disjoint_and_accounting_exact(ops):
    """Hostile sequences of allocations and frees: live regions never overlap, ``used``
    is their total, and once everything is freed one extent spans the arena again."""
    arena = Arena(32 * ALIGN)
    live = []
    for do_alloc, n in ops:
        if do_alloc or not live:
            try:
                live.append(arena.alloc(n))
            except ArenaFull:
                assert arena.largest_free() < -(-n // ALIGN) * ALIGN
        else:
            arena.free(live.pop(n % len(live)))
        spans = sorted((r.offset, r.offset + r.nbytes) for r in live)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert all(s % ALIGN == 0 and e <= arena.capacity for s, e in spans)
        assert arena.used == sum(r.nbytes for r in live)
    for r in live:
        arena.free(r)
    assert arena.used == 0 and arena.largest_free() == arena.capacity
