import pyarrow as pa
import pytest

from storage_schemas import kv
from storage_schemas.common import NAME_KEY, VERSION_KEY, SchemaVersionError


def layout(**kw):
    args = dict(dtype="bfloat16", layers=2, kv_heads=3, head_dim=4, tokens=10, model_fingerprint="fp")
    args.update(kw)
    return kv.KVLayout(**args)


def test_schema_round_trip():
    lay = layout()
    assert kv.KVLayout.from_schema(lay.schema()) == lay
    assert lay.row_elems == 2 * 2 * 3 * 4
    assert lay.slab_bytes == 10 * 48 * 2
    assert lay.shape == (10, 2, 2, 3, 4)
    assert lay.schema().field("kv").type.value_type == pa.uint16()
    assert layout(dtype="float32").schema().field("kv").type.value_type == pa.float32()
    assert layout(dtype="float16").schema().field("kv").type.value_type == pa.uint16()


def test_older_versions_still_read():
    """1 had no content_key, 2 no digest; both still parse (and are read whole)."""
    lay = layout()
    assert kv.VERSION == 3 and lay.schema().field("content_key").nullable
    assert lay.schema().field("digest").type == pa.uint64()
    v1, v2 = lay.schema(1), lay.schema(2)
    assert "content_key" not in v1.names and v1.metadata[VERSION_KEY] == b"1"
    assert "digest" not in v2.names and "content_key" in v2.names
    assert kv.KVLayout.from_schema(v1) == lay == kv.KVLayout.from_schema(v2)
    # a version label on another version's columns is a format error
    with pytest.raises(kv.KVFormatError, match="columns"):
        kv.KVLayout.from_schema(lay.schema().with_metadata({**lay.schema().metadata,
                                                            VERSION_KEY: b"2"}))
    with pytest.raises(kv.KVFormatError, match="no kv schema version"):
        lay.schema(4)


def test_index_digest_covers_every_index_column():
    base = (["prefix", "f1"], [0, 3], [3, 2], [[1, 2, 3], [4, 5]], [7, 9])
    d = kv.index_digest(*base)
    for i in range(5):
        changed = [list(c) for c in base]
        changed[i][1] = [9, 9] if i == 3 else ("f2" if i == 0 else 1 + changed[i][1])
        assert kv.index_digest(*changed) != d, i


def _with_meta(schema, **changes):
    meta = dict(schema.metadata)
    for k, v in changes.items():
        if v is None:
            meta.pop(k.encode(), None)
        else:
            meta[k.encode()] = v.encode()
    return schema.with_metadata(meta)


def test_newer_or_foreign_schema_is_a_schema_version_error():
    s = layout().schema()
    with pytest.raises(SchemaVersionError, match="newer"):
        kv.KVLayout.from_schema(s.with_metadata({**s.metadata, VERSION_KEY: b"4"}))
    with pytest.raises(SchemaVersionError, match="expected a 'kv' table"):
        kv.KVLayout.from_schema(s.with_metadata({**s.metadata, NAME_KEY: b"facts"}))


@pytest.mark.parametrize("changes, match", [
    ({"inferscale.kv.layout": "layer-major"}, "layout"),
    ({"inferscale.kv.dtype": "int8"}, "dtype"),
    ({"inferscale.kv.layers": "x"}, "metadata"),
    ({"inferscale.kv.head_dim": None}, "metadata"),
    ({"inferscale.kv.layers": "0"}, "layers"),
    ({"inferscale.model_fingerprint": None}, "metadata"),
])
def test_bad_metadata_is_a_format_error(changes, match):
    with pytest.raises(kv.KVFormatError, match=match):
        kv.KVLayout.from_schema(_with_meta(layout().schema(), **changes))


def test_dtype_must_match_storage_column():
    s = layout(dtype="float32").schema()
    wrong = s.with_metadata({**s.metadata, b"inferscale.kv.dtype": b"bfloat16"})
    with pytest.raises(kv.KVFormatError, match="columns"):
        kv.KVLayout.from_schema(wrong)


def test_check_index():
    kv.check_index(["prefix", "a", "b"], [0, 3, 3], [3, 0, 5], [3, 0, 5], 8)
    with pytest.raises(kv.KVFormatError, match="chunk 0"):
        kv.check_index(["a", "prefix"], [0, 3], [3, 2], [3, 2], 5)
    with pytest.raises(kv.KVFormatError, match="duplicate"):
        kv.check_index(["prefix", "a", "a"], [0, 1, 2], [1, 1, 1], [1, 1, 1], 3)
    with pytest.raises(kv.KVFormatError, match="contiguity"):
        kv.check_index(["prefix", "a"], [0, 4], [3, 2], [3, 2], 6)
    with pytest.raises(kv.KVFormatError, match="token ids"):
        kv.check_index(["prefix", "a"], [0, 3], [3, 2], [3, 1], 5)
    with pytest.raises(kv.KVFormatError, match="cover"):
        kv.check_index(["prefix", "a"], [0, 3], [3, 2], [3, 2], 9)
