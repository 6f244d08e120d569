import json

import pytest

from storage_schemas.common import SchemaVersionError
from storage_schemas.manifest import (
    VERSION, FileEntry, Manifest, ManifestChecksumError, ManifestError,
)


def manifest(**kw):
    args = dict(
        user="alice", model_fingerprint="fp", version="0" * 32,
        encoder_config={"window": 2, "dtype": "bfloat16", "scale": 0.5},
        parents={"log": "l", "facts": "f"},
        files={"kv.arrow": FileEntry(10, "ab" * 16), "facts.arrow": FileEntry(5, "cd" * 16)},
        counts={"facts": 1, "chunks": 2, "tokens": 3},
        kv={"dtype": "bfloat16", "layers": 1, "kv_heads": 1, "head_dim": 2, "slab_offset": 8,
            "slab_bytes": 24, "layout": "token-major [T, 2, L, H, D]"},
        created="2026-01-01T00:00:00.000000+00:00", producer="test",
    )
    args.update(kw)
    return Manifest(**args)


def test_round_trip():
    m = manifest()
    data = m.to_json()
    assert Manifest.from_json(data) == m
    body = json.loads(data)
    assert body["schema"] == "manifest" and body["schema_version"] == VERSION
    assert body["files"]["kv.arrow"] == {"bytes": 10, "xxh3_128": "ab" * 16}


def test_tampering_is_detected():
    body = json.loads(manifest().to_json())
    body["files"]["kv.arrow"]["bytes"] = 11
    with pytest.raises(ManifestChecksumError):
        Manifest.from_json(json.dumps(body))


def test_newer_version_and_foreign_documents():
    body = json.loads(manifest().to_json())
    with pytest.raises(SchemaVersionError, match="newer"):
        Manifest.from_json(json.dumps({**body, "schema_version": VERSION + 1}))
    with pytest.raises(SchemaVersionError, match="expected a 'manifest'"):
        Manifest.from_json(json.dumps({**body, "schema": "turns"}))
    with pytest.raises(SchemaVersionError, match="invalid"):
        Manifest.from_json(json.dumps({**body, "schema_version": "1"}))


def test_malformed():
    with pytest.raises(ManifestError, match="JSON"):
        Manifest.from_json(b"{not json")
    with pytest.raises(ManifestError, match="object"):
        Manifest.from_json(b"[1]")
    body = json.loads(manifest().to_json())
    del body["files"]
    body.pop("checksum")
    from storage_schemas.manifest import _checksum

    body["checksum"] = _checksum(body)
    with pytest.raises(ManifestError, match="missing"):
        Manifest.from_json(json.dumps(body))


def resigned(body: dict) -> str:
    """``body`` with its checksum recomputed: what an attacker who can write the store
    (but not change the reader) produces."""
    from storage_schemas.manifest import _checksum

    body = {k: v for k, v in body.items() if k != "checksum"}
    return json.dumps({**body, "checksum": _checksum(body)})


@pytest.mark.parametrize("key", ["../../etc/hostname", "/etc/hostname", "kv.arrow/../x",
                                 "manifest.json", "LATEST", "", "facts.arrow\x00",
                                 "KV.ARROW", "other.arrow"])
def test_every_files_key_is_a_known_file_name(key):
    """The ``files`` keys are the logical names of a version's data files and nothing
    else: a re-signed manifest with any other key (a path out of the version folder
    above all) is refused as malformed, whatever its schema version."""
    for schema_version in (1, VERSION):
        body = json.loads(manifest(schema_version=schema_version).to_json())
        body["files"][key] = {"bytes": 3, "xxh3_128": "ef" * 16}
        with pytest.raises(ManifestError, match="files"):
            Manifest.from_json(resigned(body))
    body = json.loads(manifest().to_json())  # a known key taken away
    del body["files"]["kv.arrow"]
    with pytest.raises(ManifestError, match="kv.arrow"):
        Manifest.from_json(resigned(body))
