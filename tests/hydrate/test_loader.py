"""Loading published artifacts into the worker's resident store (no engine): admin loads,
background reloads and their failures, admin evictions, fingerprint checks."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from builders import expected_slab, make_inputs
from inferscale.artifacts.publish import publish
from inferscale.hydrate.loader import ResidentLoader, Throttle
from inferscale.hydrate.store import ResidentStore

FP = "fp-test"


def _loader(store=None, fp=FP) -> ResidentLoader:
    return ResidentLoader(ResidentStore("cpu", 1 << 30, 1 << 30), fp,
                          store.root if store else "", store.storage_options if store else {})


def _wait(condition, seconds: float = 60.0):
    """Poll until ``condition()`` is truthy (a background thread's work), or fail."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("the background reload never finished")


@pytest.fixture
def published(store):
    memory, facts, lineage = make_inputs("ann", 3)
    return store, memory, publish(store, "ann", memory, facts, lineage, embeddings=False).version


def test_load_puts_the_verified_latest_version_into_the_tier(published):
    store, memory, version = published
    loader = _loader(store)
    resident = loader.load("ann", "latest", "host")
    assert (resident.user, resident.version, resident.tier) == ("ann", version, "host")
    assert resident.manifest.version == version and resident.fingerprint == FP
    assert torch.equal(resident.slab, expected_slab(memory))
    assert loader.store.get("ann", version) is resident
    assert loader.reloads == 0


def test_a_slab_of_another_model_is_refused(published):
    store, _, _ = published
    resident = _loader(store).read("ann", "latest")
    with pytest.raises(ValueError, match="not the engine's"):
        _loader(store, fp="fp-other").put(resident, "gpu")


def test_background_reload_and_its_failures(published):
    store, _, version = published
    loader = _loader(store)
    loader.reload_in_background("ann", version, "gpu")
    _wait(lambda: loader.store.get("ann", version))
    assert loader.reloads == 1 and loader.store.get("ann", version).tier == "gpu"
    loader.reload_in_background("ann", "0" * 32, "gpu")  # no such version
    (failed,) = _wait(loader.take_failures)
    assert failed[:2] == ("ann", "0" * 32) and "no such version" in failed[2]
    assert loader.take_failures() == []  # taken once
    nowhere = _loader()
    with pytest.raises(RuntimeError, match="no artifact_root"):
        nowhere.load("ann")
    nowhere.reload_in_background("ann", version, "gpu")
    assert "no artifact_root" in _wait(nowhere.take_failures)[0][2]


def test_an_admin_eviction_stops_reloads_until_the_next_load(published):
    store, _, version = published
    loader = _loader(store)
    loader.load("ann", version, "gpu")
    assert loader.evict("ann") and loader.store.get("ann", version) is None
    loader.reload_in_background("ann", version, "gpu")
    assert loader.take_failures() == [("ann", version, "evicted by an admin")]
    assert loader.store.get("ann", version) is None
    loader.load("ann", version, "gpu")  # an admin hydration lifts the eviction
    assert "ann" not in loader.admin_evicted and loader.store.get("ann", version) is not None


def test_a_rank_loads_its_heads_and_skips_a_reload_of_what_it_holds(published):
    """Under tensor parallelism (rank 0 of 2: head 0 of 2) the verified artifact is cut to
    the rank's heads and admitted by the size of its share (the budget holds half the
    slab); a reload the scheduler orders for a version the rank already holds reads
    nothing."""
    from inferscale.hydrate.resident import HeadShard
    from inferscale.hydrate.slab import READS

    store, memory, version = published
    slab = expected_slab(memory)
    whole = slab.numel() * slab.element_size()  # bytes of every head
    loader = ResidentLoader(ResidentStore("cpu", whole // 2, 0, heads=HeadShard(0, 1, 2)),
                            FP, store.root, store.storage_options)
    resident = loader.load("ann", version, "gpu")
    want = slab[:, :, :, 0:1]
    assert torch.equal(resident.slab, want) and resident.slab.shape[3] == 1
    assert resident.tier == "gpu" and resident.nbytes == whole // 2
    before = dict(READS)
    loader.reload_in_background("ann", version, "gpu")
    time.sleep(0.5)  # a reload of this tiny artifact would have finished by now
    assert READS == before and loader.take_failures() == [] and loader.reloads == 0
    assert loader.store.get("ann", version) is resident


def test_loads_and_reloads_read_with_direct_io_when_asked(local_store):
    """The loader builds its store with ``direct_io``: admin loads and background reloads
    then read kv.arrow around the page cache (counted by that reader), same slab."""
    from inferscale.artifacts.direct_io import DIRECT, FALLBACK, read_counts, supports_direct_io

    store = local_store
    memory, facts, lineage = make_inputs("ann", 3)
    version = publish(store, "ann", memory, facts, lineage, embeddings=False).version
    loader = ResidentLoader(ResidentStore("cpu", 1 << 30, 1 << 30), FP, store.root,
                            store.storage_options, direct_io=True)
    reader = DIRECT if supports_direct_io(store.root) else FALLBACK
    before = read_counts()[reader]["reads"]
    assert torch.equal(loader.load("ann", version, "gpu").slab, expected_slab(memory))
    loaded = read_counts()[reader]["reads"]
    assert loaded > before
    loader.evict("ann")
    loader.load("ann", version, "host")  # an admin load lifts the eviction
    loader.store.evict("ann")
    loader.reload_in_background("ann", version, "host")
    _wait(lambda: loader.reloads == 1)
    assert read_counts()[reader]["reads"] > loaded


def test_a_slab_over_every_budget_is_refused_before_it_is_read(published):
    """Admin loads and background reloads check the manifest's size against the budgets
    first: nothing of kv.arrow is read, the refusal is counted once per reload."""
    from inferscale.hydrate.resident import ResidencyError
    from inferscale.hydrate.slab import READS

    store, _, version = published
    loader = ResidentLoader(ResidentStore("cpu", 0, 64), FP, store.root, store.storage_options)
    before = dict(READS)
    with pytest.raises(ResidencyError, match="exceed the gpu budget"):
        loader.load("ann", version, "gpu")
    loader.reload_in_background("ann", version, "host")
    (failed,) = _wait(loader.take_failures)
    assert "exceed the host budget" in failed[2] and loader.reload_failures == 1
    assert READS == before and loader.store.get("ann", version) is None


def test_background_reloads_of_one_version_run_once_at_a_time(published):
    store, _, version = published
    loader = _loader(store)
    for _ in range(20):  # a burst of orders for the same user and version
        loader.reload_in_background("ann", version, "host")
    _wait(lambda: loader.store.get("ann", version))
    time.sleep(0.5)  # orders that were queued behind the first one find it resident
    assert loader.reloads == 1 and loader.take_failures() == []


def test_a_forged_geometry_is_refused_before_anything_is_read(store):
    """An artifact published under the model's fingerprint with its K/V regrouped as
    ``[L, 2H, D/2]`` (same bytes per token; its publisher claimed that geometry): an
    admin hydration and a background reload refuse it from its manifest, before any byte
    of its kv file is read or any staging memory taken; the user is never resident."""
    from builders import regrouped
    from inferscale.artifacts.layout import GeometryMismatch
    from inferscale.hydrate.slab import READS
    from inferscale.types import KVGeometry

    memory, facts, lineage = make_inputs("eve", 3, layers=2, heads=2, head_dim=8)
    forged = publish(store, "eve", regrouped(memory, claim=True), facts, lineage,
                     embeddings=False).version
    res = ResidentStore("cpu", 1 << 30, 1 << 30, geometry=KVGeometry(2, 2, 8))
    loader = ResidentLoader(res, FP, store.root, store.storage_options)
    reads = dict(READS)
    with pytest.raises(GeometryMismatch, match=r"\[L=2, H=4, D=4\] is not the serving model's "
                                               r"\[L=2, H=2, D=8\]"):
        loader.load("eve", forged)
    loader.reload_in_background("eve", forged, "gpu")
    (failure,) = _wait(loader.take_failures)
    assert failure[:2] == ("eve", forged) and "GeometryMismatch" in failure[2]
    assert READS == reads and res.held("eve") is None
    assert res._staging_used == {"host": 0, "gpu": 0}
    # the model's own geometry loads
    memory, facts, lineage = make_inputs("eve", 3, layers=2, heads=2, head_dim=8, seed=4)
    good = publish(store, "eve", memory, facts, lineage, embeddings=False).version
    assert loader.load("eve", good).version == good


def test_a_reload_part_waits_while_requests_read_their_facts_then_goes_on():
    """The reloads' throttle yields to reads of facts for waiting requests (``yield_to``:
    the worker's StorageReads.busy), and goes on once they are done."""
    import threading

    from inferscale.hydrate.loader import Throttle

    busy = threading.Event()
    busy.set()
    throttle = Throttle(0, yield_to=busy.is_set, max_yield_s=60.0)
    done = threading.Event()
    reader = threading.Thread(target=lambda: (throttle.take(1 << 20), done.set()))
    reader.start()
    assert not done.wait(0.3)  # held back while the requests' reads run
    busy.clear()
    assert done.wait(30.0)
    reader.join()
    assert throttle.yielded_s >= 0.3


def test_a_reload_is_held_back_at_most_max_yield_per_part():
    from inferscale.hydrate.loader import Throttle

    throttle = Throttle(0, yield_to=lambda: True, max_yield_s=0.05)
    throttle.take(1)  # returns though the requests' reads never end
    throttle.take(1)
    assert throttle.yielded_s >= 0.1


class _Reads:
    """The real reads of kv.arrow as they run (wrapped, not replaced): their lengths, how
    many started and how many ran at once at most."""

    def __init__(self):
        self.lock = threading.Lock()
        self.lengths: list[int] = []
        self.active = self.most = 0

    def wrap(self, read):
        def counted(*args):  # (offset, n, into) of a range read; (address, n) of a populate
            with self.lock:
                self.lengths.append(args[1])
                self.active += 1
                self.most = max(self.most, self.active)
            try:
                return read(*args)
            finally:
                with self.lock:
                    self.active -= 1
        return counted


class _Yielding(Throttle):
    """The reloads' throttle while requests' reads of facts never end: it pauses every
    part (``max_yield_s``) and notes, after each pause, how many parts past the ones it
    was handed the reload had started reading meanwhile."""

    def __init__(self, reads: _Reads):
        super().__init__(0, yield_to=lambda: True, max_yield_s=0.02)
        self.reads, self.parts, self.read_ahead = reads, [], []

    def take(self, nbytes: int) -> None:
        super().take(nbytes)
        self.parts.append(nbytes)
        self.read_ahead.append(len(self.reads.lengths) - len(self.parts))


@pytest.mark.parametrize("path", ["mapped", "direct", "s3"])
def test_a_reload_reads_small_parts_one_at_a_time_an_admin_load_large_ones(
        path, request, monkeypatch):
    """A background reload reads ``reload_part_bytes`` parts, one at a time, and while its
    throttle pauses for requests' reads at most the next part is read; so at most
    ``reload_workers x reload_part_bytes`` of reload I/O is queued ahead of a request's
    read. An admin load of the same user reads it in one 32 MiB-sized part. Whichever way
    the store is read: memory-mapped (a local store, no CUDA), ``O_DIRECT``, S3."""
    from dataclasses import replace

    from inferscale.artifacts import mapped_file
    from inferscale.artifacts.blobs import LocalBlobs, Location
    from inferscale.artifacts.object_store import FsspecBlobs
    from inferscale.artifacts.read import manifest_at

    store = request.getfixturevalue("s3_store" if path == "s3" else "local_store")
    store = replace(store, direct_io=path == "direct")
    memory, facts, lineage = make_inputs("ann", 12, layers=4, heads=4, head_dim=32)
    version = publish(store, "ann", memory, facts, lineage, embeddings=False).version
    size = manifest_at(Location(store, "ann", FP), version).files["kv.arrow"].bytes
    part = 16 << 10
    assert size > 4 * part  # several parts

    reads = _Reads()
    if path == "mapped":
        import mmap

        import numpy as np

        populate, page = mapped_file._populate(), mmap.mmap(-1, mmap.PAGESIZE)
        if populate is None or not populate(np.frombuffer(page, np.uint8).ctypes.data,
                                            mmap.PAGESIZE):  # Linux < 5.14, other OSes
            pytest.skip("no MADV_POPULATE_READ here: the mapped read has no reads to count")
        monkeypatch.setattr(mapped_file, "_populate", lambda: reads.wrap(populate))
    else:
        for blobs in (LocalBlobs, FsspecBlobs):
            def range_reader(self, file, real=blobs._range_reader):
                read, close = real(self, file)
                return reads.wrap(read), close
            monkeypatch.setattr(blobs, "_range_reader", range_reader)
    loader = ResidentLoader(ResidentStore("cpu", 1 << 30, 1 << 30), FP, store.root,
                            store.storage_options, direct_io=store.direct_io,
                            reload_part_bytes=part)
    assert torch.equal(loader.load("ann", version, "host").slab, expected_slab(memory))
    assert reads.lengths == [size]  # an admin load: one part (32 MiB) holds the file

    loader.store.evict("ann")
    reads.lengths.clear()
    loader.throttle = throttle = _Yielding(reads)
    loader.reload_in_background("ann", version, "host")
    _wait(lambda: loader.reloads == 1)
    assert torch.equal(loader.store.get("ann", version).slab, expected_slab(memory))
    assert loader.take_failures() == []
    assert throttle.parts == [min(part, size - o) for o in range(0, size, part)]
    assert reads.lengths == throttle.parts  # each part read once, in order
    assert reads.most == 1  # one part in flight
    assert max(throttle.read_ahead) <= 1  # the next part at most, while it paused


def test_a_reload_part_size_must_be_positive():
    with pytest.raises(ValueError, match="reload_part_bytes"):
        ResidentLoader(ResidentStore("cpu", 1 << 20, 1 << 20), FP, reload_part_bytes=0)
