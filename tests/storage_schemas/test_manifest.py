import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# ---------------------------------------------------------------- field types (hostile)

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
STRING_FIELDS = ("user", "model_fingerprint", "version", "created", "producer")
OBJECT_FIELDS = ("encoder_config", "parents", "files", "counts", "kv")
KV_INTS = {"layers": 1, "kv_heads": 1, "head_dim": 1, "slab_offset": 0, "slab_bytes": 0}


def _type_ok(path: tuple[str, ...], value) -> bool:
    """Whether ``value`` may stand at ``path`` of a manifest (the rule, stated apart from
    the parser)."""
    top = path[0]
    if len(path) == 1:
        if top in STRING_FIELDS:
            return isinstance(value, str) and (bool(value) or top in ("created", "producer"))
        if not isinstance(value, dict):
            return False
        if top == "kv":
            return all(k in value and _type_ok(("kv", k), value[k])
                       for k in (*KV_INTS, "dtype")) and \
                all(_type_ok(("kv", k), v) for k, v in value.items())
        return all(_type_ok((top, k), v) for k, v in value.items())
    if top == "parents":
        return isinstance(value, str)
    if top == "counts":
        return type(value) is int and value >= 0
    if top == "kv":
        key = path[1]
        if key in KV_INTS:
            return type(value) is int and value >= KV_INTS[key]
        if key in ("dtype", "layout", "scales", "index_xxh3"):
            return isinstance(value, str)
        if key == "key_calibration":
            return isinstance(value, dict)
    return True  # encoder_config's members and other kv keys are not the parser's


FIELD_PATHS = st.sampled_from(
    [(f,) for f in STRING_FIELDS + ("encoder_config", "parents", "counts", "kv")]
    + [("parents", "log"), ("parents", "facts"), ("counts", "facts"), ("counts", "tokens")]
    + [("kv", k) for k in (*KV_INTS, "dtype", "layout", "scales", "index_xxh3",
                           "key_calibration")]
    + [("encoder_config", "window")])


@settings(max_examples=300, deadline=None)
@given(path=FIELD_PATHS, value=JSON)
def test_a_field_of_the_wrong_type_is_malformed(path, value):
    """Any JSON value put into any field of a valid (re-signed) manifest: parsed only
    when the value has the field's type, else ManifestError; a parsed manifest's fields
    have their types, so no reader meets an AttributeError or a TypeError later."""
    body = json.loads(manifest().to_json())
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    ok = _type_ok(path, value)
    try:
        m = Manifest.from_json(resigned(body))
    except ManifestError:
        assert not ok, (path, value)
        return
    assert ok, (path, value)
    for f in STRING_FIELDS:
        assert isinstance(getattr(m, f), str)
    for f in ("encoder_config", "parents", "counts", "kv"):
        assert isinstance(getattr(m, f), dict)
    assert all(isinstance(v, str) for v in m.parents.values())
    assert all(type(v) is int and v >= 0 for v in m.counts.values())
    assert all(type(m.kv[k]) is int and m.kv[k] >= low for k, low in KV_INTS.items())
    assert isinstance(m.kv["dtype"], str)


@pytest.mark.parametrize("change", [
    {"encoder_config": "window=2"}, {"parents": None}, {"parents": ["l", "f"]},
    {"parents": {"log": 5, "facts": "f"}}, {"created": 1767225600}, {"kv": [1, 2]},
    {"counts": {"facts": "1", "chunks": 2, "tokens": 3}}, {"counts": {"facts": True}},
    {"user": 7}, {"version": ""},
])
def test_the_audit_s_manifests_are_malformed(change):
    """The fields the audit found unchecked (a string config, null parents, a numeric
    creation time, a list for ``kv``) are refused when the manifest is parsed."""
    body = {**json.loads(manifest().to_json()), **change}
    with pytest.raises(ManifestError, match="must"):
        Manifest.from_json(resigned(body))


@pytest.mark.parametrize("key", ["layers", "kv_heads", "head_dim", "slab_offset", "dtype"])
def test_kv_needs_its_layout_fields(key):
    body = json.loads(manifest().to_json())
    del body["kv"][key]
    with pytest.raises(ManifestError, match=f"no '{key}'"):
        Manifest.from_json(resigned(body))


@pytest.mark.parametrize("data", [b"[" * 100_000 + b"]" * 100_000, b"1" * 5000,
                                  b"\xff\xfe{}", b'{"a": 1e999999}'])
def test_what_the_json_parser_itself_refuses_is_malformed(data):
    """Nesting deeper than the parser's stack, an integer of 5,000 digits, bytes that are
    not UTF-8: ManifestError like any malformed manifest, never RecursionError or a bare
    ValueError that stops a caller (planning) handling ManifestError."""
    with pytest.raises((ManifestError, SchemaVersionError)):
        Manifest.from_json(data)
