"""The interface of file operations on a store root, and what its writes return.

:class:`Blobs` is implemented by :class:`inferscale.artifacts.blobs.LocalBlobs` (local
disk) and :class:`inferscale.artifacts.object_store.FsspecBlobs` (S3 and other fsspec
stores); :func:`inferscale.artifacts.blobs.open_blobs` picks one (the module docstring of
:mod:`inferscale.artifacts.blobs` states the guarantees). The reads fused with
checksums (:meth:`Blobs.read_into`) are written once, here, over each implementation's
ranged reader.

Small random reads (:meth:`Blobs.open_read`: an Arrow file's footer and a few columns)
go through :class:`WindowedFile` over the same ranged reader: each miss reads a whole
window, so a version's chunk index (its kv file's footer, then index columns that lie
together near the file's start) costs two reads, where a 64 KiB buffer made eight of an
8B user's ~1 MB: each a trip to the disk with ``O_DIRECT`` (behind whatever else is
queued there), a GET on S3.

Only the two implementations use it; everyone else goes through ``open_blobs`` or
:class:`~inferscale.artifacts.blobs.Location`.
"""

from __future__ import annotations

import io
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import xxhash

from inferscale.artifacts.layout import StoreConfig

T = TypeVar("T")
WINDOW_BYTES = 2 << 20  # a miss reads this much from its (4 KiB-aligned) position
TAIL_BYTES = 64 << 10  # or, within a file's last TAIL_BYTES, just those (the footer)
BLOCK = 4096  # windows start on a multiple of it (O_DIRECT reads whole blocks)


class WindowedFile(io.RawIOBase):
    """A seekable read-only file over a ranged reader ``read(offset, n, into)`` of a
    file of ``size`` bytes, keeping its last two windows (see the module docstring):
    reads inside one are copies, a miss reads a window (a read at least ``window`` long
    goes straight to the caller's buffer). Closing it calls ``close``."""

    def __init__(self, read: Callable[[int, int, Any], Any], close: Callable[[], None],
                 size: int, window: int = WINDOW_BYTES, tail: int = TAIL_BYTES):
        super().__init__()
        self._read, self._close, self.size = read, close, size
        self.window, self.tail = window, tail
        self.pos = 0
        self.reads = 0  # reads of the underlying file
        self._windows: list[tuple[int, memoryview]] = []  # (offset, bytes), newest first

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        dest = memoryview(b).cast("B")
        n = max(0, min(len(dest), self.size - self.pos))
        if n == 0:
            return 0
        got = self._held(self.pos, n)
        if got is None and n >= self.window:
            self.reads += 1
            self._read(self.pos, n, dest[:n])
        else:
            dest[:n] = got if got is not None else self._fill(self.pos, n)
        self.pos += n
        return n

    def _held(self, pos: int, n: int) -> memoryview | None:
        for start, data in self._windows:
            if start <= pos and pos + n <= start + len(data):
                return data[pos - start:pos - start + n]
        return None

    def _fill(self, pos: int, n: int) -> memoryview:
        start = max(0, self.size - self.tail) if pos >= self.size - self.tail \
            else pos - pos % BLOCK
        end = min(self.size, max(start + (self.tail if pos >= self.size - self.tail
                                          else self.window), pos + n))
        self.reads += 1
        data = memoryview(self._read(start, end - start, None)).cast("B")
        self._windows = [(start, data), *self._windows[:1]]
        return data[pos - start:pos - start + n]

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def close(self) -> None:
        if not self.closed:
            self._windows = []
            self._close()
        super().close()


class HashingWriter:
    """File-like sink: hashes and counts every byte and forwards it in bounded pieces
    (so an s3fs writer uploads parts as they fill instead of buffering a whole slab).
    ``watch`` is a buffer address; the position where that buffer is written is kept
    in ``watched_at`` (the slab offset inside kv.arrow)."""

    def __init__(self, f: Any, piece: int = 16 << 20) -> None:
        self.f, self.piece = f, piece
        self.h = xxhash.xxh3_128()
        self.n = 0
        self.watch: int | None = None
        self.watched_at: int | None = None
        self.closed = False

    def write(self, data: Any) -> int:
        if self.watch is not None and getattr(data, "address", None) == self.watch:
            self.watched_at = self.n
        mv = memoryview(data).cast("B")
        self.h.update(mv)
        for o in range(0, len(mv), self.piece):
            self.f.write(mv[o:o + self.piece])
        self.n += len(mv)
        return len(mv)

    def tell(self) -> int:
        return self.n

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def close(self) -> None:  # the owner closes the real file
        self.closed = True


