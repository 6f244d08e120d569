"""Reading single facts' KV from storage, for a request whose user is in neither tier.

A request retrieves k facts; their rows are a few percent of the user's slab. A
:class:`FactReader` reads just those rows: the version's chunk index once (the kv file's
index columns by projection: its footer, then the columns, which lie together before the
slab, ~1 MB for 400 fp8 facts of an 8B model, mostly their scales: two reads of the file
through :meth:`~inferscale.artifacts.blob_base.Blobs.open_read`; checked against the
manifest's ``kv.index_xxh3``), then one byte range per chunk
(``slab_offset + row * row_bytes``; a ``pread`` on local disk, a ranged GET on S3), in
parallel, each chunk checked against its stored xxh3-64. Files written before kv schema 3
have no per-chunk digests and are refused (:class:`NotFetchable`): such users are only
loaded whole. fp8 files carry each chunk's scales in the index (verified with it), so a
fact read alone is dequantized exactly as the whole slab would be.

The bulk work (reads, hashing) releases the GIL, so it runs on a thread pool inside the
engine's process without holding up the engine's thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from inferscale.artifacts.blobs import Location
from inferscale.artifacts.direct_io import ALIGN
from inferscale.artifacts.layout import (
    KV_FILE, ArtifactError, ArtifactSchemaError, ChecksumError, CorruptArtifact,
    FingerprintMismatch, StoreConfig,
)
from inferscale.artifacts.read import check_size, data_path, manifest_at
from inferscale.hydrate.slab import check_geometry, check_kv_format
from inferscale.types import KVGeometry, torch_dtype
from storage_schemas import kv as kv_schema
from storage_schemas.common import SchemaVersionError
from storage_schemas.manifest import Manifest


class NotFetchable(ArtifactError):
    """A version whose facts cannot be read one by one (written before kv schema 3)."""


@dataclass(frozen=True)
class ChunkIndex:
    """Where each chunk of one version lies in its kv file, and its token ids.

    An fp8 version's scales are one tensor, not one per chunk: the engine's process keeps
    up to ``cached`` indexes (the load benchmark: all 2,000 users), and a tensor per chunk
    was 400 objects a user that each full garbage collection of that process traversed,
    every step in flight waiting (``benchmarks/results/gc-pause-cpu.json``). The dicts
    hold only strings, ints and tuples of them, which the collector stops tracking."""

    user: str
    version: str
    path: str
    dtype: str
    shape: tuple[int, int, int]  # L, H, D
    slab_offset: int  # byte offset of row 0 in the file
    rows: dict[str, tuple[int, int, int]]  # chunk id -> (first row, rows, xxh3-64)
    token_ids: dict[str, tuple[int, ...]]
    scales: torch.Tensor | None = None  # fp8: [C, 2, L, H] float32, in ``rows`` order

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pos", {c: i for i, c in enumerate(self.rows)})

    @property
    def row_bytes(self) -> int:
        layers, heads, dim = self.shape
        return 2 * layers * heads * dim * kv_schema.ITEMSIZE[self.dtype]

    def tokens(self, chunks: list[str]) -> int:
        return sum(self.rows[c][1] for c in chunks)

    def chunk_scales(self, chunks: list[str]) -> torch.Tensor | None:
        """The chunks' fp8 scales ``[len(chunks), 2, L, H]`` in that order (None: unscaled)."""
        if self.scales is None:
            return None
        return self.scales[[self._pos[c] for c in chunks]]  # [k, 2, L, H], a copy


