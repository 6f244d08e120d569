"""Hydration round trips and bad artifacts: every damage is a typed, clear error."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest
import torch
import xxhash

from builders import expected_float, expected_slab, forge_scale, make_inputs
from inferscale.artifacts.blobs import Location
from inferscale.artifacts.layout import (
    ArtifactError, ArtifactNotFound, ArtifactSchemaError, ChecksumError, CorruptArtifact,
    FingerprintMismatch, MissingManifest, TruncatedArtifact,
)
from inferscale.artifacts.publish import publish
from inferscale.artifacts.read import (
    data_path, list_versions, read_facts, read_manifest, verify_version,
)
from inferscale.hydrate.slab import hydrate, slab_nbytes
from storage_schemas import kv as kv_schema
from storage_schemas.common import SchemaVersionError
from storage_schemas.manifest import VERSION, FileEntry, Manifest

FP = "fp-test"


def check(h, memory):
    assert torch.equal(h.slab, expected_slab(memory))
    offset = 0
    for c in memory.chunks:
        assert h.index[c.chunk_id] == (offset, len(c.token_ids))
        assert h.token_ids[c.chunk_id] == tuple(c.token_ids)
        assert torch.equal(h.chunk(c.chunk_id), c.kv)  # the encoder's rows, as emitted
        offset += len(c.token_ids)
    assert list(h.index) == [c.chunk_id for c in memory.chunks]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip(store, dtype):
    memory, facts, lineage = make_inputs("alice", 9, dtype=dtype, layers=3, heads=2, head_dim=4)
    r = publish(store, "alice", memory, facts, lineage, embeddings=False)
    h = hydrate(store, "alice", FP)
    assert h.slab.dtype == dtype and h.slab.device.type == "cpu"
    assert h.version == r.version and h.manifest == r.manifest and h.user == "alice"
    assert h.nbytes == r.manifest.kv["slab_bytes"]
    check(h, memory)
    # gpu tier on a CPU-only machine means CPU memory; small parts exercise ordering
    g = hydrate(store, "alice", FP, r.version, tier="gpu", expected_fingerprint=FP,
                use_mmap=False, part_bytes=1000, workers=3)
    assert g.slab.device.type == "cpu"
    check(g, memory)


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), 0.0, -2.0, 1e38, 7.6e35, 1e-45])
def test_forged_fp8_scales_are_refused(store, bad):
    """Scales replaced on storage with the manifest re-signed to match (sizes, checksums
    and the index digest all agree): hydration refuses the scale itself."""
    memory, facts, lineage = make_inputs("erin", 3, dtype=torch.float8_e4m3fn)
    r = publish(store, "erin", memory, facts, lineage, embeddings=False)
    forge_scale(store, "erin", FP, r.version, bad)
    with pytest.raises(CorruptArtifact, match="finite and positive"):
        hydrate(store, "erin", FP, r.version)


def test_fp8_round_trip_with_scales(store):
    """fp8 K/V and their scales per chunk come back as published; the manifest records
    the format; the size from the manifest alone counts the scales."""
    memory, facts, lineage = make_inputs("erin", 9, dtype=torch.float8_e4m3fn, layers=3,
                                         heads=2, head_dim=4)
    r = publish(store, "erin", memory, facts, lineage, embeddings=False)
    kv = r.manifest.kv
    assert kv["dtype"] == "float8_e4m3fn" and kv["scales"] == kv_schema.SCALES[kv["dtype"]]
    h = hydrate(store, "erin", FP)
    assert h.slab.dtype == torch.float8_e4m3fn
    assert torch.equal(h.slab.view(torch.uint8), expected_slab(memory).view(torch.uint8))
    assert torch.equal(h.scales, torch.stack([c.scales for c in memory.chunks]))
    chunks = len(memory.chunks)
    assert h.nbytes == slab_nbytes(r.manifest) == kv["slab_bytes"] + chunks * 2 * 3 * 2 * 4
    assert slab_nbytes(r.manifest, torch.float32) == 4 * kv["slab_bytes"]
    assert torch.equal(h.rows_float(torch.arange(h.slab.shape[0])), expected_float(memory))


def test_an_unknown_kv_format_is_refused_with_a_clear_error(store):
    """A dtype or scale rule this reader does not know (a newer InferScale wrote it) is
    refused from the manifest before the kv file is read, and from the kv file itself."""
    memory, facts, lineage = make_inputs("dana", 4, dtype=torch.float8_e4m3fn)
    r = publish(store, "dana", memory, facts, lineage, embeddings=False)
    loc = Location(store, "dana", FP)
    rewrite_manifest(store, loc, r.version, kv={**r.manifest.kv, "dtype": "float4_e2m1"})
    with pytest.raises(ArtifactSchemaError, match="'float4_e2m1'.*upgrade InferScale"):
        hydrate(store, "dana", FP)
    with pytest.raises(ArtifactSchemaError, match="'float4_e2m1'"):
        slab_nbytes(read_manifest(store, "dana", FP, r.version))
    rule = "float32 per token"
    rewrite_manifest(store, loc, r.version, kv={**r.manifest.kv, "scales": rule})
    with pytest.raises(ArtifactSchemaError, match="scale rule 'float32 per token'"):
        hydrate(store, "dana", FP)
    # the kv file's own record (the manifest put back as published)
    table = pa.ipc.open_file(pa.py_buffer(read(store, kv_path(loc, r)))).read_all()
    rewrite_kv(store, loc, r, table, {**table.schema.metadata,
                                      b"inferscale.kv.scales": rule.encode()})
    with pytest.raises(ArtifactSchemaError, match=r"kv\.\w+\.arrow: .*scale rule"):
        hydrate(store, "dana", FP)


def test_local_mmap_and_copy_agree(local_store):
    memory, facts, lineage = make_inputs("bob", 30, dtype=torch.bfloat16)
    publish(local_store, "bob", memory, facts, lineage, embeddings=False)
    mapped = hydrate(local_store, "bob", FP, use_mmap=True, part_bytes=4096)
    copied = hydrate(local_store, "bob", FP, use_mmap=False, part_bytes=4096)
    check(mapped, memory)
    check(copied, memory)
    mapped.slab[0].zero_()  # copy-on-write: the file is untouched
    check(hydrate(local_store, "bob", FP), memory)


def test_direct_io_hydrates_a_byte_identical_slab_around_the_page_cache(local_store):
    """A store with direct I/O reads kv.arrow into memory (never a mapping: that is the
    page cache) and gives the same slab, byte for byte, as the mapped read; parts of
    4096 and of 5000 bytes (ranges that are not block-aligned)."""
    from dataclasses import replace

    from inferscale.artifacts.direct_io import DIRECT, FALLBACK, read_counts, supports_direct_io

    memory, facts, lineage = make_inputs("bob", 30, dtype=torch.bfloat16, heads=3)
    publish(local_store, "bob", memory, facts, lineage, embeddings=False)
    direct = replace(local_store, direct_io=True)
    mapped = hydrate(local_store, "bob", FP)
    reader = DIRECT if supports_direct_io(local_store.root) else FALLBACK
    for part in (4096, 5000):
        before = read_counts()[reader]["bytes"]
        got = hydrate(direct, "bob", FP, part_bytes=part)
        check(got, memory)
        assert torch.equal(got.slab.view(torch.uint8), mapped.slab.view(torch.uint8))
        assert read_counts()[reader]["bytes"] - before >= mapped.manifest.files["kv.arrow"].bytes
    with pytest.raises(ValueError, match="direct I/O"):
        hydrate(direct, "bob", FP, use_mmap=True)


def test_local_mmap_without_populate(local_store, monkeypatch):
    import inferscale.artifacts.mapped_file as mapped

    monkeypatch.setattr(mapped, "_populate", lambda: None)  # kernels before 5.14, other OSes
    memory, facts, lineage = make_inputs("e", 20)
    publish(local_store, "e", memory, facts, lineage, embeddings=False)
    check(hydrate(local_store, "e", FP, part_bytes=5000), memory)


def test_prefix_only(local_store):
    memory, facts, lineage = make_inputs("c", 0)
    publish(local_store, "c", memory, facts, lineage, embeddings=False)
    check(hydrate(local_store, "c", FP), memory)


def test_argument_errors(local_store):
    with pytest.raises(ValueError, match="tier"):
        hydrate(local_store, "a", FP, tier="disk")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            hydrate(local_store, "a", FP, device="cuda")


# ------------------------------------------------------------------------- bad artifacts


@pytest.fixture
def published(store):
    memory, facts, lineage = make_inputs("dana", 12)
    r = publish(store, "dana", memory, facts, lineage, embeddings=False)
    return store, Location(store, "dana", FP), r


def read(store, path) -> bytes:
    return store.filesystem().cat_file(path)


def write(store, path, data: bytes) -> None:
    fs = store.filesystem()
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, data)


def rewrite_manifest(store, loc, version, **changes) -> None:
    m = read_manifest(store, "dana", FP, version)
    body = {**m.__dict__, **changes}
    write(store, loc.file(version, "manifest.json"), Manifest(**body).to_json())


def kv_path(loc, r) -> str:
    return data_path(loc, r.manifest, "kv.arrow")  # kv.<nonce>.arrow


def test_truncated_kv(published):
    store, loc, r = published
    path = kv_path(loc, r)
    write(store, path, read(store, path)[:-100])
    with pytest.raises(TruncatedArtifact, match=r"kv\.\w+\.arrow is .* bytes; the manifest says"):
        hydrate(store, "dana", FP)
    with pytest.raises(TruncatedArtifact):
        verify_version(store, "dana", FP)


def test_missing_kv(published):
    store, loc, r = published
    store.filesystem().rm(kv_path(loc, r))
    with pytest.raises(TruncatedArtifact, match=r"kv\.\w+\.arrow is missing"):
        hydrate(store, "dana", FP)


def test_admission_refuses_before_reading_the_kv(published):
    """``admit`` sees the verified manifest first: a refusal reads nothing of kv.arrow
    (here the file is even gone, which any read or size check would report)."""
    from inferscale.hydrate.slab import READS, slab_nbytes
    from inferscale.hydrate.resident import ResidencyError
    from inferscale.hydrate.store import ResidentStore

    store, loc, r = published
    assert slab_nbytes(r.manifest) == r.manifest.kv["slab_bytes"] > 0
    budgets = ResidentStore("cpu", gpu_budget_bytes=0, host_budget_bytes=100)
    seen = []

    def admit(manifest):
        seen.append(manifest.version)
        budgets.fit_tier(manifest.user, slab_nbytes(manifest), "gpu")

    store.filesystem().rm(kv_path(loc, r))
    before = dict(READS)
    with pytest.raises(ResidencyError, match="exceed the gpu budget"):
        hydrate(store, "dana", FP, admit=admit)
    assert seen == [r.version] and READS == before


@pytest.mark.parametrize("where", [0.5, 0.01, 0.999])
def test_flipped_byte_in_kv(published, where):
    store, loc, r = published
    path = kv_path(loc, r)
    data = bytearray(read(store, path))
    data[int(len(data) * where)] ^= 0x10
    write(store, path, bytes(data))
    with pytest.raises(ChecksumError, match=r"kv\.\w+\.arrow: xxh3-128 .* differs"):
        hydrate(store, "dana", FP)
    if store.is_local:
        with pytest.raises(ChecksumError):
            hydrate(store, "dana", FP, use_mmap=False)


def test_flipped_byte_in_facts(published):
    store, loc, r = published
    path = data_path(loc, r.manifest, "facts.arrow")
    data = bytearray(read(store, path))
    data[len(data) // 2] ^= 0x01
    write(store, path, bytes(data))
    with pytest.raises(ChecksumError, match=r"facts\.\w+\.arrow"):
        read_facts(store, "dana", FP)
    with pytest.raises(ChecksumError, match=r"facts\.\w+\.arrow"):
        verify_version(store, "dana", FP)
    hydrate(store, "dana", FP)  # the KV is intact and still usable


def test_damaged_manifest(published):
    store, loc, r = published
    path = loc.file(r.version, "manifest.json")
    text = read(store, path).decode()
    digest = r.manifest.files["kv.arrow"].xxh3_128
    flipped = digest[:5] + ("0" if digest[5] != "0" else "1") + digest[6:]
    write(store, path, text.replace(digest, flipped).encode())  # still valid JSON
    with pytest.raises(ChecksumError, match="manifest.json: manifest checksum"):
        hydrate(store, "dana", FP)
    write(store, path, text[: len(text) // 2].encode())
    with pytest.raises(CorruptArtifact, match="manifest.json: not valid JSON"):
        hydrate(store, "dana", FP)


def test_missing_manifest(published):
    store, loc, r = published
    store.filesystem().rm(loc.file(r.version, "manifest.json"))
    with pytest.raises(MissingManifest, match="manifest.json is missing"):
        hydrate(store, "dana", FP)  # LATEST names it
    with pytest.raises(MissingManifest):
        hydrate(store, "dana", FP, r.version)
    assert list_versions(store, "dana", FP) == []


def test_newer_manifest_schema(published):
    store, loc, r = published
    rewrite_manifest(store, loc, r.version, schema_version=VERSION + 1)
    with pytest.raises(ArtifactSchemaError,
                       match=f"manifest.json: manifest schema version {VERSION + 1} is newer"):
        hydrate(store, "dana", FP)


def rewrite_kv(store, loc, r, table: pa.Table, metadata: dict) -> None:
    """Replace a version's kv file with ``table`` under ``metadata``; fix the manifest."""
    path = kv_path(loc, r)
    sink = pa.BufferOutputStream()
    schema = table.schema.with_metadata(metadata)
    with pa.ipc.new_file(sink, schema) as w:
        w.write_table(table.replace_schema_metadata(metadata).combine_chunks())
    data = sink.getvalue().to_pybytes()
    write(store, path, data)
    buf = pa.py_buffer(data)
    values = pa.ipc.open_file(buf).get_batch(0).column("kv").values
    slab_offset = values.buffers()[1].address - buf.address
    files = {**r.manifest.files, "kv.arrow": FileEntry(
        len(data), xxhash.xxh3_128_hexdigest(data), r.manifest.files["kv.arrow"].stored_as)}
    rewrite_manifest(store, loc, r.version, files=files,
                     kv={**r.manifest.kv, "slab_offset": slab_offset})


