import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

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
    assert kv.VERSION == 4 and lay.schema().field("content_key").nullable
    assert lay.schema().metadata[VERSION_KEY] == b"3"  # unquantized files stay version 3
    assert lay.schema().field("digest").type == pa.uint64()
    v1, v2 = lay.schema(1), lay.schema(2)
    assert "content_key" not in v1.names and v1.metadata[VERSION_KEY] == b"1"
    assert "digest" not in v2.names and "content_key" in v2.names
    assert kv.KVLayout.from_schema(v1) == lay == kv.KVLayout.from_schema(v2)
    # a version label on another version's columns is a format error
    with pytest.raises(kv.KVFormatError, match="columns"):
        kv.KVLayout.from_schema(lay.schema().with_metadata({**lay.schema().metadata,
                                                            VERSION_KEY: b"2"}))
    with pytest.raises(kv.KVFormatError, match="not stored in kv schema version 4"):
        lay.schema(4)
    with pytest.raises(kv.KVFormatError, match="no kv schema version"):
        lay.schema(5)


def test_fp8_layout_carries_scales_in_version_4():
    lay = layout(dtype="float8_e4m3fn")
    s = lay.schema()
    assert lay.quantized and lay.scale_elems == 2 * 2 * 3 and lay.slab_bytes == 10 * 48
    assert s.metadata[VERSION_KEY] == b"4" and kv.written_version("float8_e4m3fn") == 4
    assert s.field("kv").type.value_type == pa.uint8()
    assert s.field("scales").type == pa.list_(pa.float32(), 12)
    assert s.names.index("scales") < s.names.index("kv")  # an index column, before the slab
    assert s.metadata[b"inferscale.kv.scales"] == kv.SCALES["float8_e4m3fn"].encode()
    assert kv.KVLayout.from_schema(s) == lay
    assert kv.index_columns(lay)[-1] == "scales" and "scales" not in kv.index_columns(layout())
    with pytest.raises(kv.KVFormatError, match="not stored in kv schema version 3"):
        lay.schema(3)


@pytest.mark.parametrize("rule", [None, "float16 per token"])
def test_an_unknown_scale_rule_is_refused(rule):
    s = _with_meta(layout(dtype="float8_e4m3fn").schema(), **{"inferscale.kv.scales": rule})
    with pytest.raises(kv.UnknownKVFormat, match="upgrade InferScale"):
        kv.KVLayout.from_schema(s)
    with pytest.raises(kv.UnknownKVFormat, match="scale rule"):
        kv.check_format({"dtype": "float8_e4m3fn", "scales": rule})


def test_check_format_of_a_manifest_record():
    kv.check_format({"dtype": "bfloat16"})
    kv.check_format({"dtype": "float8_e4m3fn", "scales": kv.SCALES["float8_e4m3fn"]})
    with pytest.raises(kv.UnknownKVFormat, match="'float4'.*upgrade"):
        kv.check_format({"dtype": "float4"})
    with pytest.raises(kv.UnknownKVFormat, match="scale rule"):
        kv.check_format({"dtype": "bfloat16", "scales": "per token"})


def test_index_digest_covers_every_index_column():
    base = (["prefix", "f1"], [0, 3], [3, 2], [[1, 2, 3], [4, 5]], [7, 9])
    d = kv.index_digest(*base)
    for i in range(5):
        changed = [list(c) for c in base]
        changed[i][1] = [9, 9] if i == 3 else ("f2" if i == 0 else 1 + changed[i][1])
        assert kv.index_digest(*changed) != d, i
    scales = [[0.5, 0.25], [1.0, 2.0]]
    with_scales = kv.index_digest(*base, scales)
    assert with_scales != d
    assert kv.index_digest(*base, [[0.5, 0.25], [1.0, 2.5]]) != with_scales


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
        kv.KVLayout.from_schema(s.with_metadata({**s.metadata, VERSION_KEY: b"5"}))
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


# any float32 (subnormals, huge values, both zeros, NaN, infinities), ordinary positive
# scales, and the edges of the accepted range
SCALE = st.one_of(st.none(), st.floats(width=32), st.floats(2.0 ** -100, 2.0 ** 100, width=32),
                  st.sampled_from([kv.FLOAT32_TINY, float(np.nextafter(np.float32(kv.FLOAT32_TINY),
                                                                         np.float32(0))),
                                   float(np.float32(kv.max_scale(kv.FLOAT32_MAX))), 1e-45,
                                   7.6e35, 1e38]))


