"""The kv.arrow file (:mod:`storage_schemas.kv`): laid out from the encoder's output, and
parsed in place once its bytes are verified.

:func:`build_kv_batch` checks the encoder's chunks (prefix first, unique ids, one dtype,
token-major rows ``[T, 2, L, H, D]`` of one geometry, as many token ids as rows) and lays
them out as :mod:`storage_schemas.kv` describes: the chunks' rows back to back are the
slab (:attr:`~inferscale.types.KVFormat.TOKEN_MAJOR`, what the encoder emits), so laying
out is one concatenation. The encoder (``inferscale.encode.encoder``) is duck-typed
through :class:`EncodedMemoryLike`; nothing here imports it.

:func:`parse_kv_file` reads a whole file's bytes (checksum-verified by the caller)
without copying the slab: the layout, the chunk index, token ids, content keys, fp8
scales and where the slab lies, each checked against the file's own index and the
version's manifest (:class:`KVFile`). Whole-slab readers use it: serving's hydration
(:mod:`inferscale.hydrate.slab`) and the reuse of a previous version's rows
(:func:`inferscale.artifacts.read.read_kv_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

import numpy as np
import pyarrow as pa
import torch

from inferscale.artifacts.layout import (
    ArtifactSchemaError, CorruptArtifact, FingerprintMismatch, InvalidArtifactInput,
)
from inferscale.types import KV_DTYPES, PREFIX_ID, ChunkKV, dtype_name, torch_dtype
from storage_schemas import kv as kv_schema
from storage_schemas.common import SchemaVersionError
from storage_schemas.manifest import Manifest


class EncodedChunkLike(Protocol):
    chunk_id: str  # fact_id, or "prefix" (always first)
    token_ids: Sequence[int]
    kv: torch.Tensor  # [T, 2, L, H, D] (KVFormat.TOKEN_MAJOR): pre-RoPE K, then V; CPU
    # optional: ``content_key`` (str | None), what the K/V is a function of (stored; a
    # chunk without one is never reused by a later version); ``scales`` ([2, L, H]
    # float32), required for quantized dtypes (``inferscale.kv_quant``)


class EncodedMemoryLike(Protocol):
    """What the encoder returns (``inferscale.encode.encoder.EncodedMemory``); duck-typed."""

    chunks: Sequence[EncodedChunkLike]
    model_fingerprint: str
    encoder_config: Mapping[str, Any]
    # optional: ``geometry`` ((layers, kv_heads, head_dim) of the model that computed the
    # chunks, ``inferscale.types.KVGeometry``), checked by publishing


def build_kv_batch(encoded: EncodedMemoryLike, model_fp: str
                   ) -> tuple[kv_schema.KVLayout, pa.RecordBatch, pa.Buffer]:
    """Encoder chunks -> (layout, one record batch, the slab buffer inside it).

    The batch's ``kv`` child values buffer is the ``[T, 2, L, H, D]`` slab (one copy of
    the encoder's rows, back to back); the buffer is returned so the writer can find the
    slab's byte offset in the file. Raises :class:`InvalidArtifactInput`.
    """
    chunks = list(encoded.chunks)
    if not chunks or chunks[0].chunk_id != PREFIX_ID:
        raise InvalidArtifactInput(f"the first chunk must be {PREFIX_ID!r}")
    kv0 = chunks[0].kv
    if not isinstance(kv0, torch.Tensor) or kv0.dim() != 5 or kv0.shape[1] != 2:
        raise InvalidArtifactInput("chunk rows must be 5-D tensors [T, 2, L, H, D]")
    dtype = dtype_name(kv0.dtype)
    if dtype is None:
        raise InvalidArtifactInput(f"KV dtype {kv0.dtype} not supported; one of {list(KV_DTYPES)}")
    _, _, n_layers, n_heads, head_dim = kv0.shape
    quantized = dtype in kv_schema.SCALES
    ids, lengths, content_keys, scales = [], [], [], []
    for c in chunks:
        kv = c.kv
        if not isinstance(kv, torch.Tensor):
            raise InvalidArtifactInput(f"chunk {c.chunk_id!r}: its rows must be a tensor")
        if kv.dim() != 5 or tuple(kv.shape[1:]) != (2, n_layers, n_heads, head_dim):
            raise InvalidArtifactInput(
                f"chunk {c.chunk_id!r}: rows {tuple(kv.shape)} do not match "
                f"[T, 2, L={n_layers}, H={n_heads}, D={head_dim}]")
        if kv.dtype != kv0.dtype:
            raise InvalidArtifactInput(f"chunk {c.chunk_id!r}: dtype differs from the prefix's")
        if len(c.token_ids) != kv.shape[0]:
            raise InvalidArtifactInput(f"chunk {c.chunk_id!r}: {len(c.token_ids)} token ids for "
                                       f"{kv.shape[0]} KV rows")
        if not isinstance(c.chunk_id, str) or not c.chunk_id:
            raise InvalidArtifactInput(f"chunk id must be a non-empty string, got {c.chunk_id!r}")
        key = getattr(c, "content_key", None)
        if key is not None and (not isinstance(key, str) or not key):
            raise InvalidArtifactInput(f"chunk {c.chunk_id!r}: content key must be a non-empty "
                                       f"string or None, got {key!r}")
        sc = getattr(c, "scales", None)
        if quantized:
            if not isinstance(sc, torch.Tensor) or tuple(sc.shape) != (2, n_layers, n_heads) \
                    or sc.dtype != torch.float32:
                raise InvalidArtifactInput(f"chunk {c.chunk_id!r}: {dtype} K/V need positive "
                                           f"float32 scales [2, {n_layers}, {n_heads}]")
            scales.append(sc.reshape(-1).tolist())
            try:
                kv_schema.check_scales(pa.array(scales[-1], pa.float32()))
            except kv_schema.KVFormatError as exc:
                raise InvalidArtifactInput(f"chunk {c.chunk_id!r}: {exc}") from exc
        elif sc is not None:
            raise InvalidArtifactInput(f"chunk {c.chunk_id!r}: scales given for {dtype} K/V")
        ids.append(c.chunk_id)
        lengths.append(int(kv.shape[0]))
        content_keys.append(key)
    if len(set(ids)) != len(ids):
        raise InvalidArtifactInput("duplicate chunk ids")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    try:
        layout = kv_schema.KVLayout(dtype, int(n_layers), int(n_heads),
                                    int(head_dim), int(offsets[-1]), model_fp)
    except kv_schema.KVFormatError as exc:
        raise InvalidArtifactInput(str(exc)) from exc

    slab = torch.cat([c.kv for c in chunks])  # [T, 2, L, H, D]
    flat = slab.reshape(-1)
    if layout.dtype == "float32":
        flat_np = flat.numpy()
    elif quantized:
        flat_np = flat.view(torch.uint8).numpy()
    else:
        flat_np = flat.view(torch.int16).numpy().view(np.uint16)
    slab_buffer = pa.py_buffer(flat_np)
    values = pa.Array.from_buffers(layout.storage_type, flat_np.size, [None, slab_buffer])
    schema = layout.schema()
    kv_arr = pa.LargeListArray.from_arrays(
        pa.array(offsets * layout.row_elems, type=pa.int64()), values, type=schema.field("kv").type)
    try:
        token_ids = pa.array([list(map(int, c.token_ids)) for c in chunks], type=pa.list_(pa.int32()))
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        raise InvalidArtifactInput(f"token ids must be int32 integers: {exc}") from exc
    row_bytes = layout.row_elems * kv_schema.ITEMSIZE[layout.dtype]
    raw = memoryview(flat_np).cast("B")
    digests = [kv_schema.chunk_digest(raw[o * row_bytes:(o + n) * row_bytes])
               for o, n in zip(offsets[:-1], lengths)]
    scale_col = [pa.array(scales, type=schema.field("scales").type)] if quantized else []
    batch = pa.record_batch([
        pa.array(ids, type=pa.string()),
        pa.array(offsets[:-1], type=pa.int64()),
        pa.array(lengths, type=pa.int32()),
        token_ids,
        pa.array(content_keys, type=pa.string()),
        pa.array(digests, type=pa.uint64()),
        *scale_col,
        kv_arr,
    ], schema=schema)
    return layout, batch, slab_buffer


@dataclass(frozen=True)
class KVFile:
    """A verified kv.arrow, parsed in place (:func:`parse_kv_file`)."""

    layout: kv_schema.KVLayout
    index: dict[str, tuple[int, int]]  # chunk id -> (first row, rows), in file order
    token_ids: dict[str, tuple[int, ...]]
    content_keys: dict[str, str]  # chunk id -> content key (chunks stored with one)
    slab_offset: int  # byte offset of the slab (row 0) in the file
    scales: torch.Tensor | None  # fp8: [C, 2, L, H] float32, one row per chunk in order

    def slab(self, data: torch.Tensor) -> torch.Tensor:
        """The slab ``[T, 2, L, H, D]`` in the stored dtype: a view of ``data``, the file's
        bytes (uint8, on any device)."""
        layout = self.layout
        if not layout.slab_bytes:
            return torch.empty(layout.shape, dtype=torch_dtype(layout.dtype),
                               device=data.device)
        return data[self.slab_offset:self.slab_offset + layout.slab_bytes].view(
            torch_dtype(layout.dtype)).view(layout.shape)

    def rows_by_content_key(self, slab: torch.Tensor) -> dict[str, ChunkKV]:
        """``content key -> ChunkKV`` (a view of ``slab``'s rows, and its scales for fp8)
        for every chunk stored with a key: what a later version reuses."""
        pos = {cid: i for i, cid in enumerate(self.index)}
        return {key: ChunkKV(slab[self.index[cid][0]:sum(self.index[cid])],
                             self.scales[pos[cid]] if self.scales is not None else None)
                for cid, key in self.content_keys.items()}


def parse_kv_file(buf: np.ndarray, path: str, manifest: Manifest, expected_fp: str) -> KVFile:
    """A kv file's verified bytes ``buf`` (uint8) -> :class:`KVFile`, the slab left in
    place. ``ArtifactSchemaError`` for a format this reader does not know,
    ``FingerprintMismatch`` for KV of another model than ``expected_fp``,
    ``CorruptArtifact`` for anything else that disagrees with the file's index or with
    ``manifest`` (layout, token count, the slab's offset)."""
    base = pa.py_buffer(buf)
    try:
        reader = pa.ipc.open_file(base)
        layout = kv_schema.KVLayout.from_schema(reader.schema)
        if reader.num_record_batches != 1:
            raise kv_schema.KVFormatError(f"{reader.num_record_batches} record batches, expected 1")
        batch = reader.get_batch(0)
        ids = batch.column("chunk_id").to_pylist()
        offsets = batch.column("offset").to_pylist()
        lengths = batch.column("length").to_pylist()
        tokens = batch.column("token_ids").to_pylist()
        keys = (batch.column("content_key").to_pylist()
                if "content_key" in batch.schema.names else [None] * len(ids))
        kv_schema.check_index(ids, offsets, lengths, [len(t) for t in tokens], layout.tokens)
        scales = None
        if layout.quantized:
            kv_schema.check_scales(batch.column("scales"))
            flat = batch.column("scales").flatten().to_numpy(zero_copy_only=False)
            scales = torch.from_numpy(flat.copy()).view(
                len(ids), 2, layout.layers, layout.kv_heads)
        kv = batch.column("kv")
        want = (np.asarray(offsets + [layout.tokens], dtype=np.int64) * layout.row_elems)
        if not np.array_equal(kv.offsets.to_numpy(), want):
            raise kv_schema.KVFormatError("kv list offsets disagree with the offsets table")
    except (SchemaVersionError, kv_schema.UnknownKVFormat) as exc:
        raise ArtifactSchemaError(f"{path}: {exc}") from exc
    except kv_schema.KVFormatError as exc:
        raise CorruptArtifact(f"{path}: {exc}") from exc
    except (pa.ArrowException, KeyError) as exc:
        raise CorruptArtifact(f"{path}: not a readable kv file: {exc}") from exc
    if layout.model_fingerprint != expected_fp:
        raise FingerprintMismatch(f"{path} holds KV of model {layout.model_fingerprint}, "
                                  f"expected {expected_fp}")
    described = {k: manifest.kv.get(k) for k in ("dtype", "layers", "kv_heads", "head_dim",
                                                  "scales")}
    actual = {"dtype": layout.dtype, "layers": layout.layers, "kv_heads": layout.kv_heads,
              "head_dim": layout.head_dim, "scales": kv_schema.SCALES.get(layout.dtype)}
    if described != actual or manifest.counts.get("tokens") != layout.tokens:
        raise CorruptArtifact(f"{path}: layout {actual}, {layout.tokens} tokens disagrees with "
                              f"the manifest's {described}, {manifest.counts.get('tokens')}")
    slab_offset = 0
    if layout.slab_bytes:
        values = kv.values
        data = values.buffers()[1]
        slab_offset = data.address - base.address + values.offset * kv_schema.ITEMSIZE[layout.dtype]
        if (slab_offset != manifest.kv.get("slab_offset") or slab_offset % 8
                or slab_offset + layout.slab_bytes > buf.nbytes):
            raise CorruptArtifact(f"{path}: slab at byte {slab_offset} (manifest: "
                                  f"{manifest.kv.get('slab_offset')}), {layout.slab_bytes} bytes")
    index = {cid: (off, n) for cid, off, n in zip(ids, offsets, lengths)}
    content_keys = {cid: k for cid, k in zip(ids, keys) if k is not None}
    return KVFile(layout, index, {cid: tuple(t) for cid, t in zip(ids, tokens)}, content_keys,
                  slab_offset, scales)