def test_newer_kv_schema(published):
    store, loc, r = published
    table = pa.ipc.open_file(pa.py_buffer(read(store, kv_path(loc, r)))).read_all()
    rewrite_kv(store, loc, r, table, {**table.schema.metadata, b"inferscale.schema_version": b"5"})
    with pytest.raises(ArtifactSchemaError,
                       match=r"kv\.\w+\.arrow: kv schema version 5 is newer") as err:
        hydrate(store, "dana", FP)
    assert isinstance(err.value, SchemaVersionError)


def test_kv_schema_version_1_still_hydrates(published):
    """A kv.arrow written before content keys (schema 1) reads as before, with no keys."""
    store, loc, r = published
    memory, *_ = make_inputs("dana", 12)
    table = pa.ipc.open_file(pa.py_buffer(read(store, kv_path(loc, r)))).read_all()
    assert table.column("content_key").null_count == table.num_rows  # builders set none
    v1 = table.drop_columns(["content_key", "digest"])
    rewrite_kv(store, loc, r, v1, {**table.schema.metadata, b"inferscale.schema_version": b"1"})
    h = hydrate(store, "dana", FP)
    check(h, memory)
    assert h.content_keys == {}


def test_content_keys_hydrate(local_store):
    memory, facts, lineage = make_inputs("erin", 4, dtype=torch.float32)
    for i, c in enumerate(memory.chunks[1:]):
        c.content_key = f"key-{i}"
    publish(local_store, "erin", memory, facts, lineage, embeddings=False)
    h = hydrate(local_store, "erin", FP)
    assert h.content_keys == {c.chunk_id: f"key-{i}" for i, c in enumerate(memory.chunks[1:])}


