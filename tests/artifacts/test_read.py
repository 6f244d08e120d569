"""Reading a version's KV rows by content key (what its next version reuses): the stored
rows as the encoder emitted them, verified, without hydration; its facts with the
manifest the caller read already."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from builders import make_inputs
from inferscale.artifacts.blobs import Location
from inferscale.artifacts.layout import ArtifactSchemaError, ChecksumError
from inferscale.artifacts.publish import publish
from inferscale.artifacts.read import data_path, read_facts, read_kv_rows, read_manifest
from inferscale.types import ChunkKV

FP = "fp-test"


def keyed(memory):
    for i, c in enumerate(memory.chunks[1:]):
        c.content_key = f"key-{i}"
    return memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_rows_by_content_key_are_the_encoders_rows(store, dtype):
    memory, facts, lineage = make_inputs("erin", 4, dtype=dtype)
    r = publish(store, "erin", keyed(memory), facts, lineage, embeddings=False)
    rows = read_kv_rows(store, "erin", FP, r.version)
    assert set(rows) == {f"key-{i}" for i in range(4)}  # the prefix has no key
    for i, c in enumerate(memory.chunks[1:]):
        got = rows[f"key-{i}"]
        assert isinstance(got, ChunkKV) and got.kv.shape == c.kv.shape  # [t, 2, L, H, D]
        assert torch.equal(got.kv.view(torch.uint8), c.kv.view(torch.uint8))
        if c.scales is None:
            assert got.scales is None
        else:
            assert torch.equal(got.scales, c.scales)
    # views of the one file buffer (memory-mapped locally), nothing laid out again
    bases = {v.kv.untyped_storage().data_ptr() for v in rows.values()}
    assert len(bases) == 1


def test_latest_and_unkeyed_versions(local_store):
    memory, facts, lineage = make_inputs("ann", 3)
    publish(local_store, "ann", memory, facts, lineage, embeddings=False)
    assert read_kv_rows(local_store, "ann", FP) == {}  # builders set no keys: nothing to reuse
    direct = replace(local_store, direct_io=True)  # read into memory, not mapped
    memory, facts, lineage = make_inputs("ann", 3, seed=4)
    r = publish(local_store, "ann", keyed(memory), facts, lineage, embeddings=False)
    assert torch.equal(read_kv_rows(direct, "ann", FP, r.version)["key-1"].kv,
                       memory.chunks[2].kv)


def test_damaged_or_unknown_files_are_refused(local_store):
    memory, facts, lineage = make_inputs("bo", 3)
    r = publish(local_store, "bo", keyed(memory), facts, lineage, embeddings=False)
    loc = Location(local_store, "bo", FP)
    path = data_path(loc, r.manifest, "kv.arrow")
    data = bytearray(open(path, "rb").read())
    data[-100] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(ChecksumError):
        read_kv_rows(local_store, "bo", FP, r.version)

    from storage_schemas.manifest import Manifest

    m = r.manifest
    forged = Manifest(**{**m.__dict__, "kv": {**m.kv, "dtype": "float4_e2m1"}})
    local_store.filesystem().pipe_file(loc.file(r.version, "manifest.json"), forged.to_json())
    with pytest.raises(ArtifactSchemaError, match="upgrade InferScale"):
        read_kv_rows(local_store, "bo", FP, r.version)


def test_facts_read_with_the_manifest_read_before(store):
    """The same table, the manifest not read again; another version's manifest refused."""
    memory, facts, lineage = make_inputs("erin", 3)
    v1 = publish(store, "erin", memory, facts, lineage, embeddings=False).version
    memory, facts2, lineage = make_inputs("erin", 4, seed=1)
    v2 = publish(store, "erin", memory, facts2, lineage, embeddings=False).version
    m1 = read_manifest(store, "erin", FP, v1)
    assert read_facts(store, "erin", FP, v1, manifest=m1).equals(read_facts(store, "erin", FP, v1))
    assert read_facts(store, "erin", FP, v1, manifest=m1).equals(facts)
    with pytest.raises(ValueError, match="not user 'erin'"):
        read_facts(store, "erin", FP, v2, manifest=m1)
    with pytest.raises(ValueError, match="the manifest given"):
        read_facts(store, "erin", "fp-other", v1, manifest=m1)
