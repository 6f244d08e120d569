"""Publishing, listing, reading and gc of artifacts, on local disk and on S3 (moto)."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest
import torch

from builders import expected_slab, make_inputs
from inferscale import artifacts as A
from inferscale.blobs import Location
from inferscale.hydrate import hydrate
from inferscale.store import (
    InvalidArtifactInput, InvalidStoreConfig, InvalidUserId, StoreConfig, user_dirname,
    user_from_dirname,
)

FP = "fp-test"


def snapshot(store: StoreConfig) -> dict:
    """Every stored object with its size and modification time."""
    fs = store.filesystem()
    root = store.root
    if not fs.exists(root):
        return {}
    out = {}
    for path, info in fs.find(root, detail=True).items():
        out[path] = (info["size"], str(info.get("mtime") or info.get("LastModified")))
    return out


def test_publish_round_trip(store):
    memory, facts, lineage = make_inputs("alice", 6)
    r = A.publish(store, "alice", memory, facts, lineage)
    assert r.created and len(r.version) == 32
    assert r.version == A.version_id("alice", lineage, FP, memory.encoder_config)
    assert A.latest_version(store, "alice", FP) == r.version
    m = A.read_manifest(store, "alice", FP)
    assert m == r.manifest
    assert m.user == "alice" and m.model_fingerprint == FP
    assert m.parents == {"log": lineage.log_hash, "facts": lineage.facts_hash}
    assert m.encoder_config == memory.encoder_config
    assert m.counts == {"facts": 6, "chunks": 7, "tokens": sum(len(c.token_ids) for c in memory.chunks)}
    assert set(m.files) == {"facts.arrow", "kv.arrow"}
    assert m.kv["slab_bytes"] == expected_slab(memory).numel() * 2
    assert A.verify_version(store, "alice", FP) == m
    assert A.read_facts(store, "alice", FP).equals(facts)
    assert [v.version for v in A.list_versions(store, "alice", FP)] == [r.version]
    assert A.list_users(store) == ["alice"]
    assert A.list_models(store, "alice") == [FP]
    table = A.open_fact_table(store, "alice", FP)
    got = table.to_arrow().sort_by("fact_id")
    assert got.column("fact_id").to_pylist() == facts.column("fact_id").to_pylist()
    assert got.column("embedding").to_pylist() == facts.column("embedding").to_pylist()


def test_unchanged_inputs_write_nothing(store):
    memory, facts, lineage = make_inputs("bob", 3)
    first = A.publish(store, "bob", memory, facts, lineage)
    before = snapshot(store)
    time.sleep(0.01)
    again = A.publish(store, "bob", memory, facts, lineage)
    assert (again.version, again.created) == (first.version, False)
    assert again.manifest == first.manifest
    assert snapshot(store) == before


def test_new_inputs_new_version_and_back(store):
    m1, f1, l1 = make_inputs("carol", 3, seed=1)
    m2, f2, l2 = make_inputs("carol", 4, seed=2)
    v1 = A.publish(store, "carol", m1, f1, l1).version
    v2 = A.publish(store, "carol", m2, f2, l2).version
    assert v1 != v2 and A.latest_version(store, "carol", FP) == v2
    assert [m.version for m in A.list_versions(store, "carol", FP)] == [v1, v2]
    assert A.open_fact_table(store, "carol", FP, v1).to_arrow().num_rows == 3
    assert A.open_fact_table(store, "carol", FP).to_arrow().num_rows == 4
    back = A.publish(store, "carol", m1, f1, l1)  # old inputs again: LATEST moves back
    assert (back.version, back.created) == (v1, False)
    assert A.latest_version(store, "carol", FP) == v1
    # a different encoder config is a different version
    m1.encoder_config = {**m1.encoder_config, "window": 7}
    assert A.publish(store, "carol", m1, f1, l1).version not in (v1, v2)


def test_version_depends_on_every_input():
    memory, _, lineage = make_inputs("u", 1)
    base = A.version_id("u", lineage, FP, memory.encoder_config)
    others = {
        A.version_id("v", lineage, FP, memory.encoder_config),
        A.version_id("u", A.Lineage("other", lineage.facts_hash), FP, memory.encoder_config),
        A.version_id("u", A.Lineage(lineage.log_hash, "other"), FP, memory.encoder_config),
        A.version_id("u", lineage, "fp-other", memory.encoder_config),
        A.version_id("u", lineage, FP, {**memory.encoder_config, "window": 0}),
    }
    assert base not in others and len(others) == 5
    assert base == A.version_id("u", lineage, FP, dict(reversed(memory.encoder_config.items())))


def test_gc_keeps_newest_and_latest(store):
    versions = []
    inputs = [make_inputs("dave", 2, seed=s) for s in range(4)]
    for memory, facts, lineage in inputs:
        versions.append(A.publish(store, "dave", memory, facts, lineage).version)
    removed = A.gc(store, "dave", FP, keep=2)
    assert sorted(removed) == sorted(versions[:2])
    loc = Location(store, "dave", FP)
    assert set(loc.blobs.listdir(loc.dir)) == {*versions[2:], "lance"}  # folders gone
    assert [m.version for m in A.list_versions(store, "dave", FP)] == versions[2:]
    tags = A.open_fact_table(store, "dave", FP).tags.list()
    assert set(tags) == set(versions[2:])
    # republish the oldest kept: LATEST now names an older version; keep=1 still keeps it
    A.publish(store, "dave", *inputs[2])
    assert A.latest_version(store, "dave", FP) == versions[2]
    assert A.gc(store, "dave", FP, keep=1) == []
    with pytest.raises(ValueError):
        A.gc(store, "dave", FP, keep=0)
    # publish(keep=...) collects too
    r = A.publish(store, "dave", *make_inputs("dave", 2, seed=9), keep=1)
    assert set(r.removed) == set(versions[2:])
    assert [m.version for m in A.list_versions(store, "dave", FP)] == [r.version]


def test_gc_removes_only_stale_unfinished_versions(local_store):
    store = local_store
    memory, facts, lineage = make_inputs("erin", 2)
    v = A.publish(store, "erin", memory, facts, lineage).version
    loc = Location(store, "erin", FP)
    stale, fresh = "a" * 32, "b" * 32
    for name in (stale, fresh):
        os.makedirs(loc.version_dir(name))
        with open(loc.file(name, "kv.arrow"), "wb") as f:
            f.write(b"partial")
    old = time.time() - 7200
    os.utime(loc.file(stale, "kv.arrow"), (old, old))
    os.utime(loc.version_dir(stale), (old, old))
    assert A.gc(store, "erin", FP, keep=5) == [stale]
    assert os.path.exists(loc.version_dir(fresh)) and not os.path.exists(loc.version_dir(stale))
    assert A.latest_version(store, "erin", FP) == v


@pytest.mark.parametrize("user", [
    "alice", "bob.smith_2-x", "Alice", "../../etc", "..", ".", "a/b", "a\\b", "/abs",
    "名前", "émile", "x" * 100, "x" * 101, "é" * 60, "é" * 61, "u" * 1024, " space", "~home",
    "_b32", "__hash", "con", "a\nb",
])
def test_user_dirnames_stay_in_their_folder(user):
    name = user_dirname(user)
    assert "/" not in name and "\\" not in name and "\x00" not in name
    assert not name.startswith(".") and name not in ("", ".", "..")
    assert len(name.encode()) <= 200
    assert name == name.lower() or name == user  # case-insensitive filesystems are safe
    decoded = user_from_dirname(name)
    assert decoded is None or decoded == user


def test_user_dirnames_do_not_collide():
    users = ["alice", "Alice", "ALICE", "_alice", "a/b", "a_b", "é" * 61, "é" * 62, "x" * 101]
    assert len({user_dirname(u) for u in users}) == len(users)


@pytest.mark.parametrize("user", ["", "a\x00b", "\ud800", "u" * 1025, None, 7])
def test_invalid_user_ids(user):
    with pytest.raises(InvalidUserId):
        user_dirname(user)


def test_hostile_user_ids_publish_inside_the_root(tmp_path):
    store = StoreConfig(str(tmp_path / "root"))
    for i, user in enumerate(["../../escape", "/etc/passwd", "..", "名前/../x"]):
        memory, facts, lineage = make_inputs(user, 1, seed=i)
        A.publish(store, user, memory, facts, lineage, embeddings=False)
        assert A.read_manifest(store, user, FP).user == user
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and all(p.is_relative_to(tmp_path / "root" / "users") for p in files)
    assert sorted(A.list_users(store)) == sorted(["../../escape", "/etc/passwd", "..", "名前/../x"])


def test_bad_model_fingerprint_names(local_store):
    memory, facts, lineage = make_inputs("u", 1, fp="../x")
    with pytest.raises(InvalidArtifactInput, match="fingerprint"):
        A.publish(local_store, "u", memory, facts, lineage)


def test_inconsistent_inputs_are_refused(local_store):
    store = local_store

    def attempt(user="u", mutate=lambda m, f: (m, f)):
        memory, facts, lineage = make_inputs("u", 3)
        memory, facts = mutate(memory, facts)
        A.publish(store, user, memory, facts, lineage, embeddings=False)

    def swap_first(m, f):
        m.chunks = m.chunks[1:] + m.chunks[:1]
        return m, f

    def drop_fact_chunk(m, f):
        m.chunks = m.chunks[:-1]
        return m, f

    def bad_shape(m, f):
        m.chunks[1].values = m.chunks[1].values[:, :, :1]
        return m, f

    def bad_dtype(m, f):
        m.chunks[1].keys = m.chunks[1].keys.float()
        m.chunks[1].values = m.chunks[1].values.float()
        return m, f

    def int_kv(m, f):
        for c in m.chunks:
            c.keys, c.values = c.keys.to(torch.int8), c.values.to(torch.int8)
        return m, f

    def bad_tokens(m, f):
        m.chunks[1].token_ids = m.chunks[1].token_ids + [1]
        return m, f

    def dup_chunk(m, f):
        m.chunks.append(m.chunks[1])
        return m, f

    def no_schema(m, f):
        return m, pa.table({"fact_id": ["a"]})

    def unjsonable(m, f):
        m.encoder_config = {"x": object()}
        return m, f

    for mutate, match in [(swap_first, "first chunk"), (drop_fact_chunk, "disagree"),
                          (bad_shape, "do not match"), (bad_dtype, "dtype"),
                          (int_kv, "not supported"), (bad_tokens, "token ids"),
                          (dup_chunk, "duplicate"), (unjsonable, "JSON")]:
        with pytest.raises(InvalidArtifactInput, match=match):
            attempt(mutate=mutate)
    with pytest.raises(A.ArtifactSchemaError):
        attempt(mutate=no_schema)
    with pytest.raises(InvalidArtifactInput, match="other than"):
        attempt(user="someone-else")
    assert not os.path.exists(os.path.join(store.root, "users", "u"))  # nothing written


def test_prefix_only_artifact(store):
    memory, facts, lineage = make_inputs("f", 0)
    r = A.publish(store, "f", memory, facts, lineage, embeddings=False)
    assert r.manifest.counts == {"facts": 0, "chunks": 1, "tokens": 4}


def test_store_config():
    s = StoreConfig("relative/dir")
    assert os.path.isabs(s.root) and s.is_local and s.protocol == "file"
    assert StoreConfig("file:///tmp/x/").root == "/tmp/x"
    s3 = StoreConfig("s3://bucket/prefix/", {"key": "k", "secret": "s", "client_kwargs": {
        "endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"}})
    assert s3.root == "s3://bucket/prefix" and not s3.is_local
    assert s3.lance_storage_options() == {
        "endpoint": "http://127.0.0.1:9000", "allow_http": "true", "region": "eu-west-1",
        "aws_access_key_id": "k", "aws_secret_access_key": "s"}
    for bad in ("", "   ", "nosuchproto://x", "s3://"):
        with pytest.raises(InvalidStoreConfig):
            StoreConfig(bad)


def test_store_config_from_settings(monkeypatch, tmp_path):
    from inferscale.settings import Settings

    monkeypatch.setenv("INFERSCALE_ARTIFACT_ROOT", "s3://b/p")
    monkeypatch.setenv("INFERSCALE_S3_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("INFERSCALE_S3_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("INFERSCALE_S3_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("INFERSCALE_S3_REGION", "us-east-1")
    s = StoreConfig.from_settings(Settings(_env_file=None))
    assert s.root == "s3://b/p"
    assert s.storage_options == {"key": "k", "secret": "s", "client_kwargs": {
        "endpoint_url": "http://127.0.0.1:9000", "region_name": "us-east-1"}}
    monkeypatch.delenv("INFERSCALE_ARTIFACT_ROOT")
    monkeypatch.setenv("INFERSCALE_HOME", str(tmp_path))
    assert StoreConfig.from_settings(Settings(_env_file=None)).root == str(tmp_path / "artifacts")


def test_manifest_is_json_for_people(local_store):
    memory, facts, lineage = make_inputs("g", 1)
    r = A.publish(local_store, "g", memory, facts, lineage, embeddings=False)
    loc = Location(local_store, "g", FP)
    body = json.loads(open(loc.file(r.version, "manifest.json")).read())
    assert body["parents"] == {"log": "log-0", "facts": "facts-0"}
    stored = body["files"]["kv.arrow"]["stored_as"]
    assert stored.startswith("kv.") and stored.endswith(".arrow") and stored != "kv.arrow"
    assert body["files"]["kv.arrow"]["bytes"] == os.path.getsize(loc.file(r.version, stored))
    assert A.data_path(loc, r.manifest, "kv.arrow") == loc.file(r.version, stored)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "removed", "manifest"])
def test_republish_repairs_a_version_that_does_not_verify(store, damage):
    """A complete version whose files no longer verify is written again by the next
    publish of its inputs, instead of ``created False`` while hydrate keeps failing."""
    memory, facts, lineage = make_inputs("rita", 5)
    first = A.publish(store, "rita", memory, facts, lineage)
    loc = Location(store, "rita", FP)
    fs = store.filesystem()
    path = A.data_path(loc, first.manifest, "kv.arrow")
    data = fs.cat_file(path)
    if damage == "flipped":  # same size: only the checksum tells
        fs.pipe_file(path, data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "truncated":
        fs.pipe_file(path, data[:-10])
    elif damage == "removed":
        fs.rm_file(path)
    else:
        mpath = loc.file(first.version, "manifest.json")
        fs.pipe_file(mpath, fs.cat_file(mpath).replace(b'"producer"', b'"producex"'))
    with pytest.raises((A.ChecksumError, A.TruncatedArtifact)):
        hydrate(store, "rita", FP)

    again = A.publish(store, "rita", memory, facts, lineage)
    assert (again.version, again.created, again.latest) == (first.version, True, first.version)
    assert A.verify_version(store, "rita", FP) == again.manifest
    assert torch.equal(hydrate(store, "rita", FP).slab, expected_slab(memory))
    assert A.read_facts(store, "rita", FP).equals(facts)
    assert A.publish(store, "rita", memory, facts, lineage).created is False  # verifies now


def test_latest_follows_the_newest_inputs(store):
    t = datetime(2026, 3, 1, tzinfo=timezone.utc)
    old, new = make_inputs("lena", 2, seed=1), make_inputs("lena", 3, seed=2)
    rn = A.publish(store, "lena", *new, inputs_at=t + timedelta(hours=1))
    ro = A.publish(store, "lena", *old, inputs_at=t)  # older inputs, finished later
    assert ro.created and ro.latest == rn.version == A.latest_version(store, "lena", FP)
    A.verify_version(store, "lena", FP, ro.version)  # complete all the same
    # the old inputs read again, later (a log reverted): LATEST moves back to them
    back = A.publish(store, "lena", *old, inputs_at=t + timedelta(hours=2))
    assert (back.version, back.created, back.latest) == (ro.version, False, ro.version)
    # a rollback by hand wins over every earlier publish
    assert A.set_latest(store, "lena", FP, rn.version) == rn.version
    assert A.publish(store, "lena", *old, inputs_at=t + timedelta(hours=3)).latest == rn.version
    with pytest.raises(InvalidArtifactInput, match="timezone"):
        A.publish(store, "lena", *old, inputs_at=datetime(2026, 3, 1))
    # a LATEST without a time (older InferScale) or naming a removed version gives way
    loc = Location(store, "lena", FP)
    loc.blobs.replace(loc.latest, (rn.version + "\n").encode())
    assert A.publish(store, "lena", *old, inputs_at=t).latest == ro.version
    loc.blobs.replace(loc.latest, A._latest_bytes("f" * 32, t + timedelta(days=9)))
    assert A.publish(store, "lena", *new, inputs_at=t).latest == rn.version


def test_gc_keeps_an_upload_in_progress_on_s3(s3_store):
    """An unfinished version whose data file is still being uploaded (a multipart upload:
    invisible to listings until complete) is not stale, however old its other files."""
    store = s3_store
    A.publish(store, "ursa", *make_inputs("ursa", 2), embeddings=False)
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
    assert A.gc(store, "ursa", FP, keep=1, stale_after_s=2) == []
    assert fs.exists(loc.file(partial, "facts.0123456789abcdef.arrow"))
    fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
    time.sleep(3.2)
    assert A.gc(store, "ursa", FP, keep=1, stale_after_s=2) == [partial]
    assert not fs.exists(loc.file(partial, "facts.0123456789abcdef.arrow"))


def test_gc_removes_stray_files_of_kept_versions_only_when_stale(local_store):
    """Files a manifest does not reference (a racing publisher's, a repaired version's,
    temporary names) go once stale; younger ones may be a publish in progress."""
    store = local_store
    r = A.publish(store, "sven", *make_inputs("sven", 2), embeddings=False)
    loc = Location(store, "sven", FP)
    vdir = loc.version_dir(r.version)
    names = ["kv.00000000deadbeef.arrow", ".kv.1234.arrow.99.abcd1234.tmp", "facts.ffff.arrow"]
    for name in names:
        with open(os.path.join(vdir, name), "wb") as f:
            f.write(b"partial")
    old = time.time() - 7200
    for name in names[:2]:
        os.utime(os.path.join(vdir, name), (old, old))
    assert A.gc(store, "sven", FP, keep=1) == []
    left = set(os.listdir(vdir))
    assert left == {"manifest.json", "facts.ffff.arrow",
                    *(e.stored_as for e in r.manifest.files.values())}
    A.verify_version(store, "sven", FP)
