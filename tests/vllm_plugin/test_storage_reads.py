"""The worker's reads of non-resident users' facts (no engine: a real local store, the
real reader and resident store): success, token checks, failures, cancellation,
prefetches adopted by their requests or dropped, deadlines, and the staging memory
always given back."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from builders import make_inputs
from inferscale.artifacts.publish import publish
from inferscale.hydrate.fact_reader import FactReader
from inferscale.hydrate.slab import hydrate
from inferscale.hydrate.store import ResidentStore
from inferscale.vllm_plugin.storage_reads import PHASES, StorageReads
from inferscale.vllm_plugin.metadata import FetchSpec

FP = "fp-test"


def setup(local_store, dtype=torch.bfloat16, **store_kw):
    memory, facts, lineage = make_inputs("ann", 6, dtype=dtype)
    version = publish(local_store, "ann", memory, facts, lineage, embeddings=False).version
    store = ResidentStore("cpu", 1 << 20, 1 << 20, dtype=torch.float32, **store_kw)
    fetches = StorageReads(store, FactReader(local_store, FP), FP, timeout_s=5)
    whole = hydrate(local_store, "ann", FP)
    return store, fetches, whole, version


def spec(whole, version, chunks, start=0, req="r1", expected=None):
    tokens = [t for c in chunks for t in whole.token_ids[c]]
    end = len(tokens)
    return FetchSpec(req, "ann", version, chunks, start, end, np.arange(start, end),
                     [0], expected if expected is not None else tokens[start:end])


def wait_done(fetches, n=1):
    out = []
    deadline = time.monotonic() + 30
    while len(out) < n:
        out += fetches.done()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return out


def test_a_read_gives_the_chunks_in_the_engine_dtype_and_layout(local_store):
    store, fetches, whole, version = setup(local_store)
    chunks = ["prefix", list(whole.index)[4], list(whole.index)[2]]
    fetches.submit(spec(whole, version, chunks))
    (got,) = wait_done(fetches)
    assert got.error is None and got.resident.tier == "storage"
    want = torch.cat([whole.chunk(c) for c in chunks]).float()
    assert torch.equal(got.resident.slab, want)
    assert got.resident.slab.permute(1, 2, 0, 3, 4).is_contiguous()  # CPU: layer-major
    assert got.nbytes == sum(whole.chunk(c).numel() * 2 for c in chunks)
    assert fetches.reads == 1 and fetches.bytes_read == got.nbytes
    stats = fetches.stats()  # the read's phases: the rows apart from the rest (o)
    assert stats["reads_timed"] == 1 and set(fetches.phase_s) == set(PHASES)
    assert all(s >= 0 for s in fetches.phase_s.values()) and fetches.phase_s["rows"] > 0
    assert stats["overhead_s"] == pytest.approx(
        sum(s for k, s in fetches.phase_s.items() if k != "rows"))
    store.release(got.resident.region)
    assert store._staging_used == {"host": 0, "gpu": 0}


def test_fp8_facts_are_dequantized_once_on_the_cpu(local_store):
    """fp8 facts read alone become the CPU engine's float32 with their own chunks'
    scales: exactly what the whole user dequantizes to."""
    store, fetches, whole, version = setup(local_store, torch.float8_e4m3fn)
    chunks = ["prefix", list(whole.index)[5], list(whole.index)[1]]
    fetches.submit(spec(whole, version, chunks))
    (got,) = wait_done(fetches)
    assert got.error is None and got.resident.scales is None
    want = torch.cat([whole.rows_float(torch.arange(o, o + n))
                      for o, n in (whole.index[c] for c in chunks)])
    assert got.resident.slab.dtype == torch.float32 and torch.equal(got.resident.slab, want)
    assert got.nbytes == sum(whole.chunk(c).numel() for c in chunks)  # one byte each
    store.release(got.resident.region)
    assert store._staging_used == {"host": 0, "gpu": 0}


def test_token_ids_that_differ_from_the_prompt_fail_the_read(local_store):
    store, fetches, whole, version = setup(local_store)
    chunks = ["prefix", list(whole.index)[1]]
    bad = spec(whole, version, chunks)
    bad.expected = [t + 1 for t in bad.expected]
    fetches.submit(bad)
    (got,) = wait_done(fetches)
    assert got.resident is None and "does not carry the memory's token ids" in got.error
    assert fetches.failures == 1 and store._staging_used == {"host": 0, "gpu": 0}


def test_missing_versions_and_chunks_fail_cleanly(local_store):
    store, fetches, whole, version = setup(local_store)
    fetches.submit(spec(whole, "0" * 32, ["prefix"], req="a"))
    s = spec(whole, version, ["prefix"], req="b")
    s.chunks = ["prefix", "no-such-fact"]
    fetches.submit(s)
    got = {g.spec.req_id: g for g in wait_done(fetches, 2)}
    assert "ArtifactNotFound" in got["a"].error and "KeyError" in got["b"].error
    assert store._staging_used == {"host": 0, "gpu": 0}


def test_a_forged_geometry_never_reaches_staging(local_store):
    """A version whose K/V were regrouped as ``[L, 2H, D/2]`` (same bytes per token, its
    publisher claiming that geometry): the reader of a worker refuses it from its
    manifest; and were a reader to hand such rows over, the store's check refuses them
    before they are placed in device staging memory. Both reported as failed reads
    (the request is recomputed), all staging memory given back."""
    from builders import regrouped
    from inferscale.types import KVGeometry

    geometry = KVGeometry(2, 2, 8)
    memory, facts, lineage = make_inputs("ann", 6, dtype=torch.bfloat16, seed=7)
    version = publish(local_store, "ann", regrouped(memory, claim=True), facts, lineage,
                      embeddings=False).version
    whole = hydrate(local_store, "ann", FP, version)
    store = ResidentStore("cpu", 1 << 20, 1 << 20, dtype=torch.float32, geometry=geometry)
    for reader, error in ((FactReader(local_store, FP, geometry=geometry), "GeometryMismatch"),
                          (FactReader(local_store, FP), "ResidencyError")):
        fetches = StorageReads(store, reader, FP, timeout_s=5)
        fetches.submit(spec(whole, version, ["prefix", list(whole.index)[2]]))
        (got,) = wait_done(fetches)
        assert got.resident is None and got.error.startswith(error), got.error
        assert "[L=2, H=2, D=8]" in got.error
        assert store._staging_used == {"host": 0, "gpu": 0}


def test_a_cancelled_read_returns_its_memory(local_store):
    store, fetches, whole, version = setup(local_store)
    fetches.submit(spec(whole, version, ["prefix", list(whole.index)[3]]))
    fetches.cancel({"r1", "unrelated"})
    (got,) = wait_done(fetches)
    assert got.error == "cancelled" and got.resident is None and fetches.failures == 0
    assert store._staging_used == {"host": 0, "gpu": 0}
    # timed like the latency histogram: only the reads handed over count
    assert fetches.latency.snapshot()["sum"] == 0 and fetches.timed_reads == 0
    assert fetches.stats()["overhead_s"] == 0.0


def test_a_read_larger_than_the_staging_reserve_fails(local_store):
    store, fetches, whole, version = setup(local_store, staging_bytes=64)
    fetches.submit(spec(whole, version, ["prefix", list(whole.index)[3]]))
    (got,) = wait_done(fetches)
    assert "staging reserve" in got.error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_reads_land_in_device_staging_memory(local_store):
    memory, facts, lineage = make_inputs("ann", 6, dtype=torch.bfloat16)
    version = publish(local_store, "ann", memory, facts, lineage, embeddings=False).version
    store = ResidentStore("cuda", 1 << 20, 1 << 20, dtype=torch.bfloat16)
    fetches = StorageReads(store, FactReader(local_store, FP), FP)
    whole = hydrate(local_store, "ann", FP)
    chunks = ["prefix", list(whole.index)[5]]
    fetches.submit(spec(whole, version, chunks))
    (got,) = wait_done(fetches)
    dev = store._arenas["gpu"].buffer
    slab = got.resident.slab
    assert got.error is None and slab.is_cuda and slab.is_contiguous()
    assert dev.data_ptr() <= slab.data_ptr() < dev.data_ptr() + dev.numel()
    assert torch.equal(slab.cpu(), torch.cat([whole.chunk(c) for c in chunks]))
    store.release(got.resident.region)
    assert store._staging_used == {"host": 0, "gpu": 0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_reads_stay_fp8_with_their_scales(local_store):
    memory, facts, lineage = make_inputs("ann", 6, dtype=torch.float8_e4m3fn)
    version = publish(local_store, "ann", memory, facts, lineage, embeddings=False).version
    store = ResidentStore("cuda", 1 << 20, 1 << 20, dtype=torch.bfloat16)
    fetches = StorageReads(store, FactReader(local_store, FP), FP)
    whole = hydrate(local_store, "ann", FP)
    chunks = [list(whole.index)[4], "prefix"]
    fetches.submit(spec(whole, version, chunks))
    (got,) = wait_done(fetches)
    r = got.resident
    assert got.error is None and r.slab.is_cuda and r.slab.dtype == torch.float8_e4m3fn
    assert torch.equal(r.slab.cpu().view(torch.uint8),
                       torch.cat([whole.chunk(c) for c in chunks]).view(torch.uint8))
    assert torch.equal(r.scales, torch.stack([whole.scales[whole.scale_pos(c)] for c in chunks]))
    assert r.scale_rows(chunks, 0, 3).tolist() == [0] * min(3, whole.index[chunks[0]][1])
    store.release(r.region)


# ---------------------------------------------------------------- prefetches and deadlines

def idle(fetches):
    """Wait until every read on the pool (adopted or dropped) has run to its end."""
    fetches._pool.shutdown(wait=True)


def test_a_request_adopts_the_prefetch_of_its_chunks_and_reads_once(local_store):
    store, fetches, whole, version = setup(local_store)
    chunks = ["prefix", list(whole.index)[2]]
    fetches.prefetch("ann", version, chunks, 5.0, nbytes=123)
    assert fetches.stats()["prefetch"]["started"] == 1 and fetches.pending == 1
    (read,) = fetches._prefetched[("ann", version, tuple(chunks))]
    read.future.result(30)  # finished before the scheduler's spec arrives
    assert fetches.done() == []  # nothing is handed over without its request
    fetches.submit(spec(whole, version, chunks))
    (got,) = fetches.done()  # at once: no second read
    assert got.error is None and got.spec.req_id == "r1"
    assert torch.equal(got.resident.slab, torch.cat([whole.chunk(c) for c in chunks]).float())
    assert fetches.prefetches["adopted"] == 1 and fetches.reader.bytes_read == got.nbytes
    stats = fetches.stats()
    assert stats["bytes"] == got.nbytes and stats["busy_s"] > 0 and stats["queued_bytes"] == 0
    store.release(got.resident.region)
    assert store._staging_used == {"host": 0, "gpu": 0} and fetches.pending == 0


def test_two_requests_of_the_same_chunks_adopt_one_prefetch_each(local_store):
    store, fetches, whole, version = setup(local_store)
    chunks = ["prefix", list(whole.index)[1]]
    for _ in range(2):
        fetches.prefetch("ann", version, chunks, 5.0)
    for req in ("a", "b"):
        fetches.submit(spec(whole, version, chunks, req=req))
    got = wait_done(fetches, 2)
    assert {g.spec.req_id for g in got} == {"a", "b"} and all(g.error is None for g in got)
    assert fetches.prefetches["adopted"] == 2 and fetches.reads == 2
    for g in got:
        store.release(g.resident.region)
    assert store._staging_used == {"host": 0, "gpu": 0}


def test_a_prefetch_no_request_adopts_is_dropped_after_its_deadline(local_store):
    store, fetches, whole, version = setup(local_store)
    fetches.keep_s = 0.0
    fetches.prefetch("ann", version, ["prefix", list(whole.index)[4]], 0.05)
    idle(fetches)
    assert store._staging_used["gpu"] > 0  # its facts wait in device staging memory
    time.sleep(0.06)
    assert fetches.done() == []
    assert fetches.prefetches["dropped"] == 1 and fetches.pending == 0
    assert store._staging_used == {"host": 0, "gpu": 0}


def test_a_read_past_its_deadline_is_failed_and_gives_its_memory_back(local_store):
    """One pool thread, held by a read waiting for staging room: the next read cannot
    start before its deadline, is reported failed (vLLM recomputes), and once it runs
    its staging memory is given back, as is that of a prefetch dropped while queued."""
    store, fetches, whole, version = setup(local_store)
    fetches._pool = ThreadPoolExecutor(1)
    fetches.keep_s = 0.0
    hold = store.staging(store.reserve["host"], 1, "host")  # no host staging room
    first = spec(whole, version, ["prefix"], req="first")
    fetches.submit(first)  # waits for room, up to 10 s
    late = spec(whole, version, ["prefix", list(whole.index)[3]], req="late")
    late.deadline_s = 0.05
    fetches.submit(late)
    fetches.prefetch("ann", version, ["prefix", list(whole.index)[5]], 0.05)
    time.sleep(0.1)
    (got,) = fetches.done()
    assert got.spec.req_id == "late" and got.resident is None
    assert got.error.startswith("read from storage not done within its 0.05 s")
    assert fetches.failures == 1 and fetches.prefetches["dropped"] == 1
    store.release(hold)
    (ok,) = wait_done(fetches)
    assert ok.spec.req_id == "first" and ok.error is None
    store.release(ok.resident.region)
    idle(fetches)
    assert store._staging_used == {"host": 0, "gpu": 0}


def test_a_read_without_time_left_fails_at_once(local_store):
    store, fetches, whole, version = setup(local_store)
    s = spec(whole, version, ["prefix"])
    s.deadline_s = 0.0
    fetches.submit(s)
    (got,) = fetches.done()
    assert got.error == "no time left for a read" and fetches.reader.bytes_read == 0


def test_a_primed_index_is_read_in_the_background_and_spares_the_first_read(
        local_store, caplog):
    """``prime`` (an admin hydrate of the user's facts alone) reads the version's chunk
    index on a thread of its own: the user's first read then reads no index (its
    ``index`` phase is the cache's lookup). A version that cannot be read is logged, not
    raised: the request's own read reports it. Without a reader nothing is primed."""
    store, fetches, whole, version = setup(local_store)
    reads, real = [], fetches.reader._read_index

    def counted(user, v):
        reads.append((user, v))
        return real(user, v)

    fetches.reader._read_index = counted
    assert fetches.prime("ann", version) is True
    fetches._priming.shutdown(wait=True)
    assert reads == [("ann", version)]
    assert (fetches.status()["priming"], fetches.status()["primed"]) == (0, 1)
    fetches.submit(spec(whole, version, ["prefix", list(whole.index)[3]]))
    (got,) = wait_done(fetches)
    assert got.error is None and reads == [("ann", version)]  # the index came cached
    store.release(got.resident.region)

    _, other, _, _ = setup(local_store)
    other.prime("ann", "f" * 32)
    other._priming.shutdown(wait=True)
    assert "priming user ann version ffffffffffff's chunk index failed" in caplog.text
    assert StorageReads(store, None, FP).prime("ann", version) is False


def test_a_busy_period_counts_its_time_and_bytes_together(local_store):
    """A report in the middle of reads holds neither their time nor their bytes: the
    server's bandwidth, bytes over busy seconds between reports, never sees a read's
    bytes over only the end of its time (overlapping reads: one period)."""
    _, fetches, _, _ = setup(local_store)
    first, second = fetches._reading(100), fetches._reading(50)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert (fetches.stats()["bytes"], fetches.stats()["busy_s"]) == (0, 0.0)  # still busy
    second.__exit__(None, None, None)
    stats = fetches.stats()
    assert stats["bytes"] == 150 and stats["busy_s"] > 0
    failed = fetches._reading(70)
    failed.__enter__()
    failed.__exit__(OSError, OSError("disk"), None)  # a failed read: its time, no bytes
    assert fetches.stats()["bytes"] == 150 and fetches.stats()["busy_s"] > stats["busy_s"]
