"""Reading a local file through a private memory map, its xxh3-128 fused into the read.

:func:`map_and_hash` maps a file copy-on-write and hashes it in order, part by part,
while a helper thread populates the next few parts (``MADV_POPULATE_READ``, Linux >=
5.14; plain page faults elsewhere), so the disk read and the checksum overlap and the
hash pass is the read. The helper stays at most ``ahead`` parts ahead of the hash, so
while ``read_part`` holds the hash back (a throttled reload) at most that many parts are
read meanwhile. The mapping is the page cache: nothing is copied, and writing into
it copies pages, never the file. Artifacts are immutable and gc only unlinks, so a
mapping stays valid. Used to read whole kv files: a version's slab for serving
(:func:`inferscale.hydrate.slab.hydrate`) and for reuse by its next version
(:func:`inferscale.artifacts.read.read_kv_rows`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from typing import Callable

import numpy as np
import xxhash

from inferscale.artifacts.layout import TruncatedArtifact


_PREFETCH_PARTS = 4


def map_and_hash(path: str, size: int, part_bytes: int = 32 << 20,
                 read_part: Callable[[int], None] | None = None,
                 ahead: int = _PREFETCH_PARTS) -> tuple[np.ndarray, str]:
    """``path`` (``size`` bytes, else :class:`TruncatedArtifact`) mapped privately, as a
    uint8 array, and its xxh3-128 hex digest, hashed in parts of ``part_bytes`` in order
    (module docstring); ``read_part(nbytes)`` is called after each part; ``ahead``: parts
    populated ahead of the hash (>= 1)."""
    if ahead < 1:
        raise ValueError(f"ahead must be >= 1, got {ahead}")
    fd = os.open(path, os.O_RDONLY)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise TruncatedArtifact(f"{path} is {actual} bytes; the manifest says {size}")
        if size == 0:
            return np.empty(0, dtype=np.uint8), xxhash.xxh3_128_hexdigest(b"")
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    _advise(mm, "MADV_SEQUENTIAL")
    arr = np.frombuffer(mm, dtype=np.uint8)
    part = max(mmap.PAGESIZE, part_bytes // mmap.PAGESIZE * mmap.PAGESIZE)
    offsets = range(0, size, part)
    ready = [threading.Event() for _ in offsets]
    room = threading.Semaphore(ahead)
    stop = threading.Event()
    populate = _populate()

    def prefetch() -> None:
        ok, base = populate is not None, arr.ctypes.data
        for i, offset in enumerate(offsets):
            room.acquire()
            if stop.is_set():
                break
            if ok:
                ok = populate(base + offset, min(part, size - offset))
            ready[i].set()
        for event in ready:
            event.set()

    helper = threading.Thread(target=prefetch, name="inferscale-prefetch", daemon=True)
    helper.start()
    h = xxhash.xxh3_128()
    view = memoryview(mm)
    try:
        for i, offset in enumerate(offsets):
            ready[i].wait()
            h.update(view[offset:offset + part])
            room.release()
            if read_part is not None:
                read_part(min(part, size - offset))
    finally:
        stop.set()
        room.release()
        helper.join()
        view.release()
    _advise(mm, "MADV_NORMAL")
    return arr, h.hexdigest()


_MADV_POPULATE_READ = 22  # linux/mman.h, Linux >= 5.14


def _populate():
    """``populate(address, length) -> ok`` through libc's madvise (ctypes releases the
    GIL, so the hashing thread runs meanwhile), or None where that is unavailable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return lambda address, length: madvise(address, length, _MADV_POPULATE_READ) == 0


def _advise(mm: mmap.mmap, name: str) -> None:
    flag = getattr(mmap, name, None)
    if flag is not None:
        try:
            mm.madvise(flag)
        except OSError:
            pass