def test_manifest_layout_disagrees_with_kv(published):
    store, loc, r = published
    rewrite_manifest(store, loc, r.version, kv={**r.manifest.kv, "layers": 5})
    with pytest.raises(CorruptArtifact, match="disagrees with the manifest"):
        hydrate(store, "dana", FP)


def test_wrong_model_fingerprint(published):
    store, loc, r = published
    with pytest.raises(FingerprintMismatch, match="serving model is fp-other"):
        hydrate(store, "dana", FP, expected_fingerprint="fp-other")
    # the artifact copied under another model's folder is refused as well
    other = Location(store, "dana", "fp-other")
    for name in [e.stored_as for e in r.manifest.files.values()] + ["manifest.json"]:
        write(store, other.file(r.version, name), read(store, loc.file(r.version, name)))
    write(store, other.latest, r.version.encode())
    with pytest.raises(FingerprintMismatch, match="written for model fp-test"):
        hydrate(store, "dana", "fp-other")


def test_kv_of_another_model_behind_a_matching_manifest(published):
    store, loc, r = published
    memory, facts, lineage = make_inputs("dana", 12, fp="fp-evil")
    evil = publish(store, "dana", memory, facts, lineage, embeddings=False)
    evil_loc = Location(store, "dana", "fp-evil")
    data = read(store, kv_path(evil_loc, evil))
    write(store, kv_path(loc, r), data)
    files = {**r.manifest.files, "kv.arrow": FileEntry(
        len(data), xxhash.xxh3_128_hexdigest(data), r.manifest.files["kv.arrow"].stored_as)}
    rewrite_manifest(store, loc, r.version, files=files)
    with pytest.raises(FingerprintMismatch, match="holds KV of model fp-evil"):
        hydrate(store, "dana", FP)


