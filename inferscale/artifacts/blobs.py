"""File operations on a store root: atomic writes, exclusive creates, compare-and-swap,
fused reads.

Writes are atomic per file: on local disk a temporary sibling is written, fsynced and
``os.replace``-d (then the directory is fsynced); on object stores a single PUT or a
multipart upload becomes visible only when complete (an aborted upload is discarded,
never committed). ``create_exclusive`` lets exactly one concurrent writer create a file
(``os.link`` locally, ``If-None-Match: *`` through s3fs; other fsspec filesystems fall
back to fsspec's check-then-write); a failed conditional put counts as "exists" by what
the store holds afterwards, not by the error's wording (MinIO's 412 names no condition).
``swap`` replaces a small file by compare-and-swap (a lock file locally, ``If-Match``
on the ETag on S3), so concurrent writers of ``LATEST`` cannot undo each other's checks.

Reads can be fused with checksums: :meth:`Blobs.read_into` streams a file in parts
(ranged parallel reads on object stores, parallel ``preadv`` on local disk) straight into
a caller's buffer and hashes every part with xxh3-128, in order, as it lands. A local
store with ``StoreConfig.direct_io`` reads every file (ranges, whole files, the file
objects of :meth:`Blobs.open_read`) around the page cache
(:mod:`inferscale.artifacts.direct_io`, which needs torch and is imported only then).

:func:`open_blobs` picks :class:`LocalBlobs` (here) or
:class:`~inferscale.artifacts.object_store.FsspecBlobs`; both implement
:class:`~inferscale.artifacts.blob_base.Blobs`. :class:`Location` names the files of one
(user, model) under a store.

Only fsspec, xxhash and the standard library are needed here.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from typing import Any, Callable

from inferscale.artifacts.blob_base import Blobs, HashingWriter, T, Written
from inferscale.artifacts.layout import (
    LANCE_DIR, LATEST_FILE, StoreConfig, TruncatedArtifact, check_model_fp, check_version,
    user_dirname,
)
from inferscale.artifacts.object_store import FsspecBlobs


class LocalBlobs(Blobs):
    def read_bytes(self, path: str) -> bytes:
        if self.config.direct_io:
            from inferscale.artifacts.direct_io import DirectFile

            with DirectFile(path) as f:
                return bytes(f.read(0, f.size))
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

    def remove_empty_dir(self, path: str) -> None:
        try:
            os.rmdir(path)
        except OSError:  # not empty (a file written meanwhile stays), or gone
            pass

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

    def swap(self, path: str, decide: Callable[[bytes | None], bytes | None]) -> bytes | None:
        d, name = os.path.split(path)
        os.makedirs(d, exist_ok=True)
        fd = os.open(os.path.join(d, f".{name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # writers only; readers see os.replace atomically
            try:
                current: bytes | None = self.read_bytes(path)
            except FileNotFoundError:
                current = None
            new = decide(current)
            if new is None or new == current:
                return current
            self.replace(path, new)
            return new
        finally:
            os.close(fd)  # releases the lock

    def files(self, path: str) -> dict[str, float]:
        try:
            return {e.name: e.stat(follow_symlinks=False).st_mtime for e in os.scandir(path)
                    if e.is_file(follow_symlinks=False)}
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def write_stream(self, path: str, fill: Callable[[HashingWriter], T],
                     watch: int | None = None) -> Written:
        tmp = self._tmp(path)
        try:
            with open(tmp, "wb") as f:
                w = HashingWriter(f)
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
        if self.config.direct_io:
            from inferscale.artifacts.direct_io import DirectFile

            f = DirectFile(path)
            return f.read, f.close
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

    ``Location(config, user, model_fp).file(version, name)`` is file ``name`` of that
    version (:func:`inferscale.artifacts.read.data_path` gives a data file's stored
    name). Used by :mod:`inferscale.artifacts` and :mod:`inferscale.hydrate`.
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