def _refused(x, dtype_max=kv.FLOAT32_MAX) -> bool:
    """The rule, stated on its own: a scale is read only when it is a finite normal
    float32 whose dequantized values, and keys rotated from them, are finite in the
    dtype: 448 * sqrt(2) * scale <= its max (computed exactly, in Python floats)."""
    if x is None:
        return True
    x = float(np.float32(x))  # as stored
    return not math.isfinite(x) or x < 2.0 ** -126 or x * 448.0 * math.sqrt(2.0) > dtype_max


@given(st.lists(st.lists(SCALE, max_size=6), max_size=5))
def test_scales_are_refused_unless_finite_normal_and_small_enough(rows):
    """Any values (NaN, infinities, zeros of either sign, negatives, subnormals, values
    whose dequantized K/V overflow float32, nulls) in a nested scales column: refused
    exactly when one of them breaks the rule."""
    bad = any(_refused(x) for r in rows for x in r)
    column = pa.array(rows, pa.list_(pa.float32()))
    if bad:
        with pytest.raises(kv.KVFormatError, match="finite and positive"):
            kv.check_scales(column)
    else:
        kv.check_scales(column)
        kv.check_scales(pa.chunked_array([column]))


@given(st.lists(SCALE, min_size=1, max_size=8))
def test_scales_for_a_float16_engine(values):
    """The worker's bound for its engine's dtype: 147 (448 * 147 > 65504) and anything
    whose rotated keys could exceed float16's max is refused; the schema's own bounds
    still hold below it."""
    column = pa.array(values, pa.float32())
    if any(_refused(x, 65504.0) for x in values):
        with pytest.raises(kv.KVFormatError, match="finite and positive"):
            kv.check_scales(column, 65504.0, "float16")
    else:
        kv.check_scales(column, 65504.0, "float16")


def test_the_scales_the_audit_found():
    """1e38 and 7.6e35 (non-finite K/V in float32), 1e-45 (a subnormal: the chunk read as
    zeros) are refused everywhere; 147 only where the engine computes in float16."""
    for bad in (1e38, 7.6e35, 1e-45, 1e-39):
        with pytest.raises(kv.KVFormatError):
            kv.check_scales(pa.array([1.0, bad], pa.float32()))
    kv.check_scales(pa.array([147.0, 2.0 ** -126], pa.float32()))
    with pytest.raises(kv.KVFormatError, match="float16"):
        kv.check_scales(pa.array([147.0], pa.float32()), 65504.0, "float16")
    kv.check_scales(pa.array([100.0], pa.float32()), 65504.0, "float16")


def _struct_digest(ids, offsets, lengths, tokens, digests, scales=None) -> str:
    """The digest's definition in its first form (``struct`` over Python values): what
    manifests written before the numpy form hold."""
    import struct

    import xxhash

    h = xxhash.xxh3_128()
    for i, cid in enumerate(ids):
        h.update(cid.encode() + b"\0")
        h.update(struct.pack("<qqQq", offsets[i], lengths[i], digests[i], len(tokens[i])))
        h.update(struct.pack(f"<{len(tokens[i])}i", *tokens[i]))
        if scales is not None:
            h.update(struct.pack(f"<{len(scales[i])}f", *scales[i]))
    return h.hexdigest()


@given(st.lists(st.tuples(st.lists(st.integers(-2**31, 2**31 - 1), max_size=6),
                          st.integers(0, 2**64 - 1),
                          st.lists(st.floats(2.0 ** -100, 2.0 ** 100, width=32), min_size=2, max_size=2)),
                min_size=1, max_size=5), st.booleans())
def test_index_digest_is_the_same_from_lists_and_arrays(rows, scaled):
    """A reader hashes the index from numpy arrays, the writer from lists: both give the
    digest's first (struct) form, so manifests written before still verify."""
    ids = [f"c{i}" for i in range(len(rows))]
    tokens = [r[0] for r in rows]
    lengths = [len(t) for t in tokens]
    offsets = [sum(lengths[:i]) for i in range(len(rows))]
    digests = [r[1] for r in rows]
    scales = [r[2] for r in rows] if scaled else None
    want = _struct_digest(ids, offsets, lengths, tokens, digests, scales)
    assert kv.index_digest(ids, offsets, lengths, tokens, digests, scales) == want
    arrays = kv.index_digest(ids, offsets, lengths, [np.asarray(t, np.int32) for t in tokens],
                             digests, np.asarray(scales, np.float32) if scaled else None)
    assert arrays == want