def test_not_found_and_bad_latest(published):
    store, loc, r = published
    with pytest.raises(ArtifactNotFound, match="no LATEST"):
        hydrate(store, "nobody", FP)
    with pytest.raises(ArtifactNotFound, match="no such version"):
        hydrate(store, "dana", FP, "f" * 32)
    with pytest.raises(ArtifactNotFound, match="not a version id"):
        hydrate(store, "dana", FP, "../../x")
    write(store, loc.latest, b"garbage\n")
    with pytest.raises(CorruptArtifact, match="LATEST holds"):
        hydrate(store, "dana", FP)


def test_errors_share_one_base():
    for cls in (ArtifactNotFound, MissingManifest, TruncatedArtifact, ChecksumError,
                FingerprintMismatch, CorruptArtifact, ArtifactSchemaError):
        assert issubclass(cls, ArtifactError)
    assert issubclass(ArtifactSchemaError, SchemaVersionError)
    assert issubclass(MissingManifest, ArtifactNotFound)
    assert issubclass(ArtifactNotFound, FileNotFoundError)


def test_manifest_on_disk_names_sizes(published):
    store, loc, r = published
    body = json.loads(read(store, loc.file(r.version, "manifest.json")))
    size = store.filesystem().size(kv_path(loc, r))
    assert body["files"]["kv.arrow"]["bytes"] == size
    assert 0 < body["kv"]["slab_offset"] < size
    assert os.path.basename(kv_path(loc, r)) == body["files"]["kv.arrow"]["stored_as"]


