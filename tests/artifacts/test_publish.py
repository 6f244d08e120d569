"""Publishing and reading artifacts back, on local disk and on S3 (moto)."""

from __future__ import annotations

import json
import os
import time

import pyarrow as pa
import pytest
import torch

from builders import expected_slab, make_inputs, regrouped
from inferscale.artifacts.blobs import Location
from inferscale.artifacts.layout import (
    ArtifactSchemaError, ChecksumError, InvalidArtifactInput, InvalidUserId, StoreConfig,
    TruncatedArtifact,
)
from inferscale.artifacts.publish import Lineage, publish, publish_linked, version_id
from inferscale.artifacts.read import (
    data_path, latest_version, list_versions, open_fact_table, read_facts, read_manifest,
    verify_version,
)
from inferscale.hydrate.slab import hydrate

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
    r = publish(store, "alice", memory, facts, lineage)
    assert r.created and len(r.version) == 32
    assert r.version == version_id("alice", lineage, FP, memory.encoder_config)
    assert latest_version(store, "alice", FP) == r.version
    m = read_manifest(store, "alice", FP)
    assert m == r.manifest
    assert m.user == "alice" and m.model_fingerprint == FP
    assert m.parents == {"log": lineage.log_hash, "facts": lineage.facts_hash}
    assert m.encoder_config == memory.encoder_config
    assert m.counts == {"facts": 6, "chunks": 7, "tokens": sum(len(c.token_ids) for c in memory.chunks)}
    assert set(m.files) == {"facts.arrow", "kv.arrow"}
    assert m.kv["slab_bytes"] == expected_slab(memory).numel() * 2
    assert verify_version(store, "alice", FP) == m
    assert read_facts(store, "alice", FP).equals(facts)
    assert [v.version for v in list_versions(store, "alice", FP)] == [r.version]
    table = open_fact_table(store, "alice", FP)
    got = table.to_arrow().sort_by("fact_id")
    assert got.column("fact_id").to_pylist() == facts.column("fact_id").to_pylist()
    assert got.column("embedding").to_pylist() == facts.column("embedding").to_pylist()


def test_unchanged_inputs_write_nothing(store):
    memory, facts, lineage = make_inputs("bob", 3)
    first = publish(store, "bob", memory, facts, lineage)
    before = snapshot(store)
    time.sleep(0.01)
    again = publish(store, "bob", memory, facts, lineage)
    assert (again.version, again.created) == (first.version, False)
    assert again.manifest == first.manifest
    assert snapshot(store) == before


def test_new_inputs_new_version_and_back(store):
    m1, f1, l1 = make_inputs("carol", 3, seed=1)
    m2, f2, l2 = make_inputs("carol", 4, seed=2)
    v1 = publish(store, "carol", m1, f1, l1).version
    v2 = publish(store, "carol", m2, f2, l2).version
    assert v1 != v2 and latest_version(store, "carol", FP) == v2
    assert [m.version for m in list_versions(store, "carol", FP)] == [v1, v2]
    assert open_fact_table(store, "carol", FP, v1).to_arrow().num_rows == 3
    assert open_fact_table(store, "carol", FP).to_arrow().num_rows == 4
    back = publish(store, "carol", m1, f1, l1)  # old inputs again: LATEST moves back
    assert (back.version, back.created) == (v1, False)
    assert latest_version(store, "carol", FP) == v1
    # a different encoder config is a different version
    m1.encoder_config = {**m1.encoder_config, "window": 7}
    assert publish(store, "carol", m1, f1, l1).version not in (v1, v2)


def test_version_depends_on_every_input():
    memory, _, lineage = make_inputs("u", 1)
    base = version_id("u", lineage, FP, memory.encoder_config)
    others = {
        version_id("v", lineage, FP, memory.encoder_config),
        version_id("u", Lineage("other", lineage.facts_hash), FP, memory.encoder_config),
        version_id("u", Lineage(lineage.log_hash, "other"), FP, memory.encoder_config),
        version_id("u", lineage, "fp-other", memory.encoder_config),
        version_id("u", lineage, FP, {**memory.encoder_config, "window": 0}),
    }
    assert base not in others and len(others) == 5
    assert base == version_id("u", lineage, FP, dict(reversed(memory.encoder_config.items())))


def test_user_ids_publish_inside_the_root_or_not_at_all(tmp_path):
    """Ids of the one user-id rule get a folder of their own; hostile ones are refused
    before anything is written."""
    store = StoreConfig(str(tmp_path / "root"))
    for i, user in enumerate(["名前", "Zoë.Q", "o'brien", "x" * 128]):
        memory, facts, lineage = make_inputs(user, 1, seed=i)
        publish(store, user, memory, facts, lineage, embeddings=False)
        assert read_manifest(store, user, FP).user == user
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert files and all(p.is_relative_to(tmp_path / "root" / "users") for p in files)
    for user in ["../../escape", "/etc/passwd", "..", "名前/../x", "ann smith"]:
        memory, facts, lineage = make_inputs(user, 1)
        with pytest.raises(InvalidUserId):
            publish(store, user, memory, facts, lineage, embeddings=False)
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == files


