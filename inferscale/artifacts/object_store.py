"""File operations on object stores through fsspec (S3 through s3fs, or any fsspec
filesystem): :class:`FsspecBlobs`, the object-store implementation of
:class:`~inferscale.artifacts.blob_base.Blobs`.

On S3 (s3fs): exclusive creates are ``If-None-Match: *`` PUTs, and a failed one counts
as "exists" when the object exists afterwards, whatever the error says (AWS names the
failed condition, MinIO's 412 names none, some stores answer 409); ``swap`` is a
compare-and-swap by ``If-Match`` on the ETag read with the bytes (``If-None-Match: *``
when absent), retried on a failed precondition or a conflict; ``mtime`` counts multipart
uploads still in progress (invisible to listings until complete) as activity, so gc
leaves a large upload alone. Other fsspec stores have no conditional writes: the last
writer wins.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Callable

from inferscale.artifacts.blob_base import Blobs, HashingWriter, T, Written
from inferscale.artifacts.layout import StoreConfig, TruncatedArtifact

log = logging.getLogger(__name__)


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
        """Newest modification under ``path``: its objects and, on S3, the multipart
        uploads still in progress there (started or last given a part): an upload is
        invisible to listings until it completes, but it is activity all the same."""
        times = list(self.files(path).values()) + self._uploads_activity(path)
        return max(times) if times else None

    def files(self, path: str) -> dict[str, float]:
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for e in entries:
            t = e.get("LastModified") or e.get("mtime") or e.get("created")
            if e.get("type") == "directory" or t is None:
                continue
            out[e["name"].rstrip("/").rsplit("/", 1)[-1]] = _seconds(t)
        return out

    def _uploads_activity(self, path: str) -> list[float]:
        if not hasattr(self.fs, "call_s3"):
            return []
        bucket, key, _ = self.fs.split_path(path)
        times = []
        try:
            uploads = self.fs.call_s3("list_multipart_uploads", Bucket=bucket,
                                      Prefix=key.rstrip("/") + "/").get("Uploads", [])
        except PermissionError as exc:  # no s3:ListBucketMultipartUploads: objects only
            log.warning("cannot list uploads in progress under %s: %s", path, exc)
            return []
        for up in uploads:
            times.append(_seconds(up["Initiated"]))
            parts = self.fs.call_s3("list_parts", Bucket=bucket, Key=up["Key"],
                                    UploadId=up["UploadId"]).get("Parts", [])
            times += [_seconds(p["LastModified"]) for p in parts]
        return times

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

    def remove_empty_dir(self, path: str) -> None:
        if hasattr(self.fs, "call_s3"):
            return  # a prefix vanishes with its last object
        try:
            if not self.fs.ls(path, detail=False):
                self.fs.rmdir(path)
        except OSError:
            pass

    def replace(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)  # one PUT: readers see the old or the new object

    def create_exclusive(self, path: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(path, data, mode="create")
        except OSError:
            # s3fs says FileExistsError only when the 412 names the If-None-Match
            # condition (AWS's wording); MinIO's names none, some stores answer 409, and a
            # retried PUT whose first attempt landed fails too. Whatever the wording: if
            # the object exists now, the create was lost (or already done): "exists".
            self.fs.invalidate_cache(path)
            if self.exists(path):
                return False
            raise
        return True

    def swap(self, path: str, decide: Callable[[bytes | None], bytes | None]) -> bytes | None:
        if not hasattr(self.fs, "call_s3"):  # no conditional writes: last writer wins
            try:
                current: bytes | None = self.read_bytes(path)
            except FileNotFoundError:
                current = None
            new = decide(current)
            if new is not None and new != current:
                self.replace(path, new)
                return new
            return current
        from fsspec.asyn import sync

        bucket, key, _ = self.fs.split_path(path)

        async def get() -> tuple[bytes | None, str | None]:
            try:
                resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            except FileNotFoundError:
                return None, None
            try:
                return await resp["Body"].read(), resp["ETag"]
            finally:
                resp["Body"].close()

        for attempt in range(100):
            current, etag = sync(self.fs.loop, get)  # the bytes and their ETag, one response
            new = decide(current)
            if new is None or new == current:
                return current
            cond = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
            try:
                self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=new, **cond)
            except OSError as exc:  # FileNotFoundError: deleted since read (If-Match)
                if not (_condition_failed(exc) or isinstance(exc, FileNotFoundError)):
                    raise
                time.sleep(random.uniform(0.5, 1.5) * min(0.5, 0.005 * 2 ** attempt))
                continue
            finally:
                self.fs.invalidate_cache(path)
            return new
        raise OSError(f"{path}: gave up after 100 conflicting concurrent updates")

    def write_stream(self, path: str, fill: Callable[[HashingWriter], T],
                     watch: int | None = None) -> Written:
        f = self.fs.open(path, "wb")
        try:
            w = HashingWriter(f)
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


def _seconds(t: Any) -> float:
    return t.timestamp() if hasattr(t, "timestamp") else float(t)


def _condition_failed(exc: BaseException) -> bool:
    """Whether an s3fs error is a failed precondition (412) or a conflicting concurrent
    conditional write (409), by status and code, whatever the message says."""
    response = getattr(exc.__cause__, "response", None) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = response.get("Error", {}).get("Code")
    return (isinstance(exc, FileExistsError) or status in (409, 412)
            or code in ("PreconditionFailed", "ConditionalRequestConflict"))

