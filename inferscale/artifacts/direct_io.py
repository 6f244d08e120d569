"""Reading local files around the page cache (``O_DIRECT``), for an honest storage tier.

A file opened with ``O_DIRECT`` is read by DMA from the device into the caller's memory:
nothing is cached, so a read costs what the disk costs however often the bytes were read
before. That is what a serving worker with far more users than RAM sees, and what a
benchmark must measure when many users share one file on disk (hard links): read through
the page cache, the second user's read would come from RAM.

``O_DIRECT`` needs the file offset, the length and the memory address of each read
aligned to the device's logical block size (:data:`ALIGN`, 4096: a multiple of every
common one). :class:`DirectFile` reads any byte range anyway: the aligned superset of
the range goes into a page-aligned bounce buffer (an anonymous ``mmap`` of
``bounce_bytes``, taken from a small pool and given back after the read), one large
``preadv`` per window, and the wanted bytes are copied into the destination with torch
(``Tensor.copy_`` releases the GIL; a memoryview slice copy would hold it, and these
reads run on thread pools inside vLLM's engine process, whose thread must not wait).
When the destination's address and the offset agree modulo :data:`ALIGN`, the aligned
interior is read straight into the destination (no copy) and only the partial blocks
at either end go through the bounce buffer.

Where the filesystem refuses ``O_DIRECT`` (``EINVAL`` at open or at the first read:
ramfs, procfs, some overlay and network filesystems) the file falls back to buffered
reads followed by ``posix_fadvise(DONTNEED)`` on the range read, so the bytes do not
stay cached, and says so: :attr:`DirectFile.reader` is :data:`FALLBACK` and
:attr:`DirectFile.bypassed` is False (the bytes did pass through the page cache, and a
concurrent reader of the same pages may have found them there). Never is bypass claimed
that was not had. :func:`read_counts` counts files, reads and bytes per reader in this
process (the serving worker's status reports them).

Readers that want a file object (Arrow's reader of a kv file's footer and index columns)
get one over :meth:`DirectFile.read` from the store
(:class:`~inferscale.artifacts.blob_base.WindowedFile`).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from inferscale.artifacts.layout import TruncatedArtifact

ALIGN = 4096  # >= every common logical block size (512, 4096), and the page size
BOUNCE_BYTES = 8 << 20  # one preadv per window: a Llama-8B fact (~6 MB) in one read
DIRECT = "O_DIRECT"
FALLBACK = "buffered+fadvise(DONTNEED)"
BUFFERED = "buffered"  # plain page-cache reads (DirectFile(direct=False))
READERS = (DIRECT, FALLBACK, BUFFERED)

_O_DIRECT = getattr(os, "O_DIRECT", None)
_KEEP = 16  # bounce buffers kept per size for reuse (at most a few concurrent readers)


def supports_direct_io(path: str) -> bool:
    """Whether the file ``path`` (or, for a folder, a file created there) can be opened
    with ``O_DIRECT`` and read: what :class:`DirectFile` would get."""
    probe = None
    if os.path.isdir(path):
        probe = os.path.join(path, f".direct-io-probe.{os.getpid()}.{threading.get_ident()}")
        with open(probe, "wb") as f:
            f.write(b"\0" * ALIGN)
        path = probe
    try:
        f = DirectFile(path, count=False)
        try:
            f.read(0, min(ALIGN, f.size))
            return f.bypassed
        finally:
            f.close()
    finally:
        if probe is not None:
            os.unlink(probe)


class DirectFile:
    """One local file read around the page cache (see the module docstring).

    ``direct=False`` reads through the page cache as any file (:data:`BUFFERED`: a
    benchmark's comparison). Thread-safe: concurrent :meth:`read` calls share the file
    descriptor (``preadv`` has no file position)."""

    def __init__(self, path: str, direct: bool = True, bounce_bytes: int = BOUNCE_BYTES,
                 count: bool = True):
        if bounce_bytes < ALIGN or bounce_bytes % ALIGN:
            raise ValueError(f"bounce_bytes must be a positive multiple of {ALIGN}")
        self.path, self.bounce_bytes, self._count = path, bounce_bytes, count
        self._lock = threading.Lock()
        self._replaced: list[int] = []  # descriptors a fallback replaced (reads may be on them)
        self.reader = BUFFERED
        self.fd = -1
        if direct:
            self.reader = FALLBACK
            if _O_DIRECT is not None:  # None: not Linux
                try:
                    self.fd = os.open(path, os.O_RDONLY | _O_DIRECT)
                    self.reader = DIRECT
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
        if self.fd < 0:
            self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self._tally("files", 1)

    @property
    def bypassed(self) -> bool:
        """Whether this file's reads skip the page cache (``O_DIRECT`` accepted)."""
        return self.reader == DIRECT

    def read(self, offset: int, n: int, into: Any = None) -> memoryview:
        """``n`` bytes at ``offset`` into ``into`` (a writable buffer of at least ``n``
        bytes: a memoryview, a bytearray, a CPU uint8 tensor; None: a new bytearray);
        returns a memoryview of those ``n`` bytes. :class:`TruncatedArtifact` when the
        file ends first."""
        if offset < 0 or n < 0:
            raise ValueError(f"offset {offset} and length {n} must be >= 0")
        dest = memoryview(bytearray(n) if into is None else _writable(into)).cast("B")[:n]
        if len(dest) < n:
            raise ValueError(f"{n} bytes do not fit the {len(dest)}-byte buffer")
        if n:
            reader = self.reader
            if reader == DIRECT:
                try:
                    self._read_direct(offset, n, dest)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    reader = self._fall_back()
            if reader != DIRECT:
                self._exact(dest, offset)
                if reader == FALLBACK:
                    _drop_cached(self.fd, offset, n)
            self._tally("reads", 1, reader, n)
        return dest

    def close(self) -> None:
        with self._lock:
            fds, self.fd, self._replaced = [self.fd, *self._replaced], -1, []
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _fall_back(self) -> str:
        """``O_DIRECT`` was accepted at open but a read refused it: reopen buffered."""
        with self._lock:
            if self.reader == DIRECT:
                fd = os.open(self.path, os.O_RDONLY)
                self._replaced.append(self.fd)
                self.fd, self.reader = fd, FALLBACK
                self._tally("files", 1)
            return self.reader

    def _read_direct(self, offset: int, n: int, dest: memoryview) -> None:
        end = offset + n
        lo, hi = -(-offset // ALIGN) * ALIGN, end // ALIGN * ALIGN
        if hi - lo >= ALIGN and (_address(dest) - offset) % ALIGN == 0:
            if lo > offset:
                self._bounced(offset, lo - offset, dest[:lo - offset])
            self._exact(dest[lo - offset:hi - offset], lo)
            if end > hi:
                self._bounced(hi, end - hi, dest[hi - offset:])
        else:
            self._bounced(offset, n, dest)

    def _bounced(self, offset: int, n: int, dest: memoryview) -> None:
        """The aligned windows around ``[offset, offset + n)`` through a bounce buffer."""
        end, pos = offset + n, offset
        out = torch.frombuffer(dest, dtype=torch.uint8)
        with _bounce(self.bounce_bytes) as (buf, staged):
            while pos < end:
                start = pos // ALIGN * ALIGN
                span = min(self.bounce_bytes, -(-end // ALIGN) * ALIGN - start)
                got = os.preadv(self.fd, [buf[:span]], start)
                take = min(start + got, end) - pos
                if take <= 0:
                    raise TruncatedArtifact(f"{self.path} ended at {start + got} bytes; "
                                            f"expected at least {end}")
                out[pos - offset:pos - offset + take].copy_(
                    staged[pos - start:pos - start + take])
                pos += take

    def _exact(self, dest: memoryview, offset: int) -> None:
        """Fill ``dest`` from ``offset`` (both aligned, or a buffered file)."""
        got = 0
        while got < len(dest):
            k = os.preadv(self.fd, [dest[got:]], offset + got)
            if k == 0:
                raise TruncatedArtifact(f"{self.path} ended at {offset + got} bytes; "
                                        f"expected at least {offset + len(dest)}")
            got += k

    def _tally(self, what: str, k: int, reader: str | None = None, nbytes: int = 0) -> None:
        if self._count:
            with _COUNTS_LOCK:
                counts = _COUNTS[reader or self.reader]
                counts[what] += k
                counts["bytes"] += nbytes


_COUNTS: dict[str, dict[str, int]] = {r: {"files": 0, "reads": 0, "bytes": 0} for r in READERS}
_COUNTS_LOCK = threading.Lock()


def read_counts() -> dict[str, dict[str, int]]:
    """Files opened, reads and bytes read by each reader (:data:`READERS`) in this
    process, since it started."""
    with _COUNTS_LOCK:
        return {r: dict(c) for r, c in _COUNTS.items()}


# ------------------------------------------------------------------------ helpers

_POOL: dict[int, list[tuple[mmap.mmap, memoryview, torch.Tensor]]] = {}
_POOL_LOCK = threading.Lock()


@contextmanager
def _bounce(size: int) -> Iterator[tuple[memoryview, torch.Tensor]]:
    """A page-aligned buffer of ``size`` bytes (memoryview and uint8 tensor views), from
    the pool (allocated once per concurrent reader, then reused)."""
    with _POOL_LOCK:
        free = _POOL.setdefault(size, [])
        item = free.pop() if free else None
    if item is None:
        m = mmap.mmap(-1, size)  # anonymous: page-aligned
        item = (m, memoryview(m), torch.frombuffer(m, dtype=torch.uint8))
    try:
        yield item[1], item[2]
    finally:
        with _POOL_LOCK:
            free = _POOL.setdefault(size, [])
            if len(free) < _KEEP:
                free.append(item)


def _writable(buf: Any) -> Any:
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("read into a contiguous CPU tensor")
        return buf.view(torch.uint8).reshape(-1).numpy() if buf.numel() else bytearray()
    return buf


def _address(mv: memoryview) -> int:
    return torch.frombuffer(mv, dtype=torch.uint8).data_ptr() if len(mv) else 0


def _drop_cached(fd: int, offset: int, n: int) -> None:
    """Ask the kernel to drop the range's clean pages (best effort: some filesystems
    keep them, and pages another process maps stay)."""
    try:
        os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
