"""The worker's reads of non-resident users' facts, one per waiting request.

The scheduler admits a request whose user is in neither tier as an asynchronous load
(:class:`~inferscale.vllm_plugin.metadata.FetchSpec`): vLLM keeps it waiting, with its
blocks allocated, until the worker reports it finished. :class:`Fetches` runs each read
on a small thread pool, off the engine's thread: the version's chunk index, a check that
the chunks' token ids are exactly the prompt's, the rows of just those chunks into the
store's pinned staging reserve (:class:`~inferscale.hydrate.fetch.FactReader`, which
refuses a version of another fingerprint or geometry than the model's from its
manifest), checked as the store checks every slab, and one copy into its device staging
reserve in the engine's dtype and layout (the rank's heads
under tensor parallelism). What the engine's thread then does is what it does for a
resident user: one injection kernel reading device memory, in the next step.

A read that fails, or cannot get staging memory or finish within ``timeout_s``, is
reported as failed (vLLM recomputes the request's memory); a request that finishes while
its read runs (a client that went away) has its read dropped when it completes. Every
read is reported finished exactly once, which is when vLLM frees the blocks it held.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from inferscale.hydrate.fetch import FactReader
from inferscale.hydrate.resident import Resident
from inferscale.hydrate.store import ResidentStore
from inferscale.stats import Histogram, geometric
from inferscale.vllm_plugin.metadata import FetchSpec

FETCH_BUCKETS_S = geometric(0.001, 30.0, 1.5)


@dataclass
class Fetched:
    """A finished read: the facts as a transient resident (its slab in device staging
    memory), or why there is none."""

    spec: FetchSpec
    resident: Resident | None = None
    error: str | None = None
    nbytes: int = 0  # read from storage


class Fetches:
    """Reads for waiting requests; :meth:`done` hands over the finished ones."""

    def __init__(self, store: ResidentStore, reader: FactReader | None, fingerprint: str,
                 timeout_s: float = 10.0, workers: int = 4):
        self.store, self.reader, self.fingerprint = store, reader, fingerprint
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="inferscale-fetches")
        self._running: dict[str, tuple[FetchSpec, Future, float]] = {}
        self._cancelled: set[str] = set()
        self.latency = Histogram(FETCH_BUCKETS_S)  # of the reads that succeeded
        self.reads = self.failures = self.bytes_read = 0

    def submit(self, spec: FetchSpec) -> None:
        self._running[spec.req_id] = (spec, self._pool.submit(self._read, spec),
                                      time.monotonic())

    def cancel(self, req_ids: set[str]) -> None:
        """Requests that finished in the scheduler: drop their reads once complete."""
        self._cancelled |= req_ids & self._running.keys()

    @property
    def pending(self) -> int:
        return len(self._running)

    def done(self) -> list[Fetched]:
        """The reads that completed (or timed out) since the last call; a cancelled one
        comes back without a resident (its memory already given back)."""
        out = []
        now = time.monotonic()
        for req_id, (spec, fut, started) in list(self._running.items()):
            late = now - started > self.timeout_s
            if not fut.done() and not late:
                continue
            del self._running[req_id]
            if not fut.done():  # it may still write its staging memory: let it finish
                fut.add_done_callback(lambda f: self._drop(f.result()))
                got = Fetched(spec, error=f"read from storage took over {self.timeout_s} s")
            else:
                got = fut.result()
            if req_id in self._cancelled:
                self._cancelled.discard(req_id)
                self._drop(got)
                got = Fetched(spec, error="cancelled")
            if got.error is None:
                self.reads += 1
                self.bytes_read += got.nbytes
                self.latency.observe(now - started)
            elif got.error != "cancelled":
                self.failures += 1
            out.append(got)
        return out

    def _drop(self, got: Fetched) -> None:
        if got.resident is not None and got.resident.region is not None:
            self.store.release(got.resident.region)
            got.resident = None

    def _read(self, spec: FetchSpec) -> Fetched:
        """Runs on the pool: never raises (a failure is the result's ``error``)."""
        try:
            return self._fetch(spec)
        except Exception as exc:  # noqa: BLE001 - reported, the request is recomputed
            return Fetched(spec, error=f"{type(exc).__name__}: {exc}")

    def _fetch(self, spec: FetchSpec) -> Fetched:
        if self.reader is None:
            raise RuntimeError("the connector has no artifact_root to read facts from")
        index = self.reader.index(spec.user, spec.version)
        chunks = list(spec.chunks)
        tokens = [t for c in chunks for t in index.token_ids[c]]
        if tokens[spec.start:spec.end] != list(spec.expected):
            raise ValueError("the prompt does not carry the memory's token ids")
        nbytes = index.tokens(chunks) * index.row_bytes
        offsets, at = {}, 0
        for c in chunks:
            n = index.rows[c][1]
            offsets[c] = (at, n)
            at += n
        host = self.store.staging(nbytes, self.timeout_s, "host")
        try:
            rows = self.reader.read(index, chunks, host.data)  # [T, 2, L, H, D], stored dtype
            # the read's rows as a transient resident: fp8 scales by chunk, in read order
            resident = Resident(spec.user, spec.version, self.fingerprint, rows, offsets,
                                {c: index.token_ids[c] for c in chunks}, tier="storage",
                                scales=index.chunk_scales(chunks))
            self.store.check(resident)  # the model's geometry, scales its dtype keeps finite
            dev = self.store.staging(self.store.placed_bytes(rows), self.timeout_s, "gpu")
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
        return Fetched(spec, resident, nbytes=nbytes)
