"""Per-fact reads from storage: only the requested chunks' bytes, each verified."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from builders import forge_scale, make_inputs
from inferscale.artifacts.blobs import Location
from inferscale.artifacts.layout import ChecksumError, CorruptArtifact
from inferscale.artifacts.publish import publish
from inferscale.artifacts.read import data_path, read_manifest
from inferscale.hydrate.fact_reader import FactReader, NotFetchable
from inferscale.hydrate.slab import hydrate
from storage_schemas.manifest import Manifest

FP = "fp-test"


@pytest.fixture
def published(store):
    memory, facts, lineage = make_inputs("dana", 12, dtype=torch.bfloat16)
    r = publish(store, "dana", memory, facts, lineage, embeddings=False)
    return store, Location(store, "dana", FP), r


def test_reads_the_named_chunks_in_request_order(published):
    store, loc, r = published
    whole = hydrate(store, "dana", FP)
    reader = FactReader(store, FP, workers=3)
    index = reader.index("dana", r.version)
    chunks = list(whole.index)
    picked = [chunks[7], "prefix", chunks[3], chunks[12]]
    assert index.token_ids == whole.token_ids and index.dtype == "bfloat16"
    out = torch.empty(index.tokens(picked) * index.row_bytes + 100, dtype=torch.uint8)
    rows = reader.read(index, picked, out)  # [T, 2, L, H, D]
    want = torch.cat([whole.chunk(c) for c in picked])
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, want)
    assert reader.bytes_read == index.tokens(picked) * index.row_bytes
    assert reader.index("dana", r.version) is index  # cached


def test_direct_io_reads_the_same_rows_around_the_page_cache(local_store):
    """A reader over a store with direct I/O: its index (Arrow through the direct file
    object) and rows (unaligned ranges) are the buffered reader's, and the bytes are
    counted by the reader the kernel allowed."""
    from dataclasses import replace

    from inferscale.artifacts.direct_io import DIRECT, FALLBACK, read_counts, supports_direct_io

    memory, facts, lineage = make_inputs("dana", 12, dtype=torch.bfloat16, heads=3)
    r = publish(local_store, "dana", memory, facts, lineage, embeddings=False)
    plain = FactReader(local_store, FP)
    direct = FactReader(replace(local_store, direct_io=True), FP, workers=3)
    want, got = plain.index("dana", r.version), direct.index("dana", r.version)
    assert (got.rows, got.token_ids, got.slab_offset) == (want.rows, want.token_ids,
                                                          want.slab_offset)
    picked = [list(want.rows)[i] for i in (9, 0, 4, 5, 12)]
    reader = DIRECT if supports_direct_io(local_store.root) else FALLBACK
    before = read_counts()[reader]["bytes"]
    out = torch.empty(want.tokens(picked) * want.row_bytes, dtype=torch.uint8)
    rows = direct.read(got, picked, out)
    assert torch.equal(rows, plain.read(want, picked, torch.empty_like(out)))
    assert read_counts()[reader]["bytes"] - before == out.numel()


def test_direct_io_aligns_rows_of_whole_blocks_with_the_file(local_store):
    """Rows of a multiple of 4 KiB (an 8B model's): given ``buffer_bytes`` of room, the
    rows start where each chunk's destination agrees with its file offset modulo 4 KiB
    (so ``O_DIRECT`` reads them in place), and are the rows the page-cache reader reads;
    without the slack they are read into the buffer's start, as before."""
    from dataclasses import replace

    from inferscale.artifacts.direct_io import ALIGN

    memory, facts, lineage = make_inputs("dana", 9, dtype=torch.float32, head_dim=256)
    r = publish(local_store, "dana", memory, facts, lineage, embeddings=False)
    plain = FactReader(local_store, FP)
    direct = FactReader(replace(local_store, direct_io=True), FP, workers=3)
    index = direct.index("dana", r.version)
    assert index.row_bytes % ALIGN == 0 and index.slab_offset % ALIGN  # the case at hand
    picked = [list(index.rows)[i] for i in (7, 0, 3, 9)]
    want = plain.read(index, picked, torch.empty(index.tokens(picked) * index.row_bytes,
                                                 dtype=torch.uint8)).clone()
    for skew in (0, 1, 2048, ALIGN - 1):  # wherever the buffer starts
        room = torch.empty(direct.buffer_bytes(index, picked) + ALIGN, dtype=torch.uint8)
        out = room[skew:skew + direct.buffer_bytes(index, picked)]
        rows = direct.read(index, picked, out)
        assert torch.equal(rows, want)
        assert (rows.data_ptr() - index.slab_offset) % ALIGN == 0
    tight = torch.empty(index.tokens(picked) * index.row_bytes, dtype=torch.uint8)
    rows = direct.read(index, picked, tight)
    assert torch.equal(rows, want) and rows.data_ptr() == tight.data_ptr()


def test_fp8_chunks_come_with_their_verified_scales(store):
    """An fp8 version's facts read alone: the rows as stored and each chunk's scales from
    the index, which the manifest's index digest covers (a changed scale is refused)."""
    memory, facts, lineage = make_inputs("dana", 8, dtype=torch.float8_e4m3fn)
    r = publish(store, "dana", memory, facts, lineage, embeddings=False)
    whole = hydrate(store, "dana", FP)
    reader = FactReader(store, FP)
    index = reader.index("dana", r.version)
    picked = [list(whole.index)[5], "prefix", list(whole.index)[2]]
    out = torch.empty(index.tokens(picked) * index.row_bytes, dtype=torch.uint8)
    rows = reader.read(index, picked, out)
    assert index.dtype == "float8_e4m3fn" and rows.dtype == torch.float8_e4m3fn
    assert torch.equal(rows.view(torch.uint8),
                       torch.cat([whole.chunk(c) for c in picked]).view(torch.uint8))
    assert torch.equal(index.chunk_scales(picked),
                       torch.stack([whole.scales[whole.scale_pos(c)] for c in picked]))
    # scales changed on storage (and their file checksum fixed): the index digest refuses
    loc = Location(store, "dana", FP)
    path = data_path(loc, r.manifest, "kv.arrow")
    fs = store.filesystem()
    data = bytearray(fs.cat_file(path))
    one = pa.array([float(whole.scales[1, 0, 0, 0])], pa.float32()).buffers()[1].to_pybytes()
    at = bytes(data).index(one)
    data[at:at + 4] = pa.array([2.0], pa.float32()).buffers()[1].to_pybytes()
    fs.pipe_file(path, bytes(data))
    with pytest.raises(ChecksumError, match="chunk index differs"):
        FactReader(store, FP).index("dana", r.version)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0, 1e38, 7.6e35, 1e-45])
