"""File operations on a store root: atomic writes, exclusive creates, fused reads.

Writes are atomic per file: on local disk a temporary sibling is written, fsynced and
``os.replace``-d (then the directory is fsynced); on object stores a single PUT or a
multipart upload becomes visible only when complete (an aborted upload is discarded,
never committed). ``create_exclusive`` lets exactly one concurrent writer create a file
(``os.link`` locally, ``If-None-Match: *`` through s3fs; other fsspec filesystems fall
back to fsspec's check-then-write).

Reads can be fused with checksums: :meth:`Blobs.read_into` streams a file in parts
(ranged parallel reads on object stores, parallel ``preadv`` on local disk) straight into
a caller's buffer and hashes every part with xxh3-128, in order, as it lands.

:class:`Location` names the files of one (user, model) under a store.

Callers: the rest of :mod:`inferscale.artifacts` and :mod:`inferscale.hydrate.slab`.
Only fsspec, xxhash and the standard library are needed here.
"""

from __future__ import annotations

import os
import shutil
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import xxhash

from inferscale.artifacts.layout import (
    LANCE_DIR, LATEST_FILE, StoreConfig, TruncatedArtifact, check_model_fp, check_version,
    user_dirname,
)

T = TypeVar("T")


class _HashingWriter:
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
    def replace(self, path: str, data: bytes) -> None: raise NotImplementedError
    def create_exclusive(self, path: str, data: bytes) -> bool: raise NotImplementedError
    def write_stream(self, path: str, fill: Callable[[_HashingWriter], T],
                     watch: int | None = None) -> Written: raise NotImplementedError
    def _range_reader(self, path: str) -> tuple[Callable[[int, int, Any], Any], Callable[[], None]]:
        raise NotImplementedError

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


class LocalBlobs(Blobs):
    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def size(self, path: str) -> int | None:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return None

    def mtime(self, path: str) -> float | None:
        newest = None
        try:
            for entry in os.scandir(path):
                t = entry.stat(follow_symlinks=False).st_mtime
                newest = t if newest is None else max(newest, t)
            t = os.stat(path).st_mtime
        except FileNotFoundError:
            return newest
        return t if newest is None else max(newest, t)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def remove_file(self, path: str) -> None:
        _unlink(path)

    def _tmp(self, path: str) -> str:
        d, name = os.path.split(path)
        os.makedirs(d, exist_ok=True)
        return os.path.join(d, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")

    def _write_tmp(self, path: str, data: bytes) -> str:
        tmp = self._tmp(path)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def replace(self, path: str, data: bytes) -> None:
        tmp = self._write_tmp(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        _fsync_dir(os.path.dirname(path))

    def create_exclusive(self, path: str, data: bytes) -> bool:
        tmp = self._write_tmp(path, data)
        try:
            os.link(tmp, path)  # atomic, fails when the name exists
            created = True
        except FileExistsError:
            created = False
        finally:
            _unlink(tmp)
        _fsync_dir(os.path.dirname(path))
        return created

    def write_stream(self, path: str, fill: Callable[[_HashingWriter], T],
                     watch: int | None = None) -> Written:
        tmp = self._tmp(path)
        try:
            with open(tmp, "wb") as f:
                w = _HashingWriter(f)
                w.watch = watch
                result = fill(w)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        _fsync_dir(os.path.dirname(path))
        return Written(w.n, w.h.hexdigest(), result, w.watched_at)

    def _range_reader(self, path: str):
        fd = os.open(path, os.O_RDONLY)

        def read(offset: int, n: int, into: memoryview | None) -> Any:
            buf = into if into is not None else memoryview(bytearray(n))
            got = 0
            while got < n:
                k = os.preadv(fd, [buf[got:]], offset + got)
                if k == 0:
                    raise TruncatedArtifact(f"{path} ended at {offset + got} bytes; expected more")
                got += k
            return buf

        return read, lambda: os.close(fd)


class FsspecBlobs(Blobs):
    def __init__(self, config: StoreConfig) -> None:
        super().__init__(config)
        self.fs = config.filesystem()

    def read_bytes(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def size(self, path: str) -> int | None:
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        return None if info.get("type") == "directory" else int(info["size"])

    def mtime(self, path: str) -> float | None:
        newest = None
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return None
        for e in entries:
            t = e.get("LastModified") or e.get("mtime") or e.get("created")
            if t is None:
                continue
            t = t.timestamp() if hasattr(t, "timestamp") else float(t)
            newest = t if newest is None else max(newest, t)
        return newest

    def listdir(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1]
                      for e in entries if e.get("type") == "directory")

    def remove_tree(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    def remove_file(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def replace(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)  # one PUT: readers see the old or the new object

    def create_exclusive(self, path: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True

    def write_stream(self, path: str, fill: Callable[[_HashingWriter], T],
                     watch: int | None = None) -> Written:
        f = self.fs.open(path, "wb")
        try:
            w = _HashingWriter(f)
            w.watch = watch
            result = fill(w)
        except BaseException:
            try:  # abort the upload; never let close() commit a partial object
                f.discard()
            finally:
                try:
                    f.closed = True
                except AttributeError:
                    pass
            raise
        f.close()
        return Written(w.n, w.h.hexdigest(), result, w.watched_at)

    def _range_reader(self, path: str):
        def read(offset: int, n: int, into: memoryview | None) -> Any:
            data = self.fs.cat_file(path, start=offset, end=offset + n)
            if len(data) != n:
                raise TruncatedArtifact(f"{path}: short read at {offset} ({len(data)} of {n} bytes)")
            if into is None:
                return data
            into[:] = data
            return into

        return read, lambda: None


def open_blobs(config: StoreConfig) -> Blobs:
    return LocalBlobs(config) if config.is_local else FsspecBlobs(config)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Location:
    """Paths of one (user, model) under a store; validates both names once.

    ``Location(config, user, model_fp).file(version, KV_FILE)`` is the kv.arrow of that
    version. Used by :mod:`inferscale.artifacts` and :mod:`inferscale.hydrate`.
    """

    def __init__(self, config: StoreConfig, user: str, model_fp: str) -> None:
        self.config = config
        self.user = user
        self.user_dir = user_dirname(user)
        self.model_fp = check_model_fp(model_fp)
        self.blobs = open_blobs(config)
        self.dir = self.blobs.join("users", self.user_dir, self.model_fp)

    def version_dir(self, version: str) -> str:
        return f"{self.dir}/{check_version(version)}"

    def file(self, version: str, name: str) -> str:
        return f"{self.version_dir(version)}/{name}"

    @property
    def latest(self) -> str:
        return f"{self.dir}/{LATEST_FILE}"

    @property
    def lance_uri(self) -> str:
        return f"{self.dir}/{LANCE_DIR}"

    def describe(self, version: str | None = None) -> str:
        where = f"user {self.user!r}, model {self.model_fp}"
        return f"{where}, version {version}" if version else where