@dataclass(frozen=True)
class Written:
    """What :meth:`Blobs.write_stream` stored: size, xxh3-128, the fill result and the
    file position where the watched buffer was written (``None`` if it never was)."""

    nbytes: int
    xxh3_128: str
    result: Any
    watched_at: int | None = None


class Blobs:
    """File operations on one store root; :func:`open_blobs` picks local or fsspec."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.root = config.root

    def join(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    # each subclass implements these
    def read_bytes(self, path: str) -> bytes: raise NotImplementedError
    def size(self, path: str) -> int | None: raise NotImplementedError
    def mtime(self, path: str) -> float | None: raise NotImplementedError
    def listdir(self, path: str) -> list[str]: raise NotImplementedError
    def remove_tree(self, path: str) -> None: raise NotImplementedError
    def remove_file(self, path: str) -> None: raise NotImplementedError
    def remove_empty_dir(self, path: str) -> None:
        """Remove folder ``path`` if it is empty (object stores have no folders: nothing)."""
    def replace(self, path: str, data: bytes) -> None: raise NotImplementedError
    def create_exclusive(self, path: str, data: bytes) -> bool: raise NotImplementedError
    def swap(self, path: str, decide: Callable[[bytes | None], bytes | None]) -> bytes | None:
        """Compare-and-swap: ``decide(current)`` (``None`` when absent) returns the new
        content or ``None`` to keep it; the write happens only if nobody changed the file
        since it was read (else read and decide again). Returns what the file holds."""
        raise NotImplementedError
    def files(self, path: str) -> dict[str, float]:
        """Plain files directly under ``path`` (temporary names included) -> mtime."""
        raise NotImplementedError
    def write_stream(self, path: str, fill: Callable[[HashingWriter], T],
                     watch: int | None = None) -> Written: raise NotImplementedError
    def _range_reader(self, path: str) -> tuple[Callable[[int, int, Any], Any], Callable[[], None]]:
        raise NotImplementedError
    def open_read(self, path: str, size: int | None = None) -> WindowedFile:
        """A seekable binary file object for small random reads (a file's footer, its
        metadata and a few columns), read in windows (:class:`WindowedFile`); ``size``:
        the file's, when the caller has just checked it (not asked again: on S3 a HEAD)."""
        size = self.size(path) if size is None else size
        if size is None:
            raise FileNotFoundError(path)
        read, close = self._range_reader(path)
        return WindowedFile(read, close, size)

    def exists(self, path: str) -> bool:
        return self.size(path) is not None

    def read_into(self, path: str, size: int, dest: Any | None = None, *,
                  part_bytes: int = 32 << 20, workers: int = 4,
                  on_part: Callable[[int, int], None] | None = None) -> str:
        """Read ``size`` bytes of ``path`` into ``dest`` (a writable uint8 buffer, or
        ``None`` to only hash) in parts read in parallel; hash every part in order as it
        lands and call ``on_part(offset, length)`` after hashing it. Returns the xxh3-128
        hex digest. A file shorter than ``size`` raises :class:`TruncatedArtifact`."""
        h = xxhash.xxh3_128()
        mv = memoryview(dest).cast("B") if dest is not None else None
        parts = [(o, min(part_bytes, size - o)) for o in range(0, size, part_bytes)]
        read, close = self._range_reader(path)
        try:
            with ThreadPoolExecutor(max(1, workers)) as pool:
                ahead = max(2, 2 * workers)
                futs: list[Future] = []

                def submit(i: int) -> None:
                    o, n = parts[i]
                    futs.append(pool.submit(read, o, n, mv[o:o + n] if mv is not None else None))

                for i in range(min(ahead, len(parts))):
                    submit(i)
                try:
                    for i, (o, n) in enumerate(parts):
                        h.update(futs[i].result())
                        futs[i] = None  # type: ignore[call-overload]  # drop hash-only bytes
                        if on_part is not None:
                            on_part(o, n)
                        if i + ahead < len(parts):
                            submit(i + ahead)
                except BaseException:
                    for f in futs:
                        if f is not None:
                            f.cancel()
                    raise
        finally:
            close()
        return h.hexdigest()

    def hash_file(self, path: str, size: int) -> str:
        """xxh3-128 of the first ``size`` bytes (the whole file when sizes agree)."""
        workers = 2 if self.config.is_local else 8
        return self.read_into(path, size, None, part_bytes=8 << 20, workers=workers)