class FactReader:
    """Chunk indexes (an LRU of ``cached`` versions) and parallel per-chunk reads of a
    model's artifacts: its fingerprint ``model_fp`` and, given, its KV ``geometry``
    (a version of another geometry is :class:`GeometryMismatch` before its kv file is
    opened; the file's own layout, fingerprint and dtype must be its manifest's)."""

    def __init__(self, store: StoreConfig, model_fp: str, workers: int = 8, cached: int = 256,
                 geometry: KVGeometry | None = None):
        self.store, self.model_fp = store, model_fp
        self.geometry = geometry  # the serving model's: other versions are refused
        self.cached = cached
        self._index: OrderedDict[tuple[str, str], ChunkIndex] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="inferscale-fetch")
        self.bytes_read = 0  # rows read, all requests together

    def index(self, user: str, version: str) -> ChunkIndex:
        """``user``'s ``version`` index (read once, then cached until a read through it
        fails: :meth:`read`)."""
        key = (user, version)
        with self._lock:
            found = self._index.get(key)
            if found is not None:
                self._index.move_to_end(key)
                return found
        found = self._read_index(user, version)
        with self._lock:
            self._index[key] = found
            while len(self._index) > self.cached:
                self._index.popitem(last=False)
        return found

    def forget(self, index: ChunkIndex) -> None:
        """Drop ``index`` from the cache (unless another one replaced it meanwhile)."""
        key = (index.user, index.version)
        with self._lock:
            if self._index.get(key) is index:
                del self._index[key]

    def _read_index(self, user: str, version: str) -> ChunkIndex:
        loc = Location(self.store, user, self.model_fp)
        manifest = manifest_at(loc, version)
        want = manifest.kv.get("index_xxh3")
        if not want:
            raise NotFetchable(f"{loc.describe(version)}: written before per-fact reads "
                               "(kv schema < 3); it is loaded whole")
        check_kv_format(manifest)
        check_geometry(manifest, self.geometry)
        check_size(loc, manifest, KV_FILE)
        path = data_path(loc, manifest, KV_FILE)
        with loc.blobs.open_read(path, manifest.files[KV_FILE].bytes) as f:  # size checked
            reader = pa.ipc.open_file(pa.PythonFile(f, mode="r"))
            names = reader.schema.names
            layout = _layout(reader.schema, path, manifest, self.model_fp)
            columns = kv_schema.index_columns(layout)
            try:
                picked = [names.index(c) for c in columns]
            except ValueError:
                raise NotFetchable(f"{path}: no per-chunk digests; it is loaded whole") from None
            projected = pa.ipc.open_file(pa.PythonFile(f, mode="r"),
                                         options=pa.ipc.IpcReadOptions(included_fields=picked))
            if projected.num_record_batches != 1:
                raise CorruptArtifact(f"{path}: {projected.num_record_batches} record batches")
            batch = projected.get_batch(0)
        ids, offsets, lengths, tokens, digests, scales = _index_columns(batch, layout, path)
        if kv_schema.index_digest(ids, offsets, lengths, tokens, digests,
                                  None if scales is None else scales.numpy()) != want:
            raise ChecksumError(f"{path}: its chunk index differs from the manifest's "
                                "(the file is damaged)")
        try:
            kv_schema.check_index(ids, offsets, lengths, [len(t) for t in tokens], layout.tokens)
            if layout.quantized:
                kv_schema.check_scales(batch.column("scales"))
        except kv_schema.KVFormatError as exc:
            raise CorruptArtifact(f"{path}: {exc}") from exc
        return ChunkIndex(user, manifest.version, path, layout.dtype,
                          (layout.layers, layout.kv_heads, layout.head_dim),
                          int(manifest.kv["slab_offset"]),
                          {c: (o, n, d) for c, o, n, d in zip(ids, offsets, lengths, digests)},
                          {c: tuple(t) for c, t in zip(ids, tokens)},
                          scales)

    @staticmethod
    def buffer_bytes(index: ChunkIndex, chunks: list[str]) -> int:
        """The room :meth:`read` needs in ``out`` for ``chunks``: their rows and, when
        rows are whole blocks, the slack that lets it align them with the file."""
        rb = index.row_bytes
        return index.tokens(chunks) * rb + (ALIGN if rb % ALIGN == 0 else 0)

    def read(self, index: ChunkIndex, chunks: list[str], out: torch.Tensor) -> torch.Tensor:
        """The chunks' rows, in ``chunks`` order, read into ``out`` (host uint8 with room
        for them) and verified: a ``[T, 2, L, H, D]`` view of ``out`` in the stored dtype.
        With :meth:`buffer_bytes` of room and rows a multiple of :data:`ALIGN` bytes (an
        8B model's 64 or 128 KiB), the view starts where every chunk's destination
        agrees with its file offset modulo :data:`ALIGN`, so ``O_DIRECT`` reads the rows
        straight into it instead of through a bounce buffer and a copy (50 fp8 facts of
        an 8B user on this repo's CPU machine: 1.56 -> 1.65 GB/s p50, the raw reads 1.84;
        ``benchmarks/results/fact-reads-cpu.json``).
        :class:`ChecksumError` when a chunk's bytes differ from its digest. A read that
        fails (the file gone, a short read, a checksum) drops ``index`` from the cache:
        the version may have been written again (a repair publish, a rollback racing
        gc) under other file names, which the next :meth:`index` reads from its
        manifest."""
        unknown = [c for c in chunks if c not in index.rows]
        if unknown:
            raise KeyError(f"user {index.user} version {index.version[:12]} has no chunks "
                           f"{unknown[:3]}")
        rb = index.row_bytes
        total = index.tokens(chunks)
        if out.numel() < total * rb:
            raise ValueError(f"{total * rb} bytes do not fit the {out.numel()}-byte buffer")
        shift = (index.slab_offset - out.data_ptr()) % ALIGN if rb % ALIGN == 0 else 0
        if out.numel() < shift + total * rb:
            shift = 0  # no room to align: each chunk goes through the bounce buffer
        out = out[shift:]
        mv = memoryview(out.numpy()).cast("B")

        def one(chunk: str, at: int) -> None:
            row, n, digest = index.rows[chunk]
            dest = mv[at:at + n * rb]
            read(index.slab_offset + row * rb, n * rb, dest)
            if kv_schema.chunk_digest(dest) != digest:
                raise ChecksumError(f"{index.path}: chunk {chunk!r} differs from its digest "
                                    "(the file is damaged)")

        try:
            read, close = Location(self.store, index.user, self.model_fp).blobs \
                ._range_reader(index.path)
        except BaseException:
            self.forget(index)
            raise
        try:
            futures, at = [], 0
            for c in chunks:
                futures.append(self._pool.submit(one, c, at))
                at += index.rows[c][1] * rb
            errors = [f.exception() for f in futures]  # waits for all: none writes later
        finally:
            close()
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            self.forget(index)
            raise failed
        with self._lock:
            self.bytes_read += total * rb
        layers, heads, dim = index.shape
        return out[:total * rb].view(torch_dtype(index.dtype)).view(total, 2, layers, heads, dim)


