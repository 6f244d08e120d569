"""KV slab: one Arrow IPC file per artifact holding every chunk's pre-RoPE K,V.

Fixed layout (the vLLM connector relies on it): the slab's logical shape is
``[T_total, 2, L, H, D]``, token-major (for each token, K of all layers, then V of all
layers); chunk ``i`` occupies rows ``[offset_i, offset_i + length_i)``. Chunk 0 is always
the instruction prefix (``chunk_id == "prefix"``); the others are fact ids. Chunks are
stored in order and back to back: ``offset_0 == 0``, ``offset_{i+1} == offset_i +
length_i``, ``sum(length) == T_total``.

The file holds one record batch, one row per chunk:

- ``chunk_id`` string, ``offset`` int64 (rows), ``length`` int32 (rows): the offsets table;
- ``token_ids`` list<int32>: the chunk's token ids (``length`` of them);
- ``content_key`` string (nullable; since version 2): what the chunk's K/V is a function
  of — a hash of its token ids, the token ids of the context it was encoded after, the
  encoder config, the model fingerprint and the numerics of the computation
  (``inferscale.encode.content_keys``). A later version of the same user reuses the rows
  of a chunk whose key it needs instead of encoding it again. Null: never reused;
- ``digest`` uint64 (since version 3): xxh3-64 of the chunk's rows as stored, so a
  reader that fetches single chunks by byte range (a request's retrieved facts, without
  the rest of the slab) can verify each one; the manifest records :func:`index_digest`
  of these index columns, so the index itself is verified too;
- ``scales`` fixed_size_list<float32>[2 * L * H] (since version 4; quantized dtypes
  only): the chunk's dequantization scales ``[2, L, H]`` (K then V, per layer and KV
  head; :data:`SCALES` names the rule, ``inferscale.kv_quant`` implements it). They are
  index columns: :func:`index_digest` covers them, so a reader of single chunks gets
  verified scales with the index;
- ``kv`` large_list<storage>: the chunk's rows flattened. Its child values buffer is
  the whole slab, one contiguous buffer, so a memory-mapped or in-memory file yields
  the slab zero-copy. bf16 and fp16 are stored as uint16 bit patterns, fp32 as float32,
  float8_e4m3fn as uint8; the true dtype, the layout, L/H/D and the scale rule are in
  the schema metadata. Every other column's buffers precede it in the file: a reader
  projecting the index columns reads a few KB.

Versions: 1 had no ``content_key`` column, 2 no ``digest``, 3 no quantized dtypes;
readers accept 1 to 4 (a version-1 file has no keys, so nothing is reused from it; a
file before version 3 is only read whole). Writers write version 4 for quantized dtypes
and 3 otherwise (:func:`written_version`), so an unquantized file stays readable by
older readers, and an older reader meeting an fp8 file refuses it as a newer version.

Laid out and parsed by ``inferscale.artifacts.kv_file`` (written by
``inferscale.artifacts.publish.publish``); read whole by ``inferscale.hydrate.slab``
(serving) and ``inferscale.artifacts.read.read_kv_rows`` (reuse by the next version), by
byte ranges by ``inferscale.hydrate.fact_reader``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from storage_schemas.common import check_schema, schema_meta

NAME = "kv"
VERSION = 4
PREFIX = "prefix"
LAYOUT = "token-major [T, 2, L, H, D]"

# true dtype -> Arrow storage type of the slab's elements
STORAGE_TYPES = {"bfloat16": pa.uint16(), "float16": pa.uint16(), "float32": pa.float32(),
                 "float8_e4m3fn": pa.uint8()}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
# the scale rule of each quantized dtype (schema metadata ``inferscale.kv.scales`` and the
# manifest's ``kv.scales``); a reader refuses a rule it does not know
SCALES = {"float8_e4m3fn": "float32 per chunk, K/V, layer, KV head: amax / 448"}

_M = "inferscale.kv."
_FP = "inferscale.model_fingerprint"


class KVFormatError(ValueError):
    """A kv file whose schema version is known but whose content breaks the layout."""


class UnknownKVFormat(KVFormatError):
    """A KV dtype or scale rule this reader does not know (written by a newer InferScale)."""


def written_version(dtype: str) -> int:
    """The kv schema version a file of ``dtype`` is written in: 4 with scales, else 3."""
    return VERSION if dtype in SCALES else 3


def check_format(kv: dict) -> None:
    """A manifest's ``kv`` record names a dtype and scale rule this reader knows, or
    :class:`UnknownKVFormat` says which and that a newer InferScale wrote it."""
    dtype, scales = kv.get("dtype"), kv.get("scales")
    if dtype not in ITEMSIZE:
        raise UnknownKVFormat(f"KV dtype {dtype!r} is not one this InferScale reads "
                              f"({sorted(ITEMSIZE)}); upgrade InferScale to read it")
    if scales != SCALES.get(dtype):
        raise UnknownKVFormat(f"KV dtype {dtype!r} with scale rule {scales!r} is not a format "
                              f"this InferScale reads (it knows {SCALES.get(dtype)!r}); "
                              "upgrade InferScale to read it")


@dataclass(frozen=True)
class KVLayout:
    """Shape, dtype and owner of one artifact's slab; stored in the schema metadata."""

    dtype: str  # "bfloat16" | "float16" | "float32"
    layers: int  # L
    kv_heads: int  # H
    head_dim: int  # D
    tokens: int  # T_total
    model_fingerprint: str

    def __post_init__(self) -> None:
        if self.dtype not in STORAGE_TYPES:
            raise UnknownKVFormat(f"unsupported KV dtype {self.dtype!r}; one of "
                                  f"{sorted(STORAGE_TYPES)} (upgrade InferScale to read it)")
        for name in ("layers", "kv_heads", "head_dim"):
            if int(getattr(self, name)) < 1:
                raise KVFormatError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tokens < 0:
            raise KVFormatError(f"tokens must be >= 0, got {self.tokens}")
        if not self.model_fingerprint:
            raise KVFormatError("empty model fingerprint")

    @property
    def row_elems(self) -> int:
        """Elements per token row: 2 * L * H * D."""
        return 2 * self.layers * self.kv_heads * self.head_dim

    @property
    def storage_type(self) -> pa.DataType:
        return STORAGE_TYPES[self.dtype]

    @property
    def slab_bytes(self) -> int:
        return self.tokens * self.row_elems * ITEMSIZE[self.dtype]

    @property
    def quantized(self) -> bool:
        """Whether chunks carry scales (``scales`` column)."""
        return self.dtype in SCALES

    @property
    def scale_elems(self) -> int:
        """Scales per chunk: 2 * L * H (0 when unquantized)."""
        return 2 * self.layers * self.kv_heads if self.quantized else 0

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.tokens, 2, self.layers, self.kv_heads, self.head_dim)

    def schema(self, version: int | None = None) -> pa.Schema:
        """The kv file's schema as written by schema ``version`` (1 to 4; default: the
        version this layout is written in, :func:`written_version`)."""
        version = written_version(self.dtype) if version is None else version
        if version not in (1, 2, 3, 4):
            raise KVFormatError(f"no kv schema version {version}")
        if self.quantized != (version >= 4):
            raise KVFormatError(f"KV dtype {self.dtype!r} is not stored in kv schema "
                                f"version {version}")
        keyed = [pa.field("content_key", pa.string(), nullable=True)] if version >= 2 else []
        if version >= 3:
            keyed.append(pa.field("digest", pa.uint64(), nullable=False))
        if self.quantized:
            keyed.append(pa.field("scales", pa.list_(pa.float32(), self.scale_elems),
                                  nullable=False))
        return pa.schema(
            [
                pa.field("chunk_id", pa.string(), nullable=False),
                pa.field("offset", pa.int64(), nullable=False),
                pa.field("length", pa.int32(), nullable=False),
                pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
                *keyed,
                pa.field("kv", pa.large_list(pa.field("item", self.storage_type, nullable=False)),
                         nullable=False),
            ],
            metadata=schema_meta(NAME, version, {
                _M + "layout": LAYOUT,
                _M + "dtype": self.dtype,
                _M + "layers": str(self.layers),
                _M + "kv_heads": str(self.kv_heads),
                _M + "head_dim": str(self.head_dim),
                _M + "tokens": str(self.tokens),
                _FP: self.model_fingerprint,
                **({_M + "scales": SCALES[self.dtype]} if self.quantized else {}),
            }),
        )

    @classmethod
    def from_schema(cls, schema: pa.Schema) -> "KVLayout":
        """Parse and check a kv file's schema (any version up to :data:`VERSION`).

        Raises :class:`SchemaVersionError` for another table or a newer version and
        :class:`KVFormatError` for a known version whose metadata or columns are wrong.
        """
        version = check_schema(schema, NAME, VERSION)
        meta = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
        if meta.get(_M + "layout") != LAYOUT:
            raise KVFormatError(f"unknown KV layout {meta.get(_M + 'layout')!r}; expected {LAYOUT!r}")
        try:
            layout = cls(
                dtype=meta[_M + "dtype"],
                layers=int(meta[_M + "layers"]),
                kv_heads=int(meta[_M + "kv_heads"]),
                head_dim=int(meta[_M + "head_dim"]),
                tokens=int(meta[_M + "tokens"]),
                model_fingerprint=meta[_FP],
            )
        except (KeyError, ValueError) as exc:
            if isinstance(exc, KVFormatError):
                raise
            raise KVFormatError(f"kv schema metadata incomplete or unreadable: {exc!r}") from exc
        check_format({"dtype": layout.dtype, "scales": meta.get(_M + "scales")})
        expected = layout.schema(version)
        if schema.remove_metadata() != expected.remove_metadata():
            raise KVFormatError(f"kv columns {schema.remove_metadata()} differ from the layout's "
                                f"{expected.remove_metadata()}")
        return layout


