"""The load benchmark's storage measurement (``benchmarks.lib.load.storage_bandwidth``):
the users' distinct KV files, both read patterns with the serving reader, the refusal to
claim a bypass that was not had, and the server's reads by reader. No timed assertion:
the figures are only checked to be measured."""

from __future__ import annotations

import os

import numpy as np
import pytest

from benchmarks.lib.load import storage_bandwidth as sb
from inferscale.artifacts.direct_io import BUFFERED, DIRECT, FALLBACK, supports_direct_io


@pytest.fixture
def kv_root(tmp_path):
    """Two groups' KV files, one of them hard-linked into a second user's folder."""
    rng = np.random.default_rng(0)
    a = tmp_path / "users" / "u0" / "fp" / "v0" / "kv.aaaa.arrow"
    b = tmp_path / "users" / "u1" / "fp" / "v1" / "kv.bbbb.arrow"
    linked = tmp_path / "users" / "u2" / "fp" / "v2" / "kv.aaaa.arrow"
    for path, size in ((a, (9 << 20) + 123), (b, 300_000)):
        path.parent.mkdir(parents=True)
        path.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    linked.parent.mkdir(parents=True)
    os.link(a, linked)
    (a.parent / "facts.aaaa.arrow").write_bytes(b"not kv")
    return tmp_path


def test_hard_linked_kv_files_count_once(kv_root):
    files = sb.kv_files(kv_root)
    assert len(files) == 2 and all(os.path.basename(f).startswith("kv.") for f in files)
    assert {os.stat(f).st_size for f in files} == {(9 << 20) + 123, 300_000}


def test_both_patterns_measure_the_files_with_the_serving_reader(kv_root):
    files = sb.kv_files(kv_root)
    out = sb.measure(files, seconds=5, max_bytes=12 << 20, block=1 << 20, threads=3)
    bypassed = supports_direct_io(files[0])
    assert out["reader"] == (DIRECT if bypassed else FALLBACK)
    assert out["page_cache_bypassed"] is bypassed
    assert set(out["bandwidth_bytes_per_s"]) == {"sequential", "random_8mib"}
    assert all(v > 0 for v in out["bandwidth_bytes_per_s"].values())
    seq, rnd = out["patterns"]["sequential"], out["patterns"]["random_8mib"]
    assert seq["bytes"] > 0 and rnd["bytes"] > 0 and rnd["threads"] == 3
    assert out["bytes_measured"] == seq["bytes"] + rnd["bytes"] and out["seconds"] > 0
    assert out["files"] == 2 and out["file_bytes"] == (9 << 20) + 123 + 300_000
    sb.refuse_unbypassed(kv_root, bypassed, out)  # what was had is not refused
    with pytest.raises(ValueError, match="no KV files"):
        sb.measure([])


def test_a_bypass_that_was_not_had_is_refused(kv_root):
    """Bypass asked for, reads that went through the page cache: a clear error; not
    asked for, the result says so and nothing is refused."""
    cached = sb.measure(sb.kv_files(kv_root), direct=False, seconds=1, max_bytes=1 << 20,
                        block=1 << 20, threads=2)
    assert cached["reader"] == BUFFERED and cached["page_cache_bypassed"] is False
    with pytest.raises(sb.StorageNotBypassed, match="refuses O_DIRECT.*--no-storage-direct-io"):
        sb.refuse_unbypassed(kv_root, True, cached)
    sb.refuse_unbypassed(kv_root, False, cached)
    with pytest.raises(sb.StorageNotBypassed, match="/proc"):
        sb.refuse_unbypassed("/proc/version", True)  # procfs refuses O_DIRECT (probed)


def test_the_result_claims_bypass_only_when_every_server_read_had_it():
    measured = {"page_cache_bypassed": True, "reader": DIRECT}
    direct = {DIRECT: {"files": 2, "reads": 5, "bytes": 100}}
    fallback = {FALLBACK: {"files": 1, "reads": 1, "bytes": 7}}
    assert sb.with_server_reads(measured, {"storage_reads": direct})["page_cache_bypassed"]
    two_ranks = {"ranks": [{"storage_reads": direct}, {"storage_reads": {**direct, **fallback}}]}
    out = sb.with_server_reads(measured, two_ranks)
    assert out["server_reads"][DIRECT]["bytes"] == 200 and not out["page_cache_bypassed"]
    assert not sb.with_server_reads(measured, {})["page_cache_bypassed"]  # nothing counted
    assert not sb.with_server_reads({**measured, "page_cache_bypassed": False},
                                    {"storage_reads": direct})["page_cache_bypassed"]
