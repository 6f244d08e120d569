"""Loading users into the worker's resident store: admin hydrations and background reloads.

One :class:`ResidentLoader` per vLLM worker, owned by the connector's worker half
(:mod:`inferscale.vllm_plugin.worker`). It hydrates an artifact version from the
artifact store named in the connector's settings (:func:`inferscale.hydrate.slab.hydrate`:
host memory, pinned where CUDA exists; checksums and the model fingerprint verified) and
puts it into the :class:`~inferscale.hydrate.resident.ResidentStore` tier asked for:

- :meth:`ResidentLoader.load`: an admin hydration (``POST /admin/hydrate`` -> the engine's
  collective RPC), synchronous; errors go back to the caller;
- :meth:`ResidentLoader.reload_in_background`: a reload the scheduler ordered (a user the
  workers do not hold, or a newer version of one they do); it runs on a small thread
  pool (``reload_workers``), one per (user, version) at a time, and a failure is kept
  for :meth:`ResidentLoader.take_failures` (the worker reports it to the scheduler, which
  backs off before ordering it again). Each reads parts of ``reload_part_bytes`` one at
  a time (an admin hydration: 32 MiB, 4 at once on local disk), so a request's read of
  facts queues behind at most ``reload_workers x reload_part_bytes`` of reload I/O: the
  throttle's pause stops only new parts, and on an H200 (~1.2 GB/s disk) up to 2 reloads
  x 4 x 32 MiB already in flight made requests' fact reads take up to ~190 ms (11
  reads at 2,000 users, 5 rps), some past their deadline.

Both check the slab's geometry (the model's, the store's ``geometry``) and size, from
the manifest alone, before any byte of ``kv.arrow`` is read (``hydrate(geometry=...)``,
:meth:`ResidentLoader.admission`): a user of another geometry, or larger than every
budget, costs one small manifest read; the store checks the slab itself again when it
is put (:meth:`~inferscale.hydrate.store.ResidentStore.check`). A user an admin evicted is not reloaded
until an admin hydrates them again. The loader counts its background reloads, their
failures and their latency (:meth:`ResidentLoader.reload_stats`, read by the server's
metrics through the worker extension). Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from inferscale.artifacts.layout import StoreConfig
from inferscale.hydrate.resident import Resident
from inferscale.hydrate.store import ResidentStore
from inferscale.hydrate.slab import check_kv_format, hydrate, slab_nbytes
from inferscale.stats import Histogram
from inferscale.types import torch_dtype
from storage_schemas.manifest import Manifest

# Under vLLM's logger namespace, so its handlers print these in the worker process.
log = logging.getLogger("vllm.inferscale.loader")

# Upper bounds (seconds) of the reload latency histogram's buckets; +Inf is implied.
RELOAD_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
YIELD_POLL_S = 0.002  # how often a yielding reload looks whether the urgent reads are done


class Throttle:
    """At most ``bytes_per_s`` on average (0: unbounded) across the threads that share
    it: a reader calls :meth:`take` after each part and sleeps when it is ahead. With
    ``yield_to``, it also waits while ``yield_to()`` is true (reads more urgent than its
    own are in progress), at most ``max_yield_s`` per part, so a background reload never
    starves them and never stops (the parts already being read go on: the loader keeps
    them small)."""

    def __init__(self, bytes_per_s: int = 0, yield_to: Callable[[], bool] | None = None,
                 max_yield_s: float = 0.25):
        self.rate = bytes_per_s
        self.yield_to, self.max_yield_s = yield_to, max_yield_s
        self.yielded_s = 0.0  # seconds waited for more urgent reads, all threads
        self._lock = threading.Lock()
        self._free_at = time.monotonic()

    def take(self, nbytes: int) -> None:
        if self.yield_to is not None and self.yield_to():
            t0 = time.monotonic()
            while self.yield_to() and time.monotonic() - t0 < self.max_yield_s:
                time.sleep(YIELD_POLL_S)
            with self._lock:
                self.yielded_s += time.monotonic() - t0
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + nbytes / self.rate
            wait = self._free_at - now - nbytes / self.rate
        if wait > 0:
            time.sleep(wait)


class ResidentLoader:
    """Puts verified artifact versions into ``store`` for a model ``model_fingerprint``;
    ``artifact_root``/``storage_options``/``direct_io`` name the artifact store and how it
    is read (:class:`~inferscale.artifacts.layout.StoreConfig`; an empty root: none, so
    only slabs handed to :meth:`put` can be loaded); ``reload_part_bytes``: the parts a
    background reload reads, one at a time (module docstring)."""

    def __init__(self, store: ResidentStore, model_fingerprint: str, artifact_root: str = "",
                 storage_options: dict | None = None, reload_workers: int = 2,
                 reload_bytes_per_s: int = 0, *, direct_io: bool = False,
                 yield_to: Callable[[], bool] | None = None,
                 reload_part_bytes: int = 8 << 20):
        if reload_part_bytes < 1:
            raise ValueError(f"reload_part_bytes must be > 0, got {reload_part_bytes}")
        self.store = store
        self.model_fingerprint = model_fingerprint
        self.artifact_root = artifact_root
        self.storage_options = dict(storage_options or {})
        self.direct_io = direct_io
        self.reload_part_bytes = reload_part_bytes
        self.admin_evicted: set[str] = set()
        self.reloads = 0  # background reloads that succeeded
        self.reload_failures = 0  # background reloads that failed (refusals included)
        self.latency = Histogram(RELOAD_BUCKETS_S)  # of the successful reloads
        # background reloads share this read bandwidth, so a burst of users promoted
        # from storage never crowds out the requests' own reads; and they pause while
        # those reads run (``yield_to``: the worker's reads of facts for waiting requests)
        self.throttle = Throttle(reload_bytes_per_s, yield_to)
        self._failed: list[tuple[str, str, str]] = []  # (user, version, reason)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(reload_workers, thread_name_prefix="inferscale-reload")
        self._reloading: set[tuple[str, str]] = set()

    def admission(self, tier: str) -> Callable[[Manifest], None]:
        """``admit(manifest)`` for hydration: refuses, before any KV byte is read, a slab
        larger (in the dtype the store keeps it in) than every budget ``tier`` may use
        (:meth:`~inferscale.hydrate.resident.ResidentStore.fit_tier`; under tensor
        parallelism the rank's share of its heads)."""
        def admit(manifest: Manifest) -> None:
            check_kv_format(manifest)  # a format this reader knows, or refused
            stored = torch_dtype(manifest.kv["dtype"])
            nbytes = self.store.share_of(slab_nbytes(manifest, self.store.kept_dtype(stored)))
            self.store.fit_tier(manifest.user, nbytes, tier)
        return admit

    def read(self, user: str, version: str, tier: str = "host",
             throttle: Throttle | None = None, *, part_bytes: int = 32 << 20,
             workers: int | None = None) -> Resident:
        """``user``'s artifact ``version`` (or ``"latest"``) from the artifact store, in
        host memory, refused before reading when it fits no budget ``tier`` may use; the
        store moves it to the tier asked for. ``part_bytes``, ``workers``: the read's
        parts and how many at once (:func:`~inferscale.hydrate.slab.hydrate`'s)."""
        if not self.artifact_root:
            raise RuntimeError("the connector has no artifact_root to hydrate from")
        store = StoreConfig(self.artifact_root, dict(self.storage_options),
                            direct_io=self.direct_io)
        return hydrate(store, user, self.model_fingerprint, version, tier="host",
                       geometry=self.store.geometry, admit=self.admission(tier),
                       staging=self.store, part_bytes=part_bytes, workers=workers,
                       on_part=throttle.take if throttle is not None else None)

    def put(self, resident: Resident, tier: str) -> Resident:
        """Put a hydrated artifact into ``tier`` of the store (its fingerprint must be the
        engine's); an admin eviction of that user is lifted."""
        if resident.fingerprint != self.model_fingerprint:
            raise ValueError(f"artifact fingerprint {resident.fingerprint} is not the "
                             f"engine's {self.model_fingerprint}")
        self.admin_evicted.discard(resident.user)
        return self.store.put(resident, tier)

    def load(self, user: str, version: str = "latest", tier: str = "gpu") -> Resident:
        """Admin hydration: read ``user``'s ``version`` and put it into ``tier``."""
        return self.put(self.read(user, version, tier), tier)

    def evict(self, user: str) -> bool:
        """Admin eviction: drop the user and do not reload it until hydrated again."""
        self.admin_evicted.add(user)
        return self.store.evict(user)

    def reload_in_background(self, user: str, version: str, tier: str | None) -> None:
        """Queue a load of ``user``'s ``version`` into ``tier`` (None: the tier the user's
        current version is on, else ``host``) on the pool, unless an admin evicted the
        user, that reload is already queued or the store already holds that version (under
        tensor parallelism the scheduler orders a reload when any rank lacks the user; the
        ranks that hold it have nothing to do); its failure is kept for
        :meth:`take_failures`."""
        if user in self.admin_evicted:
            self.record_failure(user, version, "evicted by an admin")
            return
        held = self.store.held(user)
        if held is not None and held.version == version:
            return
        with self._lock:
            if (user, version) in self._reloading:
                return
            self._reloading.add((user, version))
        tier = tier or (held.tier if held is not None else "host")
        self._pool.submit(self._reload, user, version, tier)

    def _reload(self, user: str, version: str, tier: str) -> None:
        t0 = time.perf_counter()
        try:
            if self.store.get(user, version) is None:
                # one part in flight per reload (module docstring)
                resident = self.read(user, version, tier, self.throttle,
                                     part_bytes=self.reload_part_bytes, workers=1)
                if user in self.admin_evicted:
                    raise RuntimeError("evicted by an admin since the reload was ordered")
                self.put(resident, tier)
                seconds = time.perf_counter() - t0
                with self._lock:
                    self.reloads += 1
                self.latency.observe(seconds)
                log.info("reloaded user %s version %s into %s in %.2f s", user, version[:12],
                         tier, seconds)
        except Exception as exc:  # noqa: BLE001 - reported to the scheduler, logged there
            self.record_failure(user, version, f"{type(exc).__name__}: {exc}")
            with self._lock:
                self.reload_failures += 1
        finally:
            with self._lock:
                self._reloading.discard((user, version))

    def record_failure(self, user: str, version: str, reason: str) -> None:
        """Keep a failed reload of ``user``'s ``version`` for :meth:`take_failures`."""
        with self._lock:
            self._failed.append((user, version, reason))

    def reload_stats(self) -> dict:
        """Running totals since start-up: ``reloads``, ``failures``, and the latency of
        the successful ones (read, verify, place) as histogram ``buckets`` (upper bounds,
        seconds), per-bucket ``counts`` (one more: above the last bound) and ``sum``."""
        with self._lock:
            return {"reloads": self.reloads, "failures": self.reload_failures,
                    "yielded_s": self.throttle.yielded_s,
                    **self.latency.snapshot()}

    def take_failures(self) -> list[tuple[str, str, str]]:
        """``(user, version, reason)`` of the reloads that failed since the last call."""
        with self._lock:
            failed, self._failed = self._failed, []
        return failed