# float8 e4m3fn's largest finite value: a stored code times its scale is at most this
# times the scale (``inferscale.kv_quant.FP8_MAX``)
FP8_MAX = 448.0
# How much larger than a dequantized value a rotated key can be: each rotated component
# mixes a pair of components, |x cos - y sin| <= sqrt(x^2 + y^2) <= sqrt(2) max(|x|, |y|)
ROTATION_GAIN = math.sqrt(2.0)
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32


def max_scale(dtype_max: float) -> float:
    """The largest fp8 scale whose dequantized values, and the keys rotated from them,
    stay finite in a dtype whose largest finite value is ``dtype_max``:
    ``448 * sqrt(2) * scale <= dtype_max`` (float16: 103.4; float32: 5.4e35)."""
    return dtype_max / (FP8_MAX * ROTATION_GAIN)


def check_scales(scales: pa.Array | pa.ChunkedArray, dtype_max: float = FLOAT32_MAX,
                 dtype_name: str = "float32") -> None:
    """:class:`KVFormatError` unless every value of a ``scales`` column (lists of float32,
    or their values) is finite, at least the smallest normal float32 and at most
    :func:`max_scale` of ``dtype_max`` (default float32's: what every reader checks;
    the serving worker checks again with its engine's dtype). A zero, negative, NaN or
    infinite scale would turn its chunk's K/V into zeros, flipped signs or NaN without a
    word; a subnormal one flushes the chunk to zero (1e-45); a huge one makes
    dequantized values, or the keys rotated from them, infinite (1e38; 147 in a float16
    cache). Checked wherever scales are written or read."""
    while pa.types.is_list(scales.type) or pa.types.is_fixed_size_list(scales.type):
        scales = pc.list_flatten(scales)
    if not len(scales):
        return
    top = max_scale(dtype_max)
    if scales.null_count or not pc.all(pc.is_finite(scales)).as_py():
        raise KVFormatError("fp8 scales must be finite and positive; found a null, NaN or "
                            "infinite one")
    low, high = pc.min(scales).as_py(), pc.max(scales).as_py()
    if low < FLOAT32_TINY or high > top:
        bad = low if low < FLOAT32_TINY else high
        raise KVFormatError(f"fp8 scales must be finite and positive, from {FLOAT32_TINY:.4g} "
                            f"(the smallest normal float32) to {top:.4g} (448 * sqrt(2) * "
                            f"scale finite in {dtype_name}); found {bad:.4g}")


