"""The worker's reads of non-resident users' facts, one per waiting request.

The scheduler admits a request whose user is in neither tier as an asynchronous load
(:class:`~inferscale.vllm_plugin.metadata.FetchSpec`): vLLM keeps it waiting, with its
blocks allocated, until the worker reports it finished. :class:`StorageReads` runs each
read on a small thread pool, off the engine's thread: the version's chunk index, the rows
of just those chunks into the store's pinned staging reserve
(:class:`~inferscale.hydrate.fact_reader.FactReader`, which refuses a version of another
fingerprint or geometry than the model's from its manifest), checked as the store checks
every slab, and one copy into its device staging reserve in the engine's dtype and layout
(the rank's heads under tensor parallelism). Before a read is handed over, the chunks'
token ids are checked against the prompt's. What the engine's thread then does is what
it does for a resident user: one injection kernel reading device memory, in the next step.

**Prefetches.** The server knows a request's facts before the engine schedules it, so
it asks every worker to start reading them then (:meth:`StorageReads.prefetch`, the
``inferscale_prefetch`` RPC, sent ahead of the request): the read overlaps the request's
wait in vLLM's queue. A read is keyed by (user, version, chunks); the request's
``FetchSpec`` adopts a prefetch of the same key, running or finished, instead of reading
again. A prefetch no request adopts is dropped ``keep_s`` after its deadline, its staging
memory given back. An admin hydrate of a user's facts alone primes the version's chunk
index (:meth:`StorageReads.prime`, on a thread of its own so that no request's read
queues behind it): that user's first read then spends its time on rows, not the index
(~14 ms on an idle H100 disk, ~38 ms under load).

A read that fails, cannot get staging memory, or is not done by its deadline
(``FetchSpec.deadline_s`` from the read's start, else ``timeout_s``) is reported as failed
(vLLM recomputes the request's memory); a request that finishes while its read runs (a
client that went away) has its read dropped when it completes. Every read is reported
finished exactly once, which is when vLLM frees the blocks it held. The reads' bytes and
the time the reader was busy are counted (:meth:`StorageReads.stats`): the server's
estimate of the storage bandwidth.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from inferscale.hydrate.fact_reader import FactReader
from inferscale.hydrate.resident import Resident
from inferscale.hydrate.store import ResidentStore
from inferscale.stats import Histogram, geometric
from inferscale.vllm_plugin.metadata import FetchSpec

log = logging.getLogger("vllm.inferscale.connector")  # printed in every engine process
FETCH_BUCKETS_S = geometric(0.001, 30.0, 1.5)
PREFETCH_OUTCOMES = ("started", "adopted", "dropped", "resident")
# a read's phases: the version's chunk index (cached after a user's first read), host
# staging memory, the rows from storage, their check and copy into device staging
PHASES = ("index", "stage", "rows", "place")

Key = tuple[str, str, tuple[str, ...]]  # user, version, chunks


@dataclass
class Fetched:
    """A finished read: the facts as a transient resident (its slab in device staging
    memory), or why there is none."""

    spec: FetchSpec | None
    resident: Resident | None = None
    error: str | None = None
    nbytes: int = 0  # read from storage
    phases: tuple[float, ...] = ()  # seconds by PHASES


@dataclass
class _Read:
    key: Key
    future: Future
    started: float  # time.monotonic()
    deadline: float
    nbytes: int  # expected until the read knows (for the bytes queued)
    spec: FetchSpec | None = None  # the request it is for (None: a prefetch not adopted)


class StorageReads:
    """Reads for waiting requests; :meth:`done` hands over the finished ones."""

    def __init__(self, store: ResidentStore, reader: FactReader | None, fingerprint: str,
                 timeout_s: float = 10.0, workers: int = 4, keep_s: float = 1.0):
        self.store, self.reader, self.fingerprint = store, reader, fingerprint
        self.timeout_s, self.keep_s = timeout_s, keep_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="inferscale-fetches")
        self._priming = ThreadPoolExecutor(1, thread_name_prefix="inferscale-index")
        self.priming = self.primed = 0  # chunk indexes being primed, and primed (or failed)
        self._running: dict[str, _Read] = {}  # request id -> its read
        self._prefetched: dict[Key, list[_Read]] = {}  # not adopted yet, oldest first
        self._cancelled: set[str] = set()
        self.latency = Histogram(FETCH_BUCKETS_S)  # of the reads that succeeded
        self.reads = self.failures = self.bytes_read = 0
        self.prefetches = dict.fromkeys(PREFETCH_OUTCOMES, 0)
        self._row_bytes = 0  # of the last index read: sizes reads not started yet
        # the reader's busy time (at least one read of rows in progress) and its bytes, for
        # bandwidth, both counted when a busy period ends (the open period's bytes apart)
        self._busy = threading.Lock()
        self._active, self._busy_since, self.busy_s, self.busy_bytes = 0, 0.0, 0.0, 0
        self._period_bytes = 0
        # seconds of the reads handed over by phase (PHASES), and how many (those the
        # latency histogram counts): where a read's time goes besides the rows, and the
        # fixed part the split adds to bytes / B
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        self.timed_reads = 0

    # ------------------------------------------------------------------ starting reads

    def status(self) -> dict:
        """Reads done and failed, bytes read, reads pending, prefetches by outcome, chunk
        indexes being primed and primed."""
        return {"reads": self.reads, "failures": self.failures, "bytes": self.bytes_read,
                "pending": self.pending, "prefetches": dict(self.prefetches),
                "priming": self.priming, "primed": self.primed}

    def prefetch(self, user: str, version: str, chunks: list[str], deadline_s: float,
                 nbytes: int = 0) -> None:
        """Start reading ``chunks`` of ``user``'s ``version`` (about ``nbytes``) for a
        request the scheduler has not seen yet, to be adopted by its :meth:`submit`."""
        key = (user, version, tuple(chunks))
        self.expire()
        self._prefetched.setdefault(key, []).append(self._start(key, deadline_s, nbytes))
        self.prefetches["started"] += 1

    def prime(self, user: str, version: str) -> bool:
        """Read ``user``'s ``version`` chunk index into the reader's cache in the
        background (a failure is logged: a request's read tries again and reports it);
        False without a store to read from."""
        if self.reader is None:
            return False
        reader = self.reader

        def read() -> None:
            try:
                reader.index(user, version)
            except Exception as exc:  # noqa: BLE001 - the request's own read reports it
                log.warning("priming user %s version %s's chunk index failed: %s: %s",
                            user, version[:12], type(exc).__name__, exc)
            finally:
                with self._busy:
                    self.priming, self.primed = self.priming - 1, self.primed + 1

        with self._busy:
            self.priming += 1
        self._priming.submit(read)
        return True

    def submit(self, spec: FetchSpec) -> None:
        """Read for ``spec``: adopt a prefetch of its chunks, else start a read."""
        key = (spec.user, spec.version, tuple(spec.chunks))
        waiting = self._prefetched.get(key)
        if waiting:
            read = waiting.pop(0)
            if not waiting:
                del self._prefetched[key]
            self.prefetches["adopted"] += 1
        else:
            deadline_s = self.timeout_s if spec.deadline_s is None else spec.deadline_s
            read = self._start(key, deadline_s, 0, spec.end)
        read.spec = spec
        self._running[spec.req_id] = read

    def _start(self, key: Key, deadline_s: float, nbytes: int, tokens: int = 0) -> _Read:
        now = time.monotonic()
        if deadline_s <= 0:  # no time for a read at all: it fails at once
            future: Future = Future()
            future.set_result(Fetched(None, error="no time left for a read"))
        else:
            future = self._pool.submit(self._read, key, now + deadline_s)
        return _Read(key, future, now, now + deadline_s, nbytes or tokens * self._row_bytes)

    def cancel(self, req_ids: set[str]) -> None:
        """Requests that finished in the scheduler: drop their reads once complete."""
        self._cancelled |= req_ids & self._running.keys()

    @property
    def busy(self) -> bool:
        """Whether rows are being read for a request now (background reloads yield)."""
        return self._active > 0

    @property
    def pending(self) -> int:
        return len(self._running) + sum(len(v) for v in self._prefetched.values())

    def stats(self) -> dict:
        """Cumulative bytes of rows read and seconds the reader was busy, of its ended busy
        periods (the server's bandwidth estimate takes their deltas), bytes not read yet
        of the reads started or waiting, the prefetches by outcome, and the reads handed
        over with their seconds outside the rows (``overhead_s``: index, staging, check
        and placing)."""
        with self._busy:
            busy, nbytes = self.busy_s, self.busy_bytes
            overhead = sum(v for k, v in self.phase_s.items() if k != "rows")
            timed = self.timed_reads
        reads = [*self._running.values(), *(r for v in self._prefetched.values() for r in v)]
        return {"bytes": nbytes, "busy_s": busy,
                "queued_bytes": sum(r.nbytes for r in reads if not r.future.done()),
                "prefetch": dict(self.prefetches), "reads_timed": timed,
                "overhead_s": overhead}

    # ------------------------------------------------------------------ handing over

    def done(self) -> list[Fetched]:
        """The reads that completed (or missed their deadline) since the last call; a
        cancelled one comes back without a resident (its memory already given back)."""
        out = []
        now = time.monotonic()
        self.expire(now)
        for req_id, read in list(self._running.items()):
            if not read.future.done() and now <= read.deadline:
                continue
            del self._running[req_id]
            spec = read.spec
            if not read.future.done():  # it may still write its staging memory: let it finish
                read.future.add_done_callback(lambda f: self._drop(f.result()))
                got = Fetched(spec, error=f"read from storage not done within its "
                                          f"{read.deadline - read.started:.3g} s")
            else:
                got = read.future.result()
                got.spec = spec
                if got.error is None and not _carries(spec, got.resident):
                    self._drop(got)
                    got = Fetched(spec, error="ValueError: the prompt does not carry the "
                                              "memory's token ids")
            if req_id in self._cancelled:
                self._cancelled.discard(req_id)
                self._drop(got)
                got = Fetched(spec, error="cancelled")
            if got.error is None:
                self.reads += 1
                self.bytes_read += got.nbytes
                self.latency.observe(now - read.started)
                with self._busy:
                    for phase, seconds in zip(PHASES, got.phases):
                        self.phase_s[phase] += seconds
                    self.timed_reads += 1
            elif got.error != "cancelled":
                self.failures += 1
            out.append(got)
        return out

    def expire(self, now: float | None = None) -> None:
        """Drop the prefetches no request adopted within ``keep_s`` of their deadline."""
        now = time.monotonic() if now is None else now
        for key, reads in list(self._prefetched.items()):
            keep = [r for r in reads if now <= r.deadline + self.keep_s]
            for read in reads:
                if now > read.deadline + self.keep_s:
                    self.prefetches["dropped"] += 1
                    read.future.add_done_callback(lambda f: self._drop(f.result()))
            if keep:
                self._prefetched[key] = keep
            else:
                del self._prefetched[key]

    def _drop(self, got: Fetched) -> None:
        if got.resident is not None and got.resident.region is not None:
            self.store.release(got.resident.region)
            got.resident = None

    # ------------------------------------------------------------------ on the pool

    def _read(self, key: Key, deadline: float) -> Fetched:
        """Runs on the pool: never raises (a failure is the result's ``error``)."""
        try:
            return self._fetch(*key, deadline)
        except Exception as exc:  # noqa: BLE001 - reported, the request is recomputed
            return Fetched(None, error=f"{type(exc).__name__}: {exc}")

    def _fetch(self, user: str, version: str, chunks: tuple[str, ...],
               deadline: float) -> Fetched:
        if self.reader is None:
            raise RuntimeError("the connector has no artifact_root to read facts from")
        t0 = time.perf_counter()
        index = self.reader.index(user, version)
        chunks = list(chunks)
        self._row_bytes = index.row_bytes
        nbytes = index.tokens(chunks) * index.row_bytes
        offsets, at = {}, 0
        for c in chunks:
            n = index.rows[c][1]
            offsets[c] = (at, n)
            at += n
        t1 = time.perf_counter()
        host = self.store.staging(self.reader.buffer_bytes(index, chunks),
                                  max(0.0, deadline - time.monotonic()), "host")
        try:
            t2 = time.perf_counter()
            with self._reading(nbytes):
                rows = self.reader.read(index, chunks, host.data)  # [T, 2, L, H, D], stored
            t3 = time.perf_counter()
            # the read's rows as a transient resident: fp8 scales by chunk, in read order
            resident = Resident(user, version, self.fingerprint, rows, offsets,
                                {c: index.token_ids[c] for c in chunks}, tier="storage",
                                scales=index.chunk_scales(chunks))
            self.store.check(resident)  # the model's geometry, scales its dtype keeps finite
            dev = self.store.staging(self.store.placed_bytes(rows),
                                     max(0.0, deadline - time.monotonic()), "gpu")
            try:
                dequant = resident.scales is not None and \
                    self.store.kept_dtype(rows.dtype) != rows.dtype
                slab = self.store.place(rows, "gpu", region=dev, row_scales=(
                    resident.row_scales() if dequant else None))
            except BaseException:
                self.store.release(dev)
                raise
        finally:
            self.store.release(host)
        resident.scales = self.store.kept_scales(resident)
        resident.slab, resident.region = slab, dev
        return Fetched(None, resident, nbytes=nbytes,
                       phases=(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3))

    @contextmanager
    def _reading(self, nbytes: int) -> Iterator[None]:
        """While rows are read the reader counts as busy (overlapping reads count once).
        A busy period's time and bytes count together when it ends: the statistics then
        never hold a read's time without its bytes (a report in the middle of a read, as
        every prefetch's answer is, made the next interval's bytes per second several
        times the disk's: 12 GB/s on an H100 whose disk reads ~1.7,
        ``benchmarks/results/load-h100-llama31-8b-run9-u200.json``)."""
        with self._busy:
            if not self._active:
                self._busy_since = time.monotonic()
            self._active += 1
        ok = False
        try:
            yield
            ok = True
        finally:
            with self._busy:
                self._active -= 1
                self._period_bytes += nbytes if ok else 0
                if not self._active:
                    self.busy_s += time.monotonic() - self._busy_since
                    self.busy_bytes += self._period_bytes
                    self._period_bytes = 0


def _carries(spec: FetchSpec, resident: Resident) -> bool:
    """Whether the read chunks' token ids are exactly the prompt's (``spec.expected``)."""
    tokens = [t for c in spec.chunks for t in resident.token_ids[c]]
    return tokens[spec.start:spec.end] == list(spec.expected)