def test_forged_fp8_scales_are_refused(store, bad):
    """A kv file whose scale was replaced and whose manifest was re-signed to match: the
    digests agree, the scale itself is refused before any row is read."""
    memory, facts, lineage = make_inputs("dana", 4, dtype=torch.float8_e4m3fn)
    r = publish(store, "dana", memory, facts, lineage, embeddings=False)
    forge_scale(store, "dana", FP, r.version, bad)
    with pytest.raises(CorruptArtifact, match="finite and positive"):
        FactReader(store, FP).index("dana", r.version)


def test_a_damaged_chunk_fails_only_when_read(published):
    """Bytes of one chunk are flipped on storage: other chunks still read (nothing but
    the requested rows is read or hashed); the damaged one raises ChecksumError."""
    store, loc, r = published
    reader = FactReader(store, FP)
    index = reader.index("dana", r.version)
    chunks = list(index.rows)
    row, n, _ = index.rows[chunks[5]]
    path = data_path(loc, r.manifest, "kv.arrow")
    fs = store.filesystem()
    data = bytearray(fs.cat_file(path))
    at = index.slab_offset + row * index.row_bytes + 3
    data[at] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    out = torch.empty(64 << 10, dtype=torch.uint8)
    reader.read(index, [chunks[1], chunks[6]], out)  # fine
    with pytest.raises(ChecksumError, match=f"chunk '{chunks[5]}' differs"):
        reader.read(index, [chunks[1], chunks[5]], out)