def check_index(chunk_ids: list[str], offsets: list[int], lengths: list[int],
                token_counts: list[int], tokens: int) -> None:
    """Check the offsets table: prefix first, unique ids, contiguous, covering ``tokens``."""
    if not chunk_ids or chunk_ids[0] != PREFIX:
        raise KVFormatError(f"chunk 0 must be {PREFIX!r}, got {chunk_ids[:1]}")
    if len(set(chunk_ids)) != len(chunk_ids):
        raise KVFormatError("duplicate chunk ids in the offsets table")
    pos = 0
    for cid, off, n, ntok in zip(chunk_ids, offsets, lengths, token_counts, strict=True):
        if off != pos or n < 0:
            raise KVFormatError(f"chunk {cid!r} at rows [{off}, {off + n}) breaks contiguity "
                                f"(expected offset {pos})")
        if ntok != n:
            raise KVFormatError(f"chunk {cid!r} has {ntok} token ids for {n} rows")
        pos += n
    if pos != tokens:
        raise KVFormatError(f"chunks cover {pos} rows, the slab has {tokens}")


INDEX_COLUMNS = ("chunk_id", "offset", "length", "token_ids", "digest")


def index_columns(layout: KVLayout) -> tuple[str, ...]:
    """The index columns of a file of ``layout`` (with ``scales`` when quantized)."""
    return INDEX_COLUMNS + (("scales",) if layout.quantized else ())


def chunk_digest(rows: memoryview | bytes) -> int:
    """xxh3-64 of one chunk's rows as stored (the ``digest`` column)."""
    return xxhash.xxh3_64_intdigest(rows)


def index_digest(chunk_ids: list[str], offsets: list[int], lengths: list[int],
                 token_ids: list, digests: list[int], scales: list | None = None) -> str:
    """xxh3-128 over the index columns in order (what a manifest records as
    ``kv.index_xxh3``; with each chunk's ``scales`` as float32 when quantized): a reader
    of single chunks checks the index it read with it. A chunk's token ids and scales may
    be lists or numpy arrays (the same bytes: little-endian int32, float32)."""
    h = xxhash.xxh3_128()
    rows = zip(chunk_ids, offsets, lengths, token_ids, digests,
               scales if scales is not None else [None] * len(chunk_ids), strict=True)
    for cid, off, n, toks, d, sc in rows:
        h.update(cid.encode() + b"\0")
        h.update(struct.pack("<qqQq", off, n, d, len(toks)))
        h.update(np.asarray(toks, dtype="<i4").tobytes())
        if sc is not None:
            h.update(np.asarray(sc, dtype="<f4").tobytes())
    return h.hexdigest()
