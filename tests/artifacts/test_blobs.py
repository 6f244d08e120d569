"""File operations on a store root, on local disk and on S3 (moto): atomic replaces,
exclusive creates, streamed writes with their checksum, reads fused with checksums."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import xxhash

from inferscale.artifacts.blobs import Location, open_blobs
from inferscale.artifacts.layout import ArtifactNotFound, InvalidUserId, TruncatedArtifact

DATA = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8).tobytes()


def test_replace_read_size_and_listing(store):
    blobs = open_blobs(store)
    path = blobs.join("users", "u", "LATEST")
    assert not blobs.exists(path) and blobs.size(path) is None
    blobs.replace(path, b"one")
    blobs.replace(path, b"second")  # replaced whole, never appended
    assert blobs.read_bytes(path) == b"second" and blobs.size(path) == 6
    blobs.replace(blobs.join("users", "v", "x"), b"")
    assert blobs.listdir(blobs.join("users")) == ["u", "v"]  # folders only, sorted
    assert blobs.listdir(blobs.join("nothing-here")) == []
    assert blobs.mtime(blobs.join("users", "u")) is not None
    blobs.remove_file(path)
    blobs.remove_file(path)  # removing what is gone is not an error
    assert not blobs.exists(path)
    blobs.remove_tree(blobs.join("users"))
    assert blobs.listdir(store.root) == []


def test_create_exclusive_lets_one_writer_win(store):
    blobs = open_blobs(store)
    path = blobs.join("v", "manifest.json")
    assert blobs.create_exclusive(path, b"first") is True
    assert blobs.create_exclusive(path, b"second") is False
    assert blobs.read_bytes(path) == b"first"


def test_write_stream_hashes_what_it_stores_and_finds_the_watched_buffer(store):
    blobs = open_blobs(store)
    path = blobs.join("v", "kv.arrow")
    watched = pa.py_buffer(DATA[:1000])

    def fill(w):
        w.write(b"head")
        w.write(watched)
        w.write(memoryview(DATA[1000:]))
        return "filled"

    out = blobs.write_stream(path, fill, watch=watched.address)
    stored = blobs.read_bytes(path)
    assert stored == b"head" + DATA
    assert out.nbytes == len(stored) and out.result == "filled"
    assert out.xxh3_128 == xxhash.xxh3_128_hexdigest(stored)
    assert out.watched_at == 4  # the buffer's position in the file


def test_a_failed_write_stream_leaves_nothing(store):
    blobs = open_blobs(store)
    path = blobs.join("v", "kv.arrow")

    def fill(w):
        w.write(DATA)
        raise RuntimeError("the writer died")

    with pytest.raises(RuntimeError, match="died"):
        blobs.write_stream(path, fill)
    assert not blobs.exists(path)
    assert [p for p in store.filesystem().find(store.root) if ".tmp" in p] == []


@pytest.mark.parametrize("part_bytes, workers", [(1 << 20, 4), (7_000, 3), (4096, 1)])
def test_read_into_fuses_the_checksum(store, part_bytes, workers):
    blobs = open_blobs(store)
    path = blobs.join("v", "kv.arrow")
    blobs.replace(path, DATA)
    dest = np.zeros(len(DATA), dtype=np.uint8)
    parts = []
    digest = blobs.read_into(path, len(DATA), dest, part_bytes=part_bytes, workers=workers,
                             on_part=lambda o, n: parts.append((o, n)))
    assert digest == xxhash.xxh3_128_hexdigest(DATA)
    assert dest.tobytes() == DATA
    assert [o for o, _ in parts] == list(range(0, len(DATA), part_bytes))  # in order
    assert sum(n for _, n in parts) == len(DATA)
    # hash only (no destination), and a prefix of the file
    assert blobs.read_into(path, 5000, None, part_bytes=part_bytes) == \
        xxhash.xxh3_128_hexdigest(DATA[:5000])
    assert blobs.hash_file(path, len(DATA)) == digest


def test_a_short_file_is_truncated(store):
    blobs = open_blobs(store)
    path = blobs.join("v", "kv.arrow")
    blobs.replace(path, DATA[:1000])
    with pytest.raises(TruncatedArtifact):
        blobs.read_into(path, 5000, np.zeros(5000, dtype=np.uint8), part_bytes=4096)


def test_location_names_one_user_and_model(store):
    loc = Location(store, "Ann.X", "fp-1")
    assert loc.user == "Ann.X" and loc.user_dir.startswith("_")
    assert loc.dir == f"{store.root}/users/{loc.user_dir}/fp-1"
    v = "0" * 32
    assert loc.file(v, "kv.arrow") == f"{loc.dir}/{v}/kv.arrow"
    assert loc.latest == f"{loc.dir}/LATEST" and loc.lance_uri == f"{loc.dir}/lance"
    assert loc.describe(v) == f"user 'Ann.X', model fp-1, version {v}"
    with pytest.raises(ArtifactNotFound):
        loc.version_dir("../escape")
    for bad in ("", "Ann/../x"):
        with pytest.raises(InvalidUserId):
            Location(store, bad, "fp-1")


def test_a_direct_io_store_reads_every_local_file_around_the_page_cache(tmp_path):
    """read_into (ranges in parallel), read_bytes, open_read and hash_file of a store with
    direct_io give the same bytes, and every byte is counted by the reader the kernel
    allowed (O_DIRECT, or the fallback on a filesystem that refuses it)."""
    from inferscale.artifacts.direct_io import DIRECT, FALLBACK, read_counts, supports_direct_io
    from inferscale.artifacts.layout import StoreConfig

    blobs = open_blobs(StoreConfig(str(tmp_path / "root"), direct_io=True))
    path = blobs.join("v", "kv.arrow")
    blobs.replace(path, DATA)
    reader = DIRECT if supports_direct_io(path) else FALLBACK
    before = read_counts()[reader]["bytes"]
    dest = np.zeros(len(DATA), dtype=np.uint8)
    digest = blobs.read_into(path, len(DATA), dest, part_bytes=7_000, workers=3)
    assert dest.tobytes() == DATA and digest == xxhash.xxh3_128_hexdigest(DATA)
    assert blobs.hash_file(path, len(DATA)) == digest
    assert blobs.read_bytes(path) == DATA
    with blobs.open_read(path) as f:
        f.seek(99_000)
        assert f.read(2_000) == DATA[99_000:101_000]
    assert read_counts()[reader]["bytes"] - before >= 3 * len(DATA)
    blobs.replace(path, DATA[:1000])
    with pytest.raises(TruncatedArtifact):
        blobs.read_into(path, 5000, np.zeros(5000, dtype=np.uint8), part_bytes=4096)


def test_open_read_takes_a_size_checked_before(tmp_path, monkeypatch):
    """A caller that has just checked a file's size (the chunk index, against its
    manifest) hands it over: the store is not asked again (on S3 that is a HEAD)."""
    from inferscale.artifacts.layout import StoreConfig

    blobs = open_blobs(StoreConfig(str(tmp_path / "root")))
    path = blobs.join("v", "kv.arrow")
    blobs.replace(path, DATA)
    monkeypatch.setattr(blobs, "size", lambda p: pytest.fail("the size was asked again"))
    with blobs.open_read(path, len(DATA)) as f:
        assert f.seek(-10, 2) == len(DATA) - 10 and f.read() == DATA[-10:]