def test_bad_model_fingerprint_names(local_store):
    memory, facts, lineage = make_inputs("u", 1, fp="../x")
    with pytest.raises(InvalidArtifactInput, match="fingerprint"):
        publish(local_store, "u", memory, facts, lineage)


def test_inconsistent_inputs_are_refused(local_store):
    store = local_store

    def attempt(user="u", mutate=lambda m, f: (m, f)):
        memory, facts, lineage = make_inputs("u", 3)
        memory, facts = mutate(memory, facts)
        publish(store, user, memory, facts, lineage, embeddings=False)

    def swap_first(m, f):
        m.chunks = m.chunks[1:] + m.chunks[:1]
        return m, f

    def drop_fact_chunk(m, f):
        m.chunks = m.chunks[:-1]
        return m, f

    def bad_shape(m, f):
        m.chunks[1].kv = m.chunks[1].kv[..., :1, :]
        return m, f

    def bad_dtype(m, f):
        m.chunks[1].kv = m.chunks[1].kv.float()
        return m, f

    def int_kv(m, f):
        for c in m.chunks:
            c.kv = c.kv.to(torch.int8)
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
    with pytest.raises(ArtifactSchemaError):
        attempt(mutate=no_schema)
    with pytest.raises(InvalidArtifactInput, match="other than"):
        attempt(user="someone-else")
    assert not os.path.exists(os.path.join(store.root, "users", "u"))  # nothing written


def test_prefix_only_artifact(store):
    memory, facts, lineage = make_inputs("f", 0)
    r = publish(store, "f", memory, facts, lineage, embeddings=False)
    assert r.manifest.counts == {"facts": 0, "chunks": 1, "tokens": 4}


def test_manifest_records_the_key_calibration(local_store):
    """The temperatures calibrated keys are divided by: in the manifest (``kv``), not in
    the version id (a function of the inputs it hashes); absent when uncalibrated."""
    memory, facts, lineage = make_inputs("c", 2)
    plain = publish(local_store, "c", memory, facts, lineage, embeddings=False)
    assert "key_calibration" not in plain.manifest.kv
    memory.calibration = {"granularity": "layer", "temperatures": [[1.1, 1.1], [0.95, 0.95]],
                          "probes": 8}
    memory.encoder_config = {**memory.encoder_config, "key_calibration": "layer"}
    r = publish(local_store, "c", memory, facts, lineage, embeddings=False)
    assert r.version == version_id("c", lineage, FP, memory.encoder_config) != plain.version
    assert read_manifest(local_store, "c", FP, r.version).kv["key_calibration"] == \
        memory.calibration


def test_manifest_is_json_for_people(local_store):
    memory, facts, lineage = make_inputs("g", 1)
    r = publish(local_store, "g", memory, facts, lineage, embeddings=False)
    loc = Location(local_store, "g", FP)
    body = json.loads(open(loc.file(r.version, "manifest.json")).read())
    assert body["parents"] == {"log": "log-0", "facts": "facts-0"}
    stored = body["files"]["kv.arrow"]["stored_as"]
    assert stored.startswith("kv.") and stored.endswith(".arrow") and stored != "kv.arrow"
    assert body["files"]["kv.arrow"]["bytes"] == os.path.getsize(loc.file(r.version, stored))
    assert data_path(loc, r.manifest, "kv.arrow") == loc.file(r.version, stored)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "removed", "manifest"])
def test_republish_repairs_a_version_that_does_not_verify(store, damage):
    """A complete version whose files no longer verify is written again by the next
    publish of its inputs, instead of ``created False`` while hydrate keeps failing."""
    memory, facts, lineage = make_inputs("rita", 5)
    first = publish(store, "rita", memory, facts, lineage)
    loc = Location(store, "rita", FP)
    fs = store.filesystem()
    path = data_path(loc, first.manifest, "kv.arrow")
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
    with pytest.raises((ChecksumError, TruncatedArtifact)):
        hydrate(store, "rita", FP)

    again = publish(store, "rita", memory, facts, lineage)
    assert (again.version, again.created, again.latest) == (first.version, True, first.version)
    assert verify_version(store, "rita", FP) == again.manifest
    assert torch.equal(hydrate(store, "rita", FP).slab, expected_slab(memory))
    assert read_facts(store, "rita", FP).equals(facts)
    assert publish(store, "rita", memory, facts, lineage).created is False  # verifies now