def _index_columns(batch: pa.RecordBatch, layout: kv_schema.KVLayout, path: str
                   ) -> tuple[list[str], list[int], list[int], list[list[int]], list[int],
                              torch.Tensor | None]:
    """The index columns as Python lists (token ids per chunk) and the fp8 scales as one
    float32 tensor ``[C, 2, L, H]`` (None: unscaled). Read from the Arrow buffers: a
    first read of a user's index happens on every cold request of a user not read before,
    inside the engine's process, where converting each value to a Python object (and each
    chunk's scales to a tensor of its own) held the GIL for 31 ms a 400-fact user (now 8;
    ``benchmarks/results/fact-reads-before-cpu.json``, ``fact-reads-cpu.json``)."""
    names = kv_schema.index_columns(layout)
    if any(batch.column(c).null_count for c in names):
        raise CorruptArtifact(f"{path}: null values in the chunk index")
    ids = batch.column("chunk_id").to_pylist()
    offsets = batch.column("offset").to_numpy().tolist()
    lengths = batch.column("length").to_numpy().tolist()
    digests = batch.column("digest").to_numpy().tolist()
    token_col = batch.column("token_ids")
    bounds = token_col.offsets.to_numpy()
    flat = token_col.flatten().to_numpy().tolist()  # the values of the list slices only
    start = int(bounds[0])
    tokens = [flat[int(a) - start:int(b) - start] for a, b in zip(bounds[:-1], bounds[1:])]
    scales = None
    if layout.quantized:
        values = batch.column("scales")
        while pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type):
            values = values.flatten()
        shape = (len(ids), 2, layout.layers, layout.kv_heads)
        scales = torch.from_numpy(values.to_numpy().astype(np.float32, copy=True)).view(shape)
    return ids, offsets, lengths, tokens, digests, scales


def _layout(schema: pa.Schema, path: str, manifest: Manifest, model_fp: str
            ) -> kv_schema.KVLayout:
    """The kv file's layout, which must be its manifest's (dtype, L, H, D) and name the
    serving model's fingerprint."""
    try:
        layout = kv_schema.KVLayout.from_schema(schema)
    except (SchemaVersionError, kv_schema.UnknownKVFormat) as exc:
        raise ArtifactSchemaError(f"{path}: {exc}") from exc
    except kv_schema.KVFormatError as exc:
        raise CorruptArtifact(f"{path}: {exc}") from exc
    if layout.model_fingerprint != model_fp:
        raise FingerprintMismatch(f"{path} holds KV of model {layout.model_fingerprint}, "
                                  f"expected {model_fp}")
    kv = manifest.kv
    if (layout.dtype, layout.layers, layout.kv_heads, layout.head_dim) != (
            kv["dtype"], kv["layers"], kv["kv_heads"], kv["head_dim"]):
        raise CorruptArtifact(f"{path}: layout {layout.dtype} {list(layout.shape[2:])} "
                              f"disagrees with the manifest's {kv['dtype']} "
                              f"{[kv['layers'], kv['kv_heads'], kv['head_dim']]}")
    return layout
