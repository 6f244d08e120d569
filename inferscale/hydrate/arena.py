"""Tier memory allocated once: a first-fit allocator over one preallocated buffer.

A resident store serving a CUDA engine takes each tier's memory as one :class:`Arena` at
start-up (device memory for the GPU tier, pinned host memory for the host tier). Placing, demoting and
evicting users then never allocate or free pinned or device memory on the serving path:
``cudaHostAlloc``/``cudaFreeHost`` synchronize the device (a stall for every request in
the step), and device allocations of gigabytes fragment the caching allocator.

A freed region may still be read by work already enqueued on the compute stream (an
injection that read the user's rows). :meth:`Arena.free` therefore takes a *fence*, an
event recorded on that stream after the last enqueued read; a later :meth:`Arena.alloc`
hands the region out with the newest fence of the extents it covers, and whoever writes
into it waits for that fence first (:meth:`Region.wait_host` for host writes,
:meth:`Region.wait_stream` for device copies). Fences come from one stream, so the newest
one implies every older one.

On the CPU build neither allocation synchronizes anything, and one preallocated buffer
of a budget's size could exceed what the OS lets one process reserve, so a
:class:`HeapArena` gives each region its own allocation under the same accounting.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 256  # bytes; every region starts aligned (vector loads, Triton's 16-byte rule)


@dataclass(frozen=True)
class Fence:
    """An event recorded on the compute stream, ordered by ``seq``."""

    seq: int
    event: Any  # torch.cuda.Event, or None on the CPU (nothing to wait for)

    def wait_host(self) -> None:
        if self.event is not None:
            self.event.synchronize()


NO_FENCE = Fence(-1, None)


@dataclass
class Region:
    """``nbytes`` at byte ``offset`` of an arena; ``data`` is its uint8 view."""

    offset: int
    nbytes: int
    data: torch.Tensor  # [nbytes] uint8
    fence: Fence = NO_FENCE  # what must finish before the region is written
    staged: int = 0  # bytes it counts against a store's staging reserve (0: none)
    tier: str = ""  # the store tier whose arena it came from (staging regions)

    def view(self, shape: tuple[int, ...], dtype: torch.dtype,
             order: tuple[int, ...] | None = None) -> torch.Tensor:
        """The region's first bytes as a dense tensor of logical ``shape`` and ``dtype``
        whose dimensions lie in memory in ``order`` (outermost first; default: as given)."""
        order = tuple(order) if order is not None else tuple(range(len(shape)))
        n = dtype.itemsize
        for d in shape:
            n *= d
        if n > self.nbytes:
            raise ValueError(f"{tuple(shape)} {dtype} needs {n} bytes; the region has "
                             f"{self.nbytes}")
        dense = self.data[:n].view(dtype).view([shape[i] for i in order])
        return dense.permute([order.index(i) for i in range(len(shape))])

    def wait_host(self) -> None:
        """Block until enqueued reads of the region have finished (before host writes)."""
        self.fence.wait_host()

    def wait_stream(self, stream: Any) -> None:
        """Make ``stream`` wait for enqueued reads of the region (before device writes)."""
        if self.fence.event is not None:
            stream.wait_event(self.fence.event)


class ArenaFull(RuntimeError):
    """No free extent is large enough (the caller frees something and tries again)."""


class Arena:
    """``capacity`` bytes of ``device`` memory (pinned when ``pin``), handed out as
    aligned regions; thread-safe."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu", pin: bool = False):
        if capacity < 0:
            raise ValueError(f"arena capacity must be >= 0, got {capacity}")
        self.capacity = capacity - capacity % ALIGN
        self.device = torch.device(device)
        if pin and self.device.type == "cpu":
            self.buffer = _pinned(self.capacity)
            if self.capacity:  # unregistered when the arena goes (its pages may be reused)
                weakref.finalize(self, _unpin, self.buffer.data_ptr())
        else:
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        self._lock = threading.Lock()
        # free extents, sorted by offset: (offset, size, fence)
        self._free: list[tuple[int, int, Fence]] = \
            [(0, self.capacity, NO_FENCE)] if self.capacity else []
        self.used = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        with self._lock:
            return max((size for _, size, _ in self._free), default=0)

    def alloc(self, nbytes: int) -> Region:
        """A region of at least ``nbytes`` (first fit); :class:`ArenaFull` if none."""
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            for i, (off, size, fence) in enumerate(self._free):
                if size >= need:
                    if size == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, size - need, fence)
                    self.used += need
                    return Region(off, need, self.buffer[off:off + need], fence)
        raise ArenaFull(f"no free extent of {need} bytes (free {self.free_bytes} of "
                        f"{self.capacity}, largest {self.largest_free()})")

    def free(self, region: Region, fence: Fence = NO_FENCE) -> None:
        """Return ``region``; a later writer of its bytes first waits for ``fence``."""
        with self._lock:
            off, size = region.offset, region.nbytes
            i = bisect.bisect_left(self._free, off, key=lambda e: e[0])
            if i < len(self._free) and self._free[i][0] < off + size or \
                    i > 0 and self._free[i - 1][0] + self._free[i - 1][1] > off:
                raise ValueError(f"region at {off} ({size} bytes) is free already")
            self.used -= size
            entry = (off, size, fence)
            # merge with the neighbours; the merged extent keeps the newest fence
            if i < len(self._free) and self._free[i][0] == off + size:
                nxt = self._free.pop(i)
                entry = (off, size + nxt[1], _newest(fence, nxt[2]))
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
                prev = self._free.pop(i - 1)
                entry = (prev[0], prev[1] + entry[1], _newest(prev[2], entry[2]))
                i -= 1
            self._free.insert(i, entry)


class HeapArena:
    """:class:`Arena`'s interface over one allocation per region (host memory, the CPU
    build): the same capacity accounting, nothing allocated up front."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu"):
        if capacity < 0:
            raise ValueError(f"arena capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.device = torch.device(device)
        self._lock = threading.Lock()
        self._next = 0
        self.used = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return self.free_bytes

    def alloc(self, nbytes: int) -> Region:
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            if self.used + need > self.capacity:
                raise ArenaFull(f"{need} bytes do not fit ({self.used} of {self.capacity} used)")
            self.used += need
            self._next += 1
            key = self._next
        return Region(key, need, torch.empty(need, dtype=torch.uint8, device=self.device))

    def free(self, region: Region, fence: Fence = NO_FENCE) -> None:
        with self._lock:
            self.used -= region.nbytes


def copy_into(src: torch.Tensor, dst: torch.Tensor, region: Region) -> torch.Tensor:
    """``dst.copy_(src)`` after ``region``'s fence, on a side stream when a CUDA device is
    involved (finished before returning: the caller is a loader thread); returns ``dst``."""
    if dst.device.type == "cuda" or src.device.type == "cuda":
        device = dst.device if dst.device.type == "cuda" else src.device
        side = torch.cuda.Stream(device)
        region.wait_stream(side)
        region.wait_host()  # a host region may still feed an enqueued host -> device copy
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        side.synchronize()
    else:
        region.wait_host()
        dst.copy_(src)
    return dst


def _pinned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory, exactly: plain pages, touched by torch's
    threads, then registered with CUDA (``pin_memory=True`` would round the size up to a
    power of two: 68 GiB would take 128)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        buf.zero_()  # fault every page in, in parallel, before the driver locks them
        err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 1))  # portable
        if err != 0:
            raise RuntimeError(f"could not pin {nbytes} bytes of host memory (cudaError {err})")
    return buf


def _unpin(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _newest(a: Fence, b: Fence) -> Fence:
    return a if a.seq >= b.seq else b