# ---------------------------------------------------------------------------------- CUDA

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("tier", ["host", "gpu"])
def test_cuda_tiers(local_store, tier):
    memory, facts, lineage = make_inputs("gpu", 40, layers=4, heads=2, head_dim=64)
    publish(local_store, "gpu", memory, facts, lineage, embeddings=False)
    h = hydrate(local_store, "gpu", FP, tier=tier, device="cuda", part_bytes=4096)
    if tier == "host":
        assert h.slab.device.type == "cpu" and h.slab.is_pinned()
    else:
        assert h.slab.device.type == "cuda"
    assert torch.equal(h.slab.cpu(), expected_slab(memory))
    assert torch.equal(h.chunk("prefix").cpu(), expected_slab(memory)[:4])


@needs_cuda
def test_cuda_gpu_tier_refuses_a_damaged_slab(local_store):
    memory, facts, lineage = make_inputs("gpu", 40, layers=4, heads=2, head_dim=64)
    r = publish(local_store, "gpu", memory, facts, lineage, embeddings=False)
    path = kv_path(Location(local_store, "gpu", FP), r)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(ChecksumError):
        hydrate(local_store, "gpu", FP, tier="gpu", device="cuda", part_bytes=4096)


def test_hydration_needs_only_the_gpu_machine_packages(tmp_path, child_env):
    """The GPU machine has torch, numpy, pyarrow, fsspec, xxhash: nothing else is imported."""
    import subprocess
    import sys

    code = f"""
import importlib.abc, sys
BLOCKED = ("lancedb", "s3fs", "moto", "pydantic", "pydantic_settings", "prefect", "vllm",
           "pandas", "transformers", "boto3", "botocore", "aiobotocore")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not on the GPU machine")
sys.meta_path.insert(0, Block())
from builders import make_inputs
from inferscale.artifacts.publish import publish
from inferscale.hydrate.slab import hydrate
from inferscale.artifacts.layout import StoreConfig
store = StoreConfig({str(tmp_path)!r})
memory, facts, lineage = make_inputs("gpu-box", 3)
publish(store, "gpu-box", memory, facts, lineage, embeddings=False)
print(tuple(hydrate(store, "gpu-box", "fp-test").slab.shape))
from inferscale.artifacts.layout import ArtifactError
try:
    publish(store, "gpu-box", *make_inputs("gpu-box", 3, seed=5))
except ArtifactError as exc:
    assert "need lancedb" in str(exc), exc
    assert len(list(__import__("pathlib").Path({str(tmp_path)!r}).rglob("*.arrow"))) == 2
else:
    raise AssertionError("publishing embeddings without lancedb must fail clearly")
"""
    out = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().startswith("(")


def test_hydration_refuses_another_geometry_before_reading(store):
    """``hydrate(geometry=...)``: a version whose KV is not the model's geometry is
    refused from its manifest (nothing of kv.arrow read)."""
    from builders import regrouped
    from inferscale.artifacts.layout import GeometryMismatch
    from inferscale.hydrate.slab import READS
    from inferscale.types import KVGeometry

    memory, facts, lineage = make_inputs("eve", 2, layers=2, heads=2, head_dim=8)
    r = publish(store, "eve", regrouped(memory, claim=True), facts, lineage,
                embeddings=False)
    reads = dict(READS)
    with pytest.raises(GeometryMismatch):
        hydrate(store, "eve", FP, r.version, geometry=KVGeometry(2, 2, 8))
    assert READS == reads
    assert hydrate(store, "eve", FP, r.version, geometry=KVGeometry(2, 4, 4)).slab.shape[2:] \
        == (2, 4, 4)
