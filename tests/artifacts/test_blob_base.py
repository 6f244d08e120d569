"""The windowed file object of small random reads (``Blobs.open_read``): the bytes of
any sequence of seeks and reads are the file's, a read inside a held window costs no
read of the file, and an Arrow footer plus a few columns lying together cost two."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.artifacts.blob_base import WindowedFile

DATA = np.random.default_rng(3).integers(0, 256, 300_000, dtype=np.uint8).tobytes()


def over(data: bytes, **kw) -> tuple[WindowedFile, list[tuple[int, int]]]:
    """A WindowedFile over ``data`` whose underlying reads are recorded."""
    reads: list[tuple[int, int]] = []

    def read(offset: int, n: int, into):
        reads.append((offset, n))
        if offset + n > len(data):
            raise ValueError("read past the end")
        if into is None:
            return data[offset:offset + n]
        into[:] = data[offset:offset + n]
        return into

    return WindowedFile(read, lambda: reads.append((-1, -1)), len(data), **kw), reads


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([io.SEEK_SET, io.SEEK_CUR, io.SEEK_END]),
                          st.integers(-400_000, 400_000), st.integers(0, 120_000)),
                max_size=12),
       st.integers(1, 70_000), st.integers(1, 9_000))
def test_any_seeks_and_reads_give_the_files_bytes(ops, window, tail):
    f, _ = over(DATA, window=window, tail=tail)
    plain = io.BytesIO(DATA)
    for whence, offset, n in ops:
        target = {io.SEEK_SET: 0, io.SEEK_CUR: plain.tell(), io.SEEK_END: len(DATA)}[whence] \
            + offset
        if target < 0:  # refused, as a file's lseek refuses it
            with pytest.raises(ValueError):
                f.seek(offset, whence)
            continue
        assert f.seek(offset, whence) == plain.seek(target)
        assert f.read(n) == plain.read(n) and f.tell() == plain.tell()


def test_reads_inside_a_window_cost_no_read_and_large_reads_go_straight():
    f, reads = over(DATA, window=65_536, tail=8192)
    f.seek(len(DATA) - 10)
    f.read(10)  # the footer's length and magic: the tail window
    f.seek(len(DATA) - 3000)
    f.read(2990)
    assert reads == [(len(DATA) - 8192, 8192)]
    f.seek(5000)
    f.read(100)  # a window from the 4 KiB block below
    f.seek(30_000)
    f.read(30_000)
    assert reads[1:] == [(4096, 65_536)] and f.reads == 2
    f.seek(len(DATA) - 50)
    f.read(50)  # the tail window is still held (the last two are kept)
    assert f.reads == 2
    f.seek(100_000)
    assert len(f.read(70_000)) == 70_000  # at least a window: read into the caller's buffer
    assert reads[-1] == (100_000, 70_000)
    f.close()
    assert reads[-1] == (-1, -1) and f.closed


def test_an_arrow_footer_and_columns_that_lie_together_cost_two_reads():
    """A kv-like file: small index columns first, a large column after; reading the
    small ones by projection reads the footer's window and one window of columns."""
    n = 400
    table = pa.table({"chunk_id": [f"f{i}" for i in range(n)],
                      "offset": np.arange(n, dtype=np.int64),
                      "scales": pa.FixedSizeListArray.from_arrays(
                          pa.array(np.ones(n * 512, dtype=np.float32)), 512),
                      "slab": [b"\0" * 20_000] * n})
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    data = sink.getvalue()
    f, reads = over(data, window=2 << 20, tail=64 << 10)
    reader = pa.ipc.open_file(pa.PythonFile(f, mode="r"),
                              options=pa.ipc.IpcReadOptions(included_fields=[0, 1, 2]))
    batch = reader.get_batch(0)
    assert batch.column("chunk_id").to_pylist()[-1] == f"f{n - 1}"
    assert f.reads == 2 and sum(k for _, k in reads) < len(data) / 2, reads
