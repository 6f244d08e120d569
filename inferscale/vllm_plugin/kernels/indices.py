"""What one CUDA launch reads besides the slab: per token its slab row, virtual position,
cache slot and (fp8 sources) its row of scales, plus those scales; carried to the device
by one non-blocking copy per step from fixed pinned buffers.

Used by :class:`inferscale.vllm_plugin.kernels.writer.FusedWriter` on CUDA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Source:
    """One kernel launch's input: a slab (logical ``[T, 2, L, H, D]``, any dense stride
    order) and, per token, its slab row, virtual position and cache slot. An fp8 slab
    also names its chunks' ``scales`` (``[C, 2, L, H]`` float32, host) and per token the
    row of ``scales`` that dequantizes it (``scale_rows``)."""

    slab: torch.Tensor
    rows: np.ndarray  # [N] int64
    positions: np.ndarray  # [N] int64
    slots: np.ndarray  # [N] int64
    scales: torch.Tensor | None = None  # [C, 2, L, H] float32
    scale_rows: np.ndarray | None = None  # [N] int64

    def part(self, sl: slice) -> "Source":
        return Source(self.slab, self.rows[sl], self.positions[sl], self.slots[sl],
                      self.scales, None if self.scale_rows is None else self.scale_rows[sl])


# Tokens whose (row, position, slot, scale row) one index copy carries, and float32 scale
# values one copy carries; a step that loads more is written in several launches rather
# than growing pinned memory (allocating pinned memory synchronizes the device: a stall
# for every request in the step). 4 Mi floats: 8,192 chunks at the Llama-3.1-8B shape.
INDEX_CAPACITY = 1 << 16
SCALE_CAPACITY = 1 << 22


def batches(sources: list[Source], capacity: int, scale_capacity: int) -> list[list[Source]]:
    """``sources`` cut into lists of at most ``capacity`` tokens and ``scale_capacity``
    scale values (a source split by rows where needed)."""
    out: list[list[Source]] = [[]]
    room, scale_room = capacity, scale_capacity
    for src in sources:
        per_row = math.prod(src.scales.shape[1:]) if src.scales is not None else 0
        at = 0
        while at < len(src.rows):
            k = min(room, len(src.rows) - at)
            used = 0
            if per_row:  # tokens of at most scale_room // per_row distinct chunks
                k, used = _fitting(src.scale_rows[at:at + k], scale_room // per_row)
            if k == 0:
                if not out[-1]:
                    raise ValueError(f"one chunk's {per_row} scales exceed the capacity")
                out.append([])
                room, scale_room = capacity, scale_capacity
                continue
            out[-1].append(src.part(slice(at, at + k)))
            scale_room -= per_row * used
            at += k
            room -= k
    return [b for b in out if b]


def run_starts(values: np.ndarray) -> np.ndarray:
    """Where each run of equal consecutive ``values`` (``[N]``) starts (``[R]`` int64;
    a request's tokens come chunk after chunk, so its scale rows form few runs)."""
    new = np.empty(len(values), dtype=bool)  # [N]: a run starts here
    new[:1] = True
    np.not_equal(values[1:], values[:-1], out=new[1:])
    return new.nonzero()[0]


def unique_runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` for ``[N]`` ``values``, sorting only
    the values of their ``R`` runs of equal consecutive values: ``O(N + R log R)``."""
    starts = run_starts(values)  # [R]
    heads = values[starts]
    order = heads.argsort(kind="stable")
    ordered = heads[order]
    new = np.empty(len(heads), dtype=bool)  # [R]: a value not seen before, in order
    new[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    inverse = np.empty(len(heads), dtype=np.int64)  # [R]: each run's value's rank
    inverse[order] = new.cumsum() - 1
    counts = np.empty(len(heads), dtype=np.int64)  # [R]: each run's length
    counts[:-1] = starts[1:] - starts[:-1]
    counts[-1:] = len(values) - starts[-1:]
    return ordered[new], inverse.repeat(counts)


def _fitting(rows: np.ndarray, distinct: int) -> tuple[int, int]:
    """The longest prefix of ``rows`` with at most ``distinct`` distinct values, and how
    many it has (a value first appears where one of its runs starts)."""
    starts = run_starts(rows)
    heads = rows[starts]
    if len(starts) <= distinct:  # no more values than runs: all of them fit
        ordered = np.sort(heads)  # [R]
        return len(rows), int(np.count_nonzero(ordered[1:] != ordered[:-1])) + (len(rows) > 0)
    _, first = np.unique(heads, return_index=True)
    if len(first) <= distinct:
        return len(rows), len(first)
    return int(starts[np.sort(first)[distinct]]), distinct


def pack(sources: list[Source], out: np.ndarray, packed: np.ndarray) -> int:
    """Fill ``out`` ``[4, n]`` int64 (rows, positions, slots, scale rows) for ``sources``
    (``n`` tokens in all) and ``packed`` ``[S]`` float32 with each fp8 source's distinct
    chunks' scales, once each; returns the floats of ``packed`` used. A token's fourth
    column names its row of ``packed`` (rows of ``2 * L * H`` floats; 0 for float
    sources). ValueError when the scales exceed ``packed``."""
    at = floats = 0
    for s in sources:
        k = len(s.rows)
        out[0, at:at + k], out[1, at:at + k], out[2, at:at + k] = s.rows, s.positions, s.slots
        if s.scales is None:
            out[3, at:at + k] = 0
        else:
            per_row = math.prod(s.scales.shape[1:])
            used, inverse = unique_runs(s.scale_rows)
            size = len(used) * per_row
            if floats + size > len(packed):
                raise ValueError(f"{len(used)} chunks' scales exceed the scale capacity")
            table = s.scales.numpy().reshape(len(s.scales), per_row)  # [C, 2*L*H]
            if len(used) and (used[0] < 0 or used[-1] >= len(table)):  # sorted
                raise IndexError(f"scale rows outside [0, {len(table)})")
            # straight into ``packed`` (mode "raise" would buffer; none is clipped: checked)
            np.take(table, used, axis=0, mode="clip",
                    out=packed[floats:floats + size].reshape(len(used), per_row))
            out[3, at:at + k] = floats // per_row + inverse
            floats += size
        at += k
    return floats


class IndexBuffers:
    """Two fixed pinned host buffers and their device copies, used in turn by successive
    steps: a step's indices (and fp8 scales) go over in one non-blocking copy each, and a
    host buffer is only rewritten once the copies that last read it have finished (two
    steps earlier, so normally without waiting)."""

    def __init__(self, capacity: int, device: torch.device,
                 scale_capacity: int = SCALE_CAPACITY):
        self.capacity, self.scale_capacity = capacity, scale_capacity
        self.host = [torch.empty(4 * capacity, dtype=torch.int64).pin_memory() for _ in range(2)]
        self.dev = [torch.empty(4 * capacity, dtype=torch.int64, device=device)
                    for _ in range(2)]
        self.host_scales = [torch.empty(scale_capacity, dtype=torch.float32).pin_memory()
                            for _ in range(2)]
        self.dev_scales = [torch.empty(scale_capacity, dtype=torch.float32, device=device)
                           for _ in range(2)]
        self.done: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def fill(self, sources: list[Source]) -> tuple[torch.Tensor, int, torch.Tensor]:
        """``([4, n] device view of rows/positions/slots/scale rows, n, device scales)``
        for ``sources`` (within the capacities), enqueued on the current stream. Each fp8
        source's distinct scale rows are packed once; its tokens' fourth column names
        their row of the packed scales (rows of ``2 * L * H`` floats)."""
        n = sum(len(s.rows) for s in sources)
        if n > self.capacity:
            raise ValueError(f"{n} tokens exceed the index capacity {self.capacity}")
        i, self.turn = self.turn, 1 - self.turn
        if self.done[i] is not None:
            self.done[i].synchronize()
        host = self.host[i][:4 * n].view(4, n)
        floats = pack(sources, host.numpy(), self.host_scales[i].numpy())
        dev = self.dev[i][:4 * n].view(4, n)  # starts at the buffer's (aligned) base
        dev.copy_(host, non_blocking=True)
        if floats:
            self.dev_scales[i][:floats].copy_(self.host_scales[i][:floats], non_blocking=True)
        event = self.done[i] or torch.cuda.Event()
        event.record()
        self.done[i] = event
        return self.dev[i], n, self.dev_scales[i]
