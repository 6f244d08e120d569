"""The storage tier's bandwidth, measured in the load benchmark's own run with the reader
its server uses (:mod:`inferscale.artifacts.direct_io`).

``benchmarks.load`` serves many users whose memory groups share KV files on disk (hard
links: a machine stores ``groups`` slabs, not ``users``). Sharing bytes between users is
fair only because every read bypasses the page cache: read through it, the second user
of a group would be served from RAM (7 GB/s on the H200 machine, against 1.1-1.9 GB/s
from its disk), and "storage" would mean memory. So the server reads its store with
``O_DIRECT`` (``ConnectorConfig.direct_io``), and before the scenarios this module reads
the users' distinct KV files (each inode once) the same way:

- ``sequential``: one stream of large reads (``block``, 32 MiB) in file order, file
  after file: what ``dd`` measures (a whole-user hydration reads the same parts, 4 at a
  time);
- ``random_8mib``: 8 MiB reads at random 4 KiB-aligned offsets of random files,
  ``threads`` at once (8: the connector's ``fetch_workers``): the shape of the single
  facts a cold request reads.

Each pattern stops after ``seconds`` or ``max_bytes``, whichever comes first. Reads land
in page-aligned buffers, so what is timed is the disk, not a copy. The result
(:func:`measure`) goes into every result file under ``storage``; :func:`refuse_unbypassed`
stops the run when bypass was asked for and the filesystem refused ``O_DIRECT`` (the
reader's fallback drops pages after reading them, but they were cached meanwhile: that is
not a measurement of storage), and :func:`with_server_reads` adds what the server's
workers read by reader, so a result claims ``page_cache_bypassed`` only when the
measurement and every read of the server bypassed it.
"""

from __future__ import annotations

import mmap
import random
import threading
import time
from pathlib import Path

from inferscale.artifacts.direct_io import (
    ALIGN, BUFFERED, DIRECT, FALLBACK, DirectFile, supports_direct_io,
)

RANDOM_BLOCK = 8 << 20
RANDOM_KEY = "random_8mib"


class StorageNotBypassed(RuntimeError):
    """Bypassing the page cache was asked for and the filesystem refused it."""


def kv_files(root: str | Path) -> list[str]:
    """The distinct KV files (``kv.<nonce>.arrow``) under ``root``: one path per inode
    (hard-linked users of a group count once), sorted."""
    seen: dict[tuple[int, int], str] = {}
    for path in sorted(Path(root).rglob("kv.*.arrow")):
        st = path.stat()
        seen.setdefault((st.st_dev, st.st_ino), str(path))
    return sorted(seen.values())


def measure(paths: list[str], *, direct: bool = True, seconds: float = 3.0,
            max_bytes: int = 2 << 30, block: int = 32 << 20, threads: int = 8,
            seed: int = 0) -> dict:
    """Sequential and random 8 MiB read bandwidth over ``paths`` (see the module
    docstring) with :class:`~inferscale.artifacts.direct_io.DirectFile` (``direct``:
    around the page cache; False: through it). Bytes per second, the reader, whether
    the page cache was bypassed, the bytes and seconds measured."""
    if not paths:
        raise ValueError("no KV files to measure")
    if block < ALIGN or block % ALIGN or threads < 1 or seconds <= 0 or max_bytes <= 0:
        raise ValueError("block must be a multiple of 4096; threads, seconds and max_bytes > 0")
    files = [DirectFile(p, direct) for p in paths]
    try:
        sizes = [f.size for f in files]
        if not any(sizes):
            raise ValueError("the KV files are empty")
        seq = _sequential(files, block, seconds, max_bytes)
        rnd = _random(files, threads, seconds, max_bytes, random.Random(seed))
        readers = sorted({f.reader for f in files})
    finally:
        for f in files:
            f.close()
    patterns = {"sequential": {**seq, "block_bytes": block, "threads": 1},
                RANDOM_KEY: {**rnd, "block_bytes": RANDOM_BLOCK, "threads": threads}}
    return {
        "bandwidth_bytes_per_s": {k: round(v["bytes"] / v["seconds"]) if v["seconds"] else None
                                  for k, v in patterns.items()},
        "page_cache_bypassed": readers == [DIRECT],
        "reader": "+".join(readers),
        "bytes_measured": seq["bytes"] + rnd["bytes"],
        "seconds": round(seq["seconds"] + rnd["seconds"], 3),
        "files": len(paths), "file_bytes": sum(sizes), "patterns": patterns,
    }