def test_an_index_that_disagrees_with_the_manifest_is_refused(published):
    store, loc, r = published
    m = read_manifest(store, "dana", FP, r.version)
    body = {**m.__dict__, "kv": {**m.kv, "index_xxh3": "0" * 32}}
    store.filesystem().pipe_file(loc.file(r.version, "manifest.json"),
                                 Manifest(**body).to_json())
    with pytest.raises(ChecksumError, match="chunk index differs"):
        FactReader(store, FP).index("dana", r.version)


def test_versions_before_per_chunk_digests_are_not_fetchable(published):
    """A manifest without ``index_xxh3`` (kv schema < 3): loaded whole, never per fact."""
    store, loc, r = published
    m = read_manifest(store, "dana", FP, r.version)
    kv = {k: v for k, v in m.kv.items() if k != "index_xxh3"}
    store.filesystem().pipe_file(loc.file(r.version, "manifest.json"),
                                 Manifest(**{**m.__dict__, "kv": kv}).to_json())
    with pytest.raises(NotFetchable, match="loaded whole"):
        FactReader(store, FP).index("dana", r.version)


def test_unknown_chunks_and_small_buffers_are_refused(published):
    store, loc, r = published
    reader = FactReader(store, FP)
    index = reader.index("dana", r.version)
    with pytest.raises(KeyError, match="no chunks"):
        reader.read(index, ["prefix", "nope"], torch.empty(1 << 20, dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not fit"):
        reader.read(index, ["prefix"], torch.empty(1, dtype=torch.uint8))


def test_the_index_read_touches_a_few_kilobytes(local_store, monkeypatch):
    """The index columns come by projection: the bytes read are a small share of the
    file (the slab is never read)."""
    memory, facts, lineage = make_inputs("erin", 40, layers=4, heads=4, head_dim=32)
    r = publish(local_store, "erin", memory, facts, lineage, embeddings=False)
    loc = Location(local_store, "erin", FP)
    path = data_path(loc, r.manifest, "kv.arrow")
    size = r.manifest.files["kv.arrow"].bytes
    reads = []

    class Counting:  # the real file, its reads counted
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def read(self, n=-1):
            data = self.f.read(n)
            reads.append(len(data))
            return data

        def readinto(self, b):
            k = self.f.readinto(b)
            reads.append(k)
            return k

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    from inferscale.artifacts.blobs import LocalBlobs

    orig = LocalBlobs.open_read
    monkeypatch.setattr(LocalBlobs, "open_read",
                        lambda self, p, *size: Counting(orig(self, p, *size)))
    index = FactReader(local_store, FP).index("erin", r.version)
    assert len(index.rows) == 41 and 0 < sum(reads) < size / 20, (sum(reads), size)
    assert pa.ipc.open_file(path).num_record_batches == 1


@pytest.mark.parametrize("damage", ["removed", "flipped"])
def test_a_failed_read_forgets_the_index_so_a_repaired_version_reads(store, damage):
    """A version's kv file is removed (a gc racing a rollback) or damaged, and the version
    is published again (a repair: new file names, a new manifest). The reader's cached
    index names the old file: the read through it fails once and drops it, and the next
    request reads the manifest again and the repaired file; before, every read failed
    until the worker restarted. Local disk and S3 alike."""
    memory, facts, lineage = make_inputs("dana", 6, dtype=torch.bfloat16)
    r = publish(store, "dana", memory, facts, lineage, embeddings=False)
    loc = Location(store, "dana", FP)
    reader = FactReader(store, FP)
    index = reader.index("dana", r.version)
    picked = ["prefix", *list(index.rows)[2:4]]
    out = torch.empty(64 << 10, dtype=torch.uint8)
    want = reader.read(index, picked, out).clone()
    path = data_path(loc, r.manifest, "kv.arrow")
    fs = store.filesystem()
    if damage == "removed":
        fs.rm_file(path)
    else:
        data = bytearray(fs.cat_file(path))
        row, n, _ = index.rows[picked[1]]
        data[index.slab_offset + row * index.row_bytes] ^= 0xFF
        fs.pipe_file(path, bytes(data))
    repaired = publish(store, "dana", memory, facts, lineage, embeddings=False)
    assert repaired.version == r.version and repaired.created  # written again
    assert data_path(loc, repaired.manifest, "kv.arrow") != path
    with pytest.raises((FileNotFoundError, ChecksumError, OSError)):
        reader.read(reader.index("dana", r.version), picked, out)
    again = reader.index("dana", r.version)
    assert again is not index and again.path == data_path(loc, repaired.manifest, "kv.arrow")
    assert torch.equal(reader.read(again, picked, out), want)
    assert reader.index("dana", r.version) is again  # cached again


def test_a_forged_geometry_is_not_indexed(store):
    """Per-fact reads of a version whose K/V were regrouped (``[L, 2H, D/2]``, same bytes
    per token): refused from its manifest, the kv file never opened."""
    from builders import regrouped
    from inferscale.artifacts.layout import GeometryMismatch
    from inferscale.types import KVGeometry

    memory, facts, lineage = make_inputs("eve", 4, layers=2, heads=2, head_dim=8)
    r = publish(store, "eve", regrouped(memory, claim=True), facts, lineage,
                embeddings=False)
    with pytest.raises(GeometryMismatch, match="not the serving model's"):
        FactReader(store, FP, geometry=KVGeometry(2, 2, 8)).index("eve", r.version)
    assert FactReader(store, FP, geometry=KVGeometry(2, 4, 4)).index("eve", r.version).shape \
        == (2, 4, 4)


def test_a_kv_file_that_disagrees_with_its_manifest_is_refused(published):
    """A manifest re-signed to claim the model's geometry over a kv file of another: the
    file's own layout must be its manifest's (like whole-slab hydration's)."""
    store, loc, r = published
    m = read_manifest(store, "dana", FP, r.version)
    store.filesystem().pipe_file(loc.file(r.version, "manifest.json"), Manifest(**{
        **m.__dict__, "kv": {**m.kv, "kv_heads": 4, "head_dim": 4}}).to_json())
    with pytest.raises(CorruptArtifact, match="disagrees with the manifest"):
        FactReader(store, FP).index("dana", r.version)


def test_the_index_columns_from_arrow_buffers_refuse_nulls_and_honour_slices():
    """The index read from the Arrow buffers: token ids of a sliced list column (its
    offsets do not start at 0) come out per chunk, the scales one tensor per chunk in
    order; a null anywhere in the index is a damaged file, not a crash."""
    from inferscale.hydrate.fact_reader import _index_columns
    from storage_schemas import kv as kv_schema

    lay = kv_schema.KVLayout(dtype="float8_e4m3fn", layers=2, kv_heads=1, head_dim=4,
                             tokens=5, model_fingerprint=FP)
    tokens = pa.array([[9, 9], [1, 2], [3, 4, 5]], pa.list_(pa.int32())).slice(1)
    scales = pa.array([[0.5, 1.0, 1.5, 2.0], [2.5, 3.0, 3.5, 4.0]], pa.list_(pa.float32(), 4))

    def batch(digest):
        return pa.RecordBatch.from_pydict({
            "chunk_id": ["prefix", "f1"], "offset": pa.array([0, 2], pa.int64()),
            "length": pa.array([2, 3], pa.int32()), "token_ids": tokens,
            "digest": pa.array(digest, pa.uint64()), "scales": scales})

    ids, offsets, lengths, toks, digests, sc = _index_columns(batch([7, 2**64 - 1]), lay, "p")
    assert (ids, offsets, lengths, toks, digests) == (
        ["prefix", "f1"], [0, 2], [2, 3], [[1, 2], [3, 4, 5]], [7, 2**64 - 1])
    assert sc.shape == (2, 2, 2, 1) and sc.dtype == torch.float32
    assert sc[1].flatten().tolist() == [2.5, 3.0, 3.5, 4.0]
    with pytest.raises(CorruptArtifact, match="null"):
        _index_columns(batch([7, None]), lay, "p")
