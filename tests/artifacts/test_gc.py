"""Garbage collection: the newest versions and LATEST's stay, stale unfinished ones go."""

from __future__ import annotations

import os
import time

import pytest

from builders import make_inputs
from inferscale.artifacts.blobs import Location
from inferscale.artifacts.gc import gc
from inferscale.artifacts.publish import publish
from inferscale.artifacts.read import (
    latest_version, list_versions, open_fact_table, verify_version,
)

FP = "fp-test"


def test_gc_keeps_newest_and_latest(store):
    versions = []
    inputs = [make_inputs("dave", 2, seed=s) for s in range(4)]
    for memory, facts, lineage in inputs:
        versions.append(publish(store, "dave", memory, facts, lineage).version)
    removed = gc(store, "dave", FP, keep=2)
    assert sorted(removed) == sorted(versions[:2])
    loc = Location(store, "dave", FP)
    assert set(loc.blobs.listdir(loc.dir)) == {*versions[2:], "lance"}  # folders gone
    assert [m.version for m in list_versions(store, "dave", FP)] == versions[2:]
    tags = open_fact_table(store, "dave", FP).tags.list()
    assert set(tags) == set(versions[2:])
    # republish the oldest kept: LATEST now names an older version; keep=1 still keeps it
    publish(store, "dave", *inputs[2])
    assert latest_version(store, "dave", FP) == versions[2]
    assert gc(store, "dave", FP, keep=1) == []
    with pytest.raises(ValueError):
        gc(store, "dave", FP, keep=0)
    # publish(keep=...) collects too
    r = publish(store, "dave", *make_inputs("dave", 2, seed=9), keep=1)
    assert set(r.removed) == set(versions[2:])
    assert [m.version for m in list_versions(store, "dave", FP)] == [r.version]


def test_gc_removes_only_stale_unfinished_versions(local_store):
    store = local_store
    memory, facts, lineage = make_inputs("erin", 2)
    v = publish(store, "erin", memory, facts, lineage).version
    loc = Location(store, "erin", FP)
    stale, fresh = "a" * 32, "b" * 32
    for name in (stale, fresh):
        os.makedirs(loc.version_dir(name))
        with open(loc.file(name, "kv.arrow"), "wb") as f:
            f.write(b"partial")
    old = time.time() - 7200
    os.utime(loc.file(stale, "kv.arrow"), (old, old))
    os.utime(loc.version_dir(stale), (old, old))
    assert gc(store, "erin", FP, keep=5) == [stale]
    assert os.path.exists(loc.version_dir(fresh)) and not os.path.exists(loc.version_dir(stale))
    assert latest_version(store, "erin", FP) == v


def test_gc_keeps_an_upload_in_progress_on_s3(s3_store):
    """An unfinished version whose data file is still being uploaded (a multipart upload:
    invisible to listings until complete) is not stale, however old its other files."""
    store = s3_store
    publish(store, "ursa", *make_inputs("ursa", 2), embeddings=False)
    loc = Location(store, "ursa", FP)
    fs = store.filesystem()
    partial = "c" * 32
    fs.pipe_file(loc.file(partial, "facts.0123456789abcdef.arrow"), b"facts")
    bucket, key, _ = fs.split_path(loc.file(partial, "kv.0123456789abcdef.arrow"))
    upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=1,
               Body=b"x" * (5 << 20))
    time.sleep(3.2)  # the facts file is now "stale" for stale_after_s=2
    fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=2,
               Body=b"y" * 10)  # but the upload goes on
    assert gc(store, "ursa", FP, keep=1, stale_after_s=2) == []
    assert fs.exists(loc.file(partial, "facts.0123456789abcdef.arrow"))
    fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
    time.sleep(3.2)
    assert gc(store, "ursa", FP, keep=1, stale_after_s=2) == [partial]
    assert not fs.exists(loc.file(partial, "facts.0123456789abcdef.arrow"))


def test_gc_removes_stray_files_of_kept_versions_only_when_stale(local_store):
    """Files a manifest does not reference (a racing publisher's, a repaired version's,
    temporary names) go once stale; younger ones may be a publish in progress."""
    store = local_store
    r = publish(store, "sven", *make_inputs("sven", 2), embeddings=False)
    loc = Location(store, "sven", FP)
    vdir = loc.version_dir(r.version)
    names = ["kv.00000000deadbeef.arrow", ".kv.1234.arrow.99.abcd1234.tmp", "facts.ffff.arrow"]
    for name in names:
        with open(os.path.join(vdir, name), "wb") as f:
            f.write(b"partial")
    old = time.time() - 7200
    for name in names[:2]:
        os.utime(os.path.join(vdir, name), (old, old))
    assert gc(store, "sven", FP, keep=1) == []
    left = set(os.listdir(vdir))
    assert left == {"manifest.json", "facts.ffff.arrow",
                    *(e.stored_as for e in r.manifest.files.values())}
    verify_version(store, "sven", FP)