def _sequential(files: list[DirectFile], block: int, seconds: float, max_bytes: int) -> dict:
    buf = memoryview(mmap.mmap(-1, block))  # page-aligned: O_DIRECT reads land in it
    done = reads = 0
    t0 = time.perf_counter()
    for f in files:
        for offset in range(0, f.size, block):
            n = min(block, f.size - offset)
            f.read(offset, n, buf[:n])
            done, reads = done + n, reads + 1
            if done >= max_bytes or time.perf_counter() - t0 >= seconds:
                return _took(done, reads, t0)
    return _took(done, reads, t0)


def _random(files: list[DirectFile], threads: int, seconds: float, max_bytes: int,
            rng: random.Random) -> dict:
    weights = [f.size for f in files]
    lock = threading.Lock()
    total = {"bytes": 0, "reads": 0}
    t0 = time.perf_counter()

    def pick() -> tuple[DirectFile, int, int] | None:
        with lock:
            if total["bytes"] >= max_bytes or time.perf_counter() - t0 >= seconds:
                return None
            f = rng.choices(files, weights)[0]
            n = min(RANDOM_BLOCK, f.size)
            offset = rng.randrange(0, f.size - n + 1) // ALIGN * ALIGN
            total["bytes"] += n
            total["reads"] += 1
            return f, offset, n

    def worker() -> None:
        buf = memoryview(mmap.mmap(-1, RANDOM_BLOCK))
        while (job := pick()) is not None:
            f, offset, n = job
            f.read(offset, n, buf[:n])

    pool = [threading.Thread(target=worker, name=f"storage-bw-{i}") for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return _took(total["bytes"], total["reads"], t0)


def _took(nbytes: int, reads: int, t0: float) -> dict:
    return {"bytes": nbytes, "reads": reads, "seconds": round(time.perf_counter() - t0, 4)}


def refuse_unbypassed(where: str | Path, direct: bool, measured: dict | None = None) -> None:
    """:class:`StorageNotBypassed` when ``direct`` asks to bypass the page cache and the
    filesystem under ``where`` (a folder: probed) or the ``measured`` files refused it."""
    if not direct:
        return
    if measured is None and supports_direct_io(str(where)):
        return
    if measured is not None and measured["page_cache_bypassed"]:
        return
    got = measured["reader"] if measured is not None else FALLBACK
    raise StorageNotBypassed(
        f"the filesystem of {where} refuses O_DIRECT (reads would be {got}, through the "
        "page cache): put --workdir on a disk filesystem (ext4, xfs), or pass "
        "--no-storage-direct-io and the results say page_cache_bypassed: false")


def server_reads(engine_status: dict) -> dict[str, dict[str, int]]:
    """The workers' reads by reader (``storage_reads`` of the engine's status), summed
    over tensor-parallel ranks."""
    ranks = engine_status.get("ranks") or [engine_status]
    out: dict[str, dict[str, int]] = {}
    for rank in ranks:
        for reader, counts in (rank.get("storage_reads") or {}).items():
            mine = out.setdefault(reader, {})
            for k, v in counts.items():
                mine[k] = mine.get(k, 0) + v
    return out


def with_server_reads(measured: dict, engine_status: dict) -> dict:
    """``measured`` with the server's reads by reader (since it started); bypass is
    claimed only if the measurement had it, the server read with ``O_DIRECT`` (a store
    without direct I/O counts nothing) and none of its reads went through the page
    cache."""
    reads = server_reads(engine_status)
    cached = sum(reads.get(r, {}).get("bytes", 0) for r in (FALLBACK, BUFFERED))
    direct = reads.get(DIRECT, {}).get("bytes", 0)
    return {**measured, "server_reads": reads,
            "page_cache_bypassed": bool(measured["page_cache_bypassed"]) and direct > 0
            and cached == 0}
