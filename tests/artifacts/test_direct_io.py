"""Reads around the page cache: exact bytes at any offset and length, the page cache left
untouched, and the honest fallback where a filesystem refuses O_DIRECT."""

from __future__ import annotations

import ctypes
import errno
import io
import mmap
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferscale.artifacts.blob_base import WindowedFile
from inferscale.artifacts.direct_io import (
    ALIGN, DIRECT, FALLBACK, DirectFile, read_counts, supports_direct_io,
)
from inferscale.artifacts.layout import InvalidStoreConfig, StoreConfig, TruncatedArtifact

SIZE = 5 * ALIGN * 3 + 1234  # several bounce windows of 3 blocks, and a partial last block
DATA = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


def kernel_accepts_direct(path: str) -> bool:
    """The kernel's own answer, independent of the module under test."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        return False
    os.close(fd)
    return True


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("direct") / "kv.bin"
    path.write_bytes(DATA)
    return str(path)


def test_the_reader_is_what_the_kernel_allows(data_file):
    with DirectFile(data_file) as f:
        assert f.size == SIZE
        assert f.reader == (DIRECT if kernel_accepts_direct(data_file) else FALLBACK)
        assert f.bypassed == kernel_accepts_direct(data_file)
        assert supports_direct_io(os.path.dirname(data_file)) == f.bypassed


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(0, SIZE), length=st.integers(0, SIZE),
       dest=st.sampled_from(["new", "congruent", "shifted", "tensor"]),
       shift=st.integers(1, ALIGN - 1), bounce_blocks=st.sampled_from([1, 3, 2048]))
def test_any_range_reads_the_same_bytes_as_a_buffered_read(data_file, offset, length, dest,
                                                           shift, bounce_blocks):
    """Aligned or not, into new memory, into memory whose address agrees with the offset
    modulo 4096 (the aligned interior lands there directly) or does not, into a tensor;
    windows of 1, 3 or 2048 blocks."""
    length = min(length, SIZE - offset)
    want = DATA[offset:offset + length]
    with DirectFile(data_file, bounce_bytes=bounce_blocks * ALIGN) as f:
        if dest == "new":
            got = f.read(offset, length)
        elif dest == "tensor":
            out = torch.full((length + 8,), 7, dtype=torch.uint8)
            f.read(offset, length, out[:length])
            assert out[length:].eq(7).all()  # nothing written past the range
            got = out[:length].numpy().tobytes()
        else:
            buf = mmap.mmap(-1, length + 2 * ALIGN)  # page-aligned
            at = offset % ALIGN if dest == "congruent" else (offset + shift) % ALIGN
            got = f.read(offset, length, memoryview(buf)[at:at + length])
            assert buf[:at] == b"\0" * at and buf[at + length:] == b"\0" * (len(buf) - at - length)
        assert bytes(got) == want


def test_reading_past_the_end_is_truncated(data_file):
    with DirectFile(data_file) as f:
        with pytest.raises(TruncatedArtifact, match="ended at"):
            f.read(SIZE - 10, 11)
        with pytest.raises(TruncatedArtifact):
            f.read(SIZE + ALIGN, 1)
        assert bytes(f.read(SIZE - 10, 10)) == DATA[-10:]
        with pytest.raises(ValueError, match="do not fit"):
            f.read(0, 100, bytearray(99))


def _cached_pages(path: str) -> int:
    """Pages of ``path`` in the page cache (``mincore`` over a mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    os.close(fd)
    arr = np.frombuffer(m, dtype=np.uint8)
    vec = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
    assert libc.mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(size), vec) == 0
    del arr
    m.close()
    return sum(v & 1 for v in vec)


def _uncached(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore, fadvise: Linux")
def test_direct_reads_leave_the_page_cache_empty(tmp_path):
    path = str(tmp_path / "cold.bin")
    with open(path, "wb") as f:
        f.write(np.random.default_rng(2).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes())
    if not kernel_accepts_direct(path):
        pytest.skip("this filesystem refuses O_DIRECT (the fallback tests cover it)")
    _uncached(path)
    if _cached_pages(path):
        pytest.skip("this filesystem keeps file pages cached (tmpfs)")
    with DirectFile(path) as f:
        f.read(1000, 3 << 20)  # unaligned: through the bounce buffer
        f.read(0, 4 << 20, memoryview(mmap.mmap(-1, 4 << 20)))  # straight into memory
        with WindowedFile(f.read, lambda: None, f.size) as raw:  # as a store's open_read
            raw.seek(5000)
            raw.read(100_000)
    assert _cached_pages(path) == 0
    with open(path, "rb") as f:  # the check can see cached pages
        f.read()
    assert _cached_pages(path) > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="procfs")
