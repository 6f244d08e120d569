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


# ------------------------------------------------------------------ gc racing a rollback

def three_versions(store, user: str):
    """v1, v2, v3 published from inputs taken an hour apart: LATEST names v3, and gc
    with keep=1 would remove v1 and v2. Returns the inputs and versions."""
    from datetime import datetime, timedelta, timezone

    t = datetime(2026, 3, 1, tzinfo=timezone.utc)
    inputs = [make_inputs(user, 2, seed=s) for s in range(3)]
    versions = [publish(store, user, *inp, inputs_at=t + timedelta(hours=i)).version
                for i, inp in enumerate(inputs)]
    return inputs, versions, t


def rollback(store, user: str, how: str, inputs, version: str, t) -> str:
    """Move LATEST back to ``version``: by publishing its inputs again, read later (a log
    reverted), or by hand (``point_latest`` with the time now). Returns what happened."""
    from datetime import timedelta

    from inferscale.artifacts.latest import inputs_time, point_latest
    from inferscale.artifacts.layout import ArtifactError

    try:
        if how == "publish":
            r = publish(store, user, *inputs, inputs_at=t + timedelta(hours=9))
            return f"published created={r.created} latest={r.latest == version}"
        named = point_latest(Location(store, user, FP), version, inputs_time(None))
        return "set True" if named == version else f"refused (LATEST names {named})"
    except ArtifactError as exc:
        return f"refused {type(exc).__name__}"


def check_latest_reads(store, user: str) -> str:
    """LATEST names a version that verifies; returns it."""
    latest = latest_version(store, user, FP)
    assert verify_version(store, user, FP).version == latest
    return latest


@pytest.mark.parametrize("how", ["publish", "by_hand"])
def test_a_rollback_right_after_gc_read_latest_is_kept(store, how, monkeypatch):
    """gc reads LATEST (v3) and decides to remove v1; a rollback to v1 lands right then.
    gc must notice (its fence reads LATEST again) and keep v1."""
    import inferscale.artifacts.gc as G

    inputs, (v1, v2, v3), t = three_versions(store, "rhea")
    real, outcome = G.latest_version, []

    def read_then_rollback(*args):
        seen = real(*args)
        if not outcome:
            outcome.append(rollback(store, "rhea", how, inputs[0], v1, t))
        return seen

    monkeypatch.setattr(G, "latest_version", read_then_rollback)
    removed = gc(store, "rhea", FP, keep=1)
    assert outcome in (["published created=False latest=True"], ["set True"]), outcome
    assert check_latest_reads(store, "rhea") == v1
    assert removed == [v2]
    assert {m.version for m in list_versions(store, "rhea", FP)} == {v1, v3}


@pytest.mark.parametrize("how", ["publish", "by_hand"])
def test_a_rollback_between_gc_decision_and_its_deletes(store, how, monkeypatch):
    """gc has decided (v1 and v2 go) and is about to delete; a rollback to v1 lands now.
    LATEST must not end on a deleted version: a publish writes v1 again (new files that
    gc's deletes do not touch), a rollback by hand is refused and LATEST stays on v3."""
    import inferscale.artifacts.gc as G

    inputs, (v1, v2, v3), t = three_versions(store, "rhea")
    real, outcome = G._remove_stray_files, []

    def rollback_then_continue(*args):
        if not outcome:
            outcome.append(rollback(store, "rhea", how, inputs[0], v1, t))
        return real(*args)

    monkeypatch.setattr(G, "_remove_stray_files", rollback_then_continue)
    removed = gc(store, "rhea", FP, keep=1)
    latest = check_latest_reads(store, "rhea")
    if how == "publish":
        assert outcome == ["published created=True latest=True"] and latest == v1
        assert {m.version for m in list_versions(store, "rhea", FP)} == {v1, v3}
    else:
        assert outcome[0].startswith("refused") and latest == v3  # verified, or in the swap
        assert {m.version for m in list_versions(store, "rhea", FP)} == {v3}
    assert sorted(removed) == sorted([v1, v2])


def test_a_rollback_inside_gc_fence_makes_it_decide_again(s3_store, monkeypatch):
    """On S3 (no lock) a rollback can land between the fence's read of LATEST and its
    conditional write: the write fails, the manifest gc took away is put back and gc
    decides again on the new LATEST. (On local disk the fence holds LATEST's lock, so a
    rollback waits for it: the two tests above cover both sides of it.)"""
    import inferscale.artifacts.gc as G

    store = s3_store
    inputs, (v1, v2, v3), t = three_versions(store, "rhea")
    real, outcome = G._unpublish, []

    def rollback_then_unpublish(loc, m):
        if not outcome:
            outcome.append(rollback(store, "rhea", "by_hand", inputs[0], v1, t))
        return real(loc, m)

    monkeypatch.setattr(G, "_unpublish", rollback_then_unpublish)
    removed = gc(store, "rhea", FP, keep=1)
    assert outcome == ["set True"]
    assert check_latest_reads(store, "rhea") == v1
    assert removed == [v2]
    assert {m.version for m in list_versions(store, "rhea", FP)} == {v1, v3}


def test_gc_without_a_readable_latest_removes_nothing(local_store):
    inputs, versions, _ = three_versions(local_store, "nola")
    loc = Location(local_store, "nola", FP)
    for content in (b"not a version\n", None):
        if content is None:
            os.remove(loc.latest)
        else:
            loc.blobs.replace(loc.latest, content)
        assert gc(local_store, "nola", FP, keep=1) == []
        assert [m.version for m in list_versions(local_store, "nola", FP)] == versions


def test_latest_never_moves_to_a_version_whose_manifest_is_gone(local_store):
    """The other side of gc's fence: moving LATEST checks, inside its compare-and-swap,
    that the version still reads; gc removes a manifest before anything else."""
    from datetime import timedelta

    from inferscale.artifacts.latest import point_latest

    inputs, (v1, v2, v3), t = three_versions(local_store, "rhea")
    loc = Location(local_store, "rhea", FP)
    os.remove(loc.file(v1, "manifest.json"))
    assert point_latest(loc, v1, t + timedelta(days=1)) == v3
    assert check_latest_reads(local_store, "rhea") == v3


def test_a_manifest_with_a_numeric_creation_time_is_left_alone(local_store):
    """A version whose manifest was re-signed with ``created`` a number (sorting it
    against the strings of the others raised TypeError in listing and gc): it is a
    damaged version, which listing skips and gc leaves alone; the others are listed and
    collected as usual."""
    import json

    from storage_schemas.manifest import _checksum

    versions = [publish(local_store, "gus", *make_inputs("gus", 2, seed=s),
                        embeddings=False).version for s in range(3)]
    loc = Location(local_store, "gus", FP)
    path = loc.file(versions[0], "manifest.json")
    body = {k: v for k, v in json.loads(local_store.filesystem().cat_file(path)).items()
            if k != "checksum"}
    body["created"] = 1767225600
    local_store.filesystem().pipe_file(
        path, json.dumps({**body, "checksum": _checksum(body)}).encode())
    assert [m.version for m in list_versions(local_store, "gus", FP)] == versions[1:]
    assert gc(local_store, "gus", FP, keep=1) == [versions[1]]
    assert set(loc.blobs.listdir(loc.dir)) == {versions[0], versions[2]}
