"""Conditional writes on S3 whatever the store's error wording: exclusive creates and the
compare-and-swap of LATEST, against moto and against moto behind a proxy that answers a
failed precondition the way MinIO does (a 412 whose body names no condition).
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from builders import make_inputs
from moto_s3 import s3_options
from inferscale.artifacts.blobs import Location, open_blobs
from inferscale.artifacts.layout import StoreConfig
from inferscale.artifacts.publish import _commit_manifest, _write_files, publish

FP = "fp-test"

# MinIO's answer to a failed If-None-Match / If-Match (cmd/api-errors.go,
# ErrPreconditionFailed): code and message as AWS's, but no <Condition> element, which
# is what s3fs looks at to raise FileExistsError.
MINIO_412 = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>PreconditionFailed</Code>'
             '<Message>At least one of the pre-conditions you specified did not hold</Message>'
             '<Key>{key}</Key><BucketName>{bucket}</BucketName><Resource>{path}</Resource>'
             '<RequestId>1842D5B3A0E5C6F1</RequestId>'
             '<HostId>dd9025bab4ad464b049177c95eb6ebf374d3b3fd1af9251148b658df7ac2e3e8</HostId>'
             '</Error>')


class _MinioErrors(BaseHTTPRequestHandler):
    """Forwards every request to moto; rewrites 412 answers into MinIO's form."""

    upstream: str = ""
    protocol_version = "HTTP/1.1"

    def _forward(self) -> None:
        body = b""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while size := int(self.rfile.readline().split(b";")[0], 16):
                body += self.rfile.read(size + 2)[:size]
            while self.rfile.readline().strip():  # trailers, then the blank line
                pass
        elif self.headers.get("Content-Length"):
            body = self.rfile.read(int(self.headers["Content-Length"]))
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("transfer-encoding", "content-length", "expect")}
        up = urlsplit(self.upstream)
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
        conn.request(self.command, self.path, body=body or None,
                     headers={**headers, "Content-Length": str(len(body))})
        resp = conn.getresponse()
        data = resp.read()
        length = resp.getheader("Content-Length") if self.command == "HEAD" else None
        out_headers = [(k, v) for k, v in resp.getheaders()
                       if k.lower() not in ("transfer-encoding", "content-length", "connection")]
        if resp.status == 412:
            bucket, _, key = self.path.split("?")[0].lstrip("/").partition("/")
            data = MINIO_412.format(key=key, bucket=bucket, path=self.path.split("?")[0]).encode()
            out_headers = [(k, v) for k, v in out_headers if k.lower() != "content-type"]
            out_headers.append(("Content-Type", "application/xml"))
        conn.close()
        self.send_response(resp.status)
        for k, v in out_headers:
            self.send_header(k, v)
        self.send_header("Content-Length", length or str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def minio_like_store(s3_store, moto_endpoint):
    """``s3_store``'s bucket reached through the MinIO-errors proxy."""
    handler = type("Handler", (_MinioErrors,), {"upstream": moto_endpoint})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield StoreConfig(s3_store.root, s3_options(f"http://127.0.0.1:{server.server_port}"))
    server.shutdown()
    server.server_close()


@pytest.fixture(params=["moto", "minio-errors"])
def s3_like(request):
    return request.getfixturevalue("s3_store" if request.param == "moto" else "minio_like_store")


def test_the_proxy_answers_like_minio(minio_like_store):
    """The fault this file is about: through the proxy s3fs no longer says "exists"."""
    fs = minio_like_store.filesystem()
    path = f"{minio_like_store.root}/probe"
    fs.pipe_file(path, b"one", mode="create")
    with pytest.raises(OSError) as err:
        fs.pipe_file(path, b"two", mode="create")
    assert not isinstance(err.value, FileExistsError)
    assert "pre-conditions" in str(err.value)


def test_lost_exclusive_create_reads_as_exists(s3_like):
    blobs = open_blobs(s3_like)
    path = blobs.join("users", "x", "manifest.json")
    assert blobs.create_exclusive(path, b"first") is True
    assert blobs.create_exclusive(path, b"second") is False
    assert blobs.read_bytes(path) == b"first"


def test_failed_create_of_an_absent_object_still_raises(moto_endpoint):
    blobs = open_blobs(StoreConfig("s3://no-such-bucket-here/x", s3_options(moto_endpoint)))
    with pytest.raises(OSError):
        blobs.create_exclusive(blobs.join("manifest.json"), b"data")


def test_publishers_of_one_version_through_minio_errors(minio_like_store):
    """A second publisher of the same inputs loses the manifest create (MinIO's 412):
    it adopts the first one's verified manifest instead of failing."""
    memory, facts, lineage = make_inputs("mia", 4)
    first = publish(minio_like_store, "mia", memory, facts, lineage, embeddings=False)
    loc = Location(minio_like_store, "mia", FP)
    late = _write_files(loc, first.version, memory, facts, lineage, first.manifest.encoder_config)
    manifest, created = _commit_manifest(loc, late, replace=False)
    assert (manifest, created) == (first.manifest, False)
    stored = set(loc.blobs.files(loc.version_dir(first.version)))
    assert stored == {"manifest.json", *(e.stored_as for e in first.manifest.files.values())}


def test_swap_retries_when_another_writer_got_in_between(s3_like):
    """Compare-and-swap: a write by someone else between our read and our conditional
    put (412, in AWS's or MinIO's words) makes us read and decide again."""
    blobs = open_blobs(s3_like)
    path = blobs.join("users", "x", "LATEST")
    seen = []

    def decide(current):
        seen.append(current)
        if len(seen) == 1:
            blobs.replace(path, b"theirs")  # a concurrent writer
        return (current or b"") + b"+ours"

    assert blobs.swap(path, decide) == b"theirs+ours"
    assert seen == [None, b"theirs"]
    assert blobs.read_bytes(path) == b"theirs+ours"
    assert blobs.swap(path, lambda current: None) == b"theirs+ours"  # None: kept as is