def test_a_filesystem_without_o_direct_falls_back_and_says_so():
    """procfs refuses O_DIRECT: buffered reads, the same bytes, never a claim of bypass."""
    path = "/proc/version"
    assert not kernel_accepts_direct(path) and not supports_direct_io(path)
    with open(path, "rb") as f:
        want = f.read()
    before = read_counts()
    with DirectFile(path) as f:
        assert f.reader == FALLBACK and not f.bypassed
        assert bytes(f.read(0, len(want))) == want
        assert bytes(f.read(3, 7, bytearray(7))) == want[3:10]
    after = read_counts()
    assert after[FALLBACK]["bytes"] - before[FALLBACK]["bytes"] == len(want) + 7
    assert after[FALLBACK]["files"] == before[FALLBACK]["files"] + 1
    assert after[DIRECT] == before[DIRECT]


def test_the_raw_file_seeks_and_reads_like_a_file(data_file):
    direct = DirectFile(data_file)
    with WindowedFile(direct.read, direct.close, direct.size, window=8192, tail=1024) as f, \
            open(data_file, "rb") as plain:
        for offset, whence, n in [(0, io.SEEK_SET, 10), (12_345, io.SEEK_SET, 70_000),
                                  (-5, io.SEEK_END, 100), (-300, io.SEEK_CUR, 250)]:
            assert f.seek(offset, whence) == plain.seek(offset, whence)
            assert f.read(n) == plain.read(n) and f.tell() == plain.tell()
        assert f.read() == plain.read() == DATA[-50:]
        assert f.read() == b"" and f.tell() == SIZE


def test_the_setting_must_be_a_bool(tmp_path):
    assert StoreConfig(str(tmp_path)).direct_io is False
    with pytest.raises(InvalidStoreConfig, match="direct_io"):
        StoreConfig(str(tmp_path), direct_io="yes")


RAMFS_CHILD = textwrap.dedent("""
    import sys, torch
    from builders import make_inputs
    from inferscale.artifacts.direct_io import DIRECT, FALLBACK, read_counts, supports_direct_io
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.publish import publish
    from inferscale.hydrate.fact_reader import FactReader
    from inferscale.hydrate.slab import hydrate

    root = sys.argv[1]
    assert not supports_direct_io(root), "ramfs accepted O_DIRECT"
    plain, direct = StoreConfig(root), StoreConfig(root, direct_io=True)
    memory, facts, lineage = make_inputs("dana", 9, dtype=torch.bfloat16)
    r = publish(plain, "dana", memory, facts, lineage, embeddings=False)
    want = hydrate(plain, "dana", "fp-test", device="cpu")
    got = hydrate(direct, "dana", "fp-test", device="cpu")
    assert torch.equal(got.slab.view(torch.uint8), want.slab.view(torch.uint8))
    reader = FactReader(direct, "fp-test")
    index = reader.index("dana", r.version)
    picked = list(want.index)[::-2]
    out = torch.empty(index.tokens(picked) * index.row_bytes, dtype=torch.uint8)
    rows = reader.read(index, picked, out)
    assert torch.equal(rows, torch.cat([want.chunk(c) for c in picked]))
    counts = read_counts()
    assert counts[DIRECT]["bytes"] == 0 and counts[FALLBACK]["bytes"] > 0, counts
    print("fallback ok", counts[FALLBACK])
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ramfs: Linux")
def test_hydration_and_fact_reads_on_ramfs_fall_back_byte_identical(tmp_path, child_env):
    """ramfs refuses O_DIRECT: a store there with direct I/O still hydrates and reads
    single facts byte-identically, and counts every byte as read by the fallback. ramfs
    is mounted in a private mount namespace (needs unshare and CAP_SYS_ADMIN)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare to mount a ramfs privately")
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    wrap = [unshare, "--mount", "--propagation", "private", "sh", "-c",
            'mount -t ramfs ramfs "$0" && exec "$@"', str(mnt)]
    probe = subprocess.run(wrap + ["true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private ramfs here: {probe.stderr.strip()[:200]}")
    child = subprocess.run(wrap + [sys.executable, "-c", RAMFS_CHILD, str(mnt)],
                           capture_output=True, text=True, env=child_env, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "fallback ok" in child.stdout