def test_verification_never_reads_outside_the_version_folder(local_store, tmp_path):
    """A re-signed schema-1 manifest (files stored under their logical names) whose
    ``files`` name a path outside the version folder is refused as corrupt: the outside
    file is never opened, and no error tells its size or checksum."""
    from storage_schemas.manifest import _checksum

    from inferscale.artifacts.layout import CorruptArtifact

    r = publish(local_store, "otto", *make_inputs("otto", 2), embeddings=False)
    loc = Location(local_store, "otto", FP)
    secret = tmp_path / "outside.bin"
    secret.write_bytes(b"s" * 1234)
    rel = os.path.relpath(secret, loc.version_dir(r.version))
    body = json.loads(r.manifest.to_json())
    body.pop("checksum")
    body["schema_version"] = 1
    for entry in body["files"].values():  # schema 1: the logical names are the paths
        entry.pop("stored_as")
    for name, entry in r.manifest.files.items():
        os.replace(loc.file(r.version, entry.stored_as), loc.file(r.version, name))
    body["files"][rel] = {"bytes": 1, "xxh3_128": "0" * 32}
    body["checksum"] = _checksum(body)
    with open(loc.file(r.version, "manifest.json"), "w") as f:
        json.dump(body, f)
    with pytest.raises(CorruptArtifact) as err:
        verify_version(local_store, "otto", FP)
    assert "1234" not in str(err.value) and "files" in str(err.value)
    import xxhash

    assert xxhash.xxh3_128_hexdigest(secret.read_bytes()) not in str(err.value)
    body["files"].pop(rel)  # the same manifest without the outside key verifies
    body["checksum"] = _checksum({k: v for k, v in body.items() if k != "checksum"})
    with open(loc.file(r.version, "manifest.json"), "w") as f:
        json.dump(body, f)
    verify_version(local_store, "otto", FP)


def test_a_geometry_other_than_the_model_s_is_refused(local_store):
    """Chunks of another geometry than the model's, same bytes per token: refused against
    the encoder's record of its model and against the caller's; nothing written. Publish
    never guesses the geometry: without either it refuses too."""
    from dataclasses import replace

    from inferscale.types import KVGeometry

    memory, facts, lineage = make_inputs("u", 3, layers=2, heads=2, head_dim=8)
    with pytest.raises(InvalidArtifactInput, match=r"geometry \[L=2, H=2, D=8\]"):
        publish(local_store, "u", regrouped(memory), facts, lineage, embeddings=False)
    memory, facts, lineage = make_inputs("u", 3, layers=2, heads=2, head_dim=8)
    with pytest.raises(InvalidArtifactInput, match=r"geometry \[L=2, H=4, D=4\]"):
        publish(local_store, "u", memory, facts, lineage, geometry=KVGeometry(2, 4, 4),
                embeddings=False)
    with pytest.raises(InvalidArtifactInput, match="geometry .* is not known"):
        publish(local_store, "u", replace(memory, geometry=None), facts, lineage,
                embeddings=False)
    assert not os.path.exists(os.path.join(local_store.root, "users", "u"))
    r = publish(local_store, "u", replace(memory, geometry=None), facts, lineage,
                geometry=KVGeometry(2, 2, 8), embeddings=False)
    assert (r.manifest.kv["layers"], r.manifest.kv["kv_heads"], r.manifest.kv["head_dim"]) \
        == (2, 2, 8)


def test_a_linked_version_shares_the_kv_file_and_hydrates_verified(local_store, s3_store):
    """Users of one memory: the second user's version holds its own facts table and
    manifest, its kv file a hard link to the first's (one inode), and hydrates verified
    as the same slab; publishing it again keeps it; object stores are refused."""
    memory, facts, lineage = make_inputs("ann", 4)
    first = publish(local_store, "ann", memory, facts, lineage, embeddings=False)
    at = facts.schema.get_field_index("user")
    bob_facts = facts.set_column(at, facts.schema.field(at), pa.array(["bob"] * facts.num_rows))
    bob = publish_linked(local_store, "bob", first.manifest, bob_facts, lineage)
    assert bob.created
    assert bob.version == version_id("bob", lineage, FP, first.manifest.encoder_config)
    assert read_facts(local_store, "bob", FP).equals(bob_facts)
    paths = [data_path(Location(local_store, u, FP), r.manifest, "kv.arrow")
             for u, r in (("ann", first), ("bob", bob))]
    assert os.stat(paths[0]).st_ino == os.stat(paths[1]).st_ino
    a, b = (hydrate(local_store, u, FP, device="cpu") for u in ("ann", "bob"))
    assert b.version == bob.version and torch.equal(a.slab, b.slab) and a.index == b.index
    again = publish_linked(local_store, "bob", first.manifest, bob_facts, lineage)
    assert (again.created, again.version) == (False, bob.version)
    with pytest.raises(InvalidArtifactInput, match="3 facts for 4"):
        publish_linked(local_store, "cy", first.manifest, bob_facts.slice(0, 3).set_column(
            at, facts.schema.field(at), pa.array(["cy"] * 3)), lineage)
    with pytest.raises(InvalidArtifactInput, match="local artifact store"):
        publish_linked(s3_store, "bob", first.manifest, bob_facts, lineage)
