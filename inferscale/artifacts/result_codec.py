"""Arrow IPC forms of the pipeline's intermediate results, for caches that hold no pickle.

The cached compute steps (facts extraction, KV encoding) keep their results in shared
result storage; a pickle there would run code of whoever can write that storage when a
later run loads it, and would tie the cache to class layouts. These functions turn the
results into Arrow IPC streams (data and JSON metadata only) and back:

- :func:`encoded_to_ipc` / :func:`encoded_from_ipc`: the encoder's output
  (:class:`inferscale.encode.encoder.EncodedMemory`) as one record batch in the kv
  layout of :mod:`storage_schemas.kv` (chunk ids, token ids, content keys, the ``[T, 2, L, H, D]`` slab), with
  the model fingerprint, encoder config, stats and key calibration in the schema metadata;
- :func:`facts_to_ipc` / :func:`facts_from_ipc`: a
  :class:`inferscale.facts.extractor.FactsResult` as its facts table, the other fields
  in the schema metadata.

The KV form is the artifacts' own kv layout (built by
:func:`inferscale.artifacts.kv_file.build_kv_batch`), which is why this module lives in
the artifacts stage. Reading refuses anything but these layouts (``ValueError``).
Used by the result serializers of ``tasks/results.py``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from inferscale.artifacts.kv_file import build_kv_batch
from inferscale.types import KVGeometry, torch_dtype
from storage_schemas import kv as kv_schema

_KIND = b"inferscale.result"
_FIELDS = b"inferscale.result.fields"


def _ipc(table_or_batch: Any, kind: str, fields: dict[str, Any]) -> bytes:
    meta = {**(table_or_batch.schema.metadata or {}), _KIND: kind.encode(),
            _FIELDS: json.dumps(fields, sort_keys=True, allow_nan=False).encode()}
    data = table_or_batch.replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, data.schema) as writer:
        writer.write(data)
    return sink.getvalue().to_pybytes()


def _read(data: bytes, kind: str) -> tuple[pa.Table, dict[str, Any]]:
    try:
        table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    except pa.ArrowException as exc:
        raise ValueError(f"not an Arrow IPC stream of a {kind} result: {exc}") from exc
    meta = table.schema.metadata or {}
    if meta.get(_KIND) != kind.encode():
        raise ValueError(f"expected a {kind} result, found {meta.get(_KIND)!r}")
    return table, json.loads(meta[_FIELDS])


def encoded_to_ipc(encoded: Any) -> bytes:
    """Encoder output -> Arrow IPC bytes (no pickle)."""
    _, batch, _ = build_kv_batch(encoded, encoded.model_fingerprint)
    return _ipc(batch, "encoded-kv", {"model_fingerprint": encoded.model_fingerprint,
                                      "encoder_config": dict(encoded.encoder_config),
                                      "stats": dict(getattr(encoded, "stats", {}) or {}),
                                      "calibration": dict(getattr(encoded, "calibration",
                                                                  {}) or {}),
                                      "geometry": _geometry_field(encoded)})


def encoded_from_ipc(data: bytes) -> Any:
    """Inverse of :func:`encoded_to_ipc`: an ``EncodedMemory`` whose chunks' rows are views
    of one slab it owns (the encoder's layout is the slab's: nothing is laid out again)."""
    from inferscale.encode.capture import EncodedChunk
    from inferscale.encode.encoder import EncodedMemory

    table, fields = _read(data, "encoded-kv")
    layout = kv_schema.KVLayout.from_schema(table.schema)
    table = table.combine_chunks()
    ids = table.column("chunk_id").to_pylist()
    offsets = table.column("offset").to_pylist()
    lengths = table.column("length").to_pylist()
    tokens = table.column("token_ids").to_pylist()
    keys = (table.column("content_key").to_pylist() if "content_key" in table.column_names
            else [None] * len(ids))
    kv_schema.check_index(ids, offsets, lengths, [len(t) for t in tokens], layout.tokens)
    flat = table.column("kv").chunk(0).flatten().to_numpy(zero_copy_only=False)
    dtype = torch_dtype(layout.dtype)
    if dtype != torch.float32:  # bf16 and fp8 travel as same-width integers
        flat = flat.view({1: np.uint8, 2: np.int16}[dtype.itemsize])
    slab = torch.from_numpy(flat.copy()).view(dtype).view(layout.shape)  # [T, 2, L, H, D]
    if layout.quantized:
        kv_schema.check_scales(table.column("scales"))
    scales = ([torch.tensor(s, dtype=torch.float32).view(2, layout.layers, layout.kv_heads)
               for s in table.column("scales").to_pylist()]  # [2, L, H] per chunk
              if layout.quantized else [None] * len(ids))
    chunks = [EncodedChunk(cid, tok, slab[o:o + n], content_key=key, scales=sc)
              for cid, tok, o, n, key, sc in zip(ids, tokens, offsets, lengths, keys, scales)]
    geometry = fields.get("geometry")
    if geometry is not None:
        if not (isinstance(geometry, list) and len(geometry) == 3
                and all(type(n) is int for n in geometry)):
            raise ValueError(f"an encoded-kv result with geometry {geometry!r:.60}")
        geometry = KVGeometry(*geometry)
    return EncodedMemory(chunks, fields["model_fingerprint"], fields["encoder_config"],
                         fields["stats"], fields.get("calibration") or {}, geometry)


def _geometry_field(encoded: Any) -> list[int] | None:
    """The model's KV geometry the encoder recorded, as JSON (None: none recorded)."""
    geometry = getattr(encoded, "geometry", None)
    return list(map(int, geometry)) if geometry is not None else None


def facts_to_ipc(result: Any) -> bytes:
    """A ``FactsResult`` -> Arrow IPC bytes: its table, the other fields as metadata."""
    return _ipc(result.table, "facts", {
        "user": result.user, "facts_hash": result.facts_hash,
        "embedder_id": result.embedder_id, "turns_extracted": result.turns_extracted,
        "facts_per_turn": result.facts_per_turn, "llm_stats": result.llm_stats})


def facts_from_ipc(data: bytes) -> Any:
    """Inverse of :func:`facts_to_ipc`."""
    from inferscale.facts.extractor import FactsResult

    table, fields = _read(data, "facts")
    meta = {k: v for k, v in table.schema.metadata.items() if k not in (_KIND, _FIELDS)}
    return FactsResult(table=table.replace_schema_metadata(meta), **fields)
