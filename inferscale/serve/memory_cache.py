"""The server's per-user memory (facts, token ids, retrieval index), kept fresh and bounded.

:class:`MemoryCache` is what ``inferscale.serve.MemoryServer`` asks for a user's memory
on every request:

- **First loads never block the event loop**: reading a user's LATEST, facts and
  retrieval index (:class:`~inferscale.serve.user_memory.UserMemory`) run on a small
  thread pool, and concurrent first requests of one user share one load.
- **New versions arrive by themselves**: when a user's entry was last checked at least
  ``refresh_s`` seconds ago, a request starts a background re-read of the user's LATEST
  (a few bytes) and answers from the version it holds; if LATEST moved, the new version
  is loaded in the background and replaces the old one (its requests then name the new
  version, and the connector reloads the workers' KV). So a new LATEST serves from the
  first request that comes ``refresh_s`` after the previous check, plus the time to load
  it. A user with nothing published is remembered as such and checked again the same way.
- **Refused versions**: a version this server cannot serve (:class:`MemoryRefused`: fact
  embeddings of another dimension than the serving embedder's, a memory layout in its
  encoder config that cannot be composed) is logged, counted and remembered; the user is
  answered without memory (or from the version held before) until LATEST names another.
- **Failures are not "no memory"**: a load that fails (storage unreachable, a version
  removed between reading LATEST and reading it) answers that request without memory
  and is tried again, LATEST first, by the first request after a back-off (``retry_s``,
  doubling per failure up to ``refresh_s``).
- **Never without memory silently**: :meth:`MemoryCache.lookup` says why a user who has
  (or may have) memory goes without it (:class:`Lookup`, :class:`MemoryFallbackReason`:
  ``shed``, ``load_failed``, ``refused``); the server names it in the answer and counts it.
- **Bounded**: the entries' bytes (embeddings on the index's device, token ids, texts)
  stay under ``budget_bytes``, least recently used users dropped first (a later request
  loads them again); entries without memory (nothing published, refused, failed) are at
  most ``max_negative``, least recently used evicted first; and storage lookups of
  unauthenticated users the cache holds nothing for are rate-limited (``misses_per_s``,
  bursts of ``miss_burst``): such a request waits for the next free lookup if it comes
  within ``miss_wait_s`` (lookups are booked in arrival order), else it is shed at once:
  answered without memory (fallback ``shed``), nothing read or remembered. Users of an
  API key (a closed set: no flood of ids can come through them) are never rate-limited.
  All of it is counted (:meth:`MemoryCache.stats`, in ``/metrics``), and first loads
  are timed by phase (waiting for a load thread, LATEST, the version, the hand-back).
- **Pins**: an admin hydrate of an explicit version pins the user to it (no refresh)
  until a hydrate of ``"latest"`` or an eviction.

A version deleted by gc while a server holds it keeps serving from memory (the facts
here, the KV slab in the worker) until the next check moves the user to LATEST, which gc
never deletes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Awaitable, Callable

from inferscale.serve.token_bucket import TokenBucket
from inferscale.serve.user_memory import UserMemory
from inferscale.vllm_plugin.failures import Fallback

log = logging.getLogger("inferscale.serve")
# a first load's phases (:meth:`MemoryCache.stats`' ``load_seconds``)
LOAD_PHASES = ("queued", "latest", "read", "handback")


class MemoryFallbackReason(StrEnum):
    """Why a user who has (or may have) memory is answered without it; its value is the
    label of ``inferscale_memory_fallbacks_total`` and the answer's ``fallback_reason``."""

    SHED = "shed"  # the first lookup was shed under the rate limit
    LOAD_FAILED = "load_failed"  # reading the memory failed (tried again after a back-off)
    REFUSED = "refused"  # the version cannot be served (MemoryRefused)


@dataclass(frozen=True)
class Lookup:
    """What :meth:`MemoryCache.lookup` found: the user's ``memory`` (None: none usable)
    and, when the user has or may have memory this request goes without, why."""

    memory: UserMemory | None
    fallback: Fallback[MemoryFallbackReason] | None = None


class MemoryRefused(Exception):
    """A version this server will not serve (``reason``: ``embedding_dim``, ``layout``),
    raised by the cache's ``read``: remembered and counted, not retried until LATEST
    moves."""

    def __init__(self, version: str, reason: str, message: str):
        super().__init__(message)
        self.version, self.reason = version, reason


@dataclass(frozen=True)
class MemoryCacheConfig:
    """``refresh_s``: INFERSCALE_SERVE_REFRESH_S; ``budget_bytes``:
    INFERSCALE_SERVE_MEMORY_BUDGET_BYTES; ``load_threads``: concurrent loads;
    ``max_negative``: INFERSCALE_SERVE_MAX_NEGATIVE_ENTRIES (entries without memory);
    ``misses_per_s`` / ``miss_burst`` / ``miss_wait_s``:
    INFERSCALE_SERVE_STORAGE_MISSES_PER_S / ``_BURST`` / ``_WAIT_S`` (lookups of
    unauthenticated users the cache holds nothing for, and the longest such a lookup
    waits for its turn); ``retry_s``: the first back-off after a failed load."""

    refresh_s: float = 60.0
    budget_bytes: int = 2 << 30
    load_threads: int = 4
    max_negative: int = 10_000
    misses_per_s: float = 20.0
    miss_burst: int = 100
    miss_wait_s: float = 2.0
    retry_s: float = 1.0

    @classmethod
    def from_settings(cls, settings: Any) -> "MemoryCacheConfig":
        return cls(refresh_s=settings.serve_refresh_s,
                   budget_bytes=settings.serve_memory_budget_bytes,
                   max_negative=settings.serve_max_negative_entries,
                   misses_per_s=settings.serve_storage_misses_per_s,
                   miss_burst=settings.serve_storage_miss_burst,
                   miss_wait_s=settings.serve_storage_miss_wait_s)

    def __post_init__(self) -> None:
        for name in ("refresh_s", "budget_bytes", "misses_per_s", "miss_wait_s", "retry_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("load_threads", "max_negative", "miss_burst"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class _Entry:
    memory: UserMemory | None  # None: no usable memory (nothing published, refused, failed)
    checked: float  # monotonic time of the LATEST read this entry reflects
    refused: str | None = None  # the version LATEST named that was refused
    failures: int = 0  # consecutive failed loads (memory is None)
    retry_at: float = 0.0  # failed: monotonic time from which a request loads again
    fallback: Fallback[MemoryFallbackReason] | None = None  # refused or failed (Lookup)


class MemoryCache:
    """Per-user memories for the server (see the module docstring).

    ``latest(user)`` (blocking) returns the version id LATEST names, or None when nothing
    is published; ``read(user, version)`` (blocking) loads that version, raising
    :class:`MemoryRefused` for a version the server will not serve.
    """

    def __init__(self, read: Callable[[str, str], UserMemory],
                 latest: Callable[[str], str | None], config: MemoryCacheConfig | None = None):
        self.read, self.latest = read, latest
        self.config = config or MemoryCacheConfig()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # with memory; LRU first
        self._negative: OrderedDict[str, _Entry] = OrderedDict()  # without; LRU first
        self._pins: dict[str, str] = {}  # user -> version an admin pinned
        self._bytes = 0
        self._loading: dict[str, asyncio.Future] = {}
        self._refreshing: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._misses = TokenBucket(self.config.misses_per_s, self.config.miss_burst)
        self._stats = {"storage_lookups": 0, "lookups_limited": 0, "lookups_delayed": 0,
                       "load_failures": 0, "negative_evictions": 0}
        self._refused: dict[str, int] = {}  # reason -> versions refused
        # first loads' seconds by phase (summed): waiting for a load thread, reading
        # LATEST, reading the version, and the event loop taking each result back
        self._load_s = dict.fromkeys(LOAD_PHASES, 0.0)
        self._pool = ThreadPoolExecutor(self.config.load_threads,
                                        thread_name_prefix="inferscale-load")

    # ------------------------------------------------------------------ requests

    async def get(self, user: str, shed: bool = True) -> UserMemory | None:
        """The user's memory (None: none usable): :meth:`lookup`'s."""
        return (await self.lookup(user, shed)).memory

    async def lookup(self, user: str, shed: bool = True) -> Lookup:
        """The user's memory, and why it goes without when it may have some; loads it
        off the event loop the first time and starts a background refresh when the last
        check is ``refresh_s`` old. ``shed``: the first lookup is rate-limited (an
        unauthenticated user: see the module docstring); False for API-key users."""
        entry = self._entries.get(user)
        if entry is not None:
            self._entries.move_to_end(user)
        else:
            entry = self._negative.get(user)
            if entry is None:  # a storage miss
                if shed and user not in self._loading:
                    wait = self._misses.reserve(self.config.miss_wait_s)
                    if wait is None:
                        self._stats["lookups_limited"] += 1
                        return Lookup(None, self._shed())
                    if wait:  # booked: loaded once its turn comes (or by then loaded)
                        self._stats["lookups_delayed"] += 1
                        await asyncio.sleep(wait)
                        return await self.lookup(user, shed=False)
                return await self._first_load(user)
            self._negative.move_to_end(user)
            if entry.failures:  # a failed load: again once its back-off is over
                if time.monotonic() >= entry.retry_at:
                    return await self._first_load(user)
                return Lookup(None, entry.fallback)
        if user not in self._pins and user not in self._refreshing and \
                time.monotonic() - entry.checked >= self.config.refresh_s:
            self._refreshing.add(user)
            self._spawn(self._refresh(user, entry))
        if entry.memory is None and entry.fallback:
            return Lookup(None, entry.fallback)
        return Lookup(entry.memory)

    def _shed(self) -> Fallback[MemoryFallbackReason]:
        c = self.config
        return Fallback(MemoryFallbackReason.SHED, (
            f"memory lookup shed: first lookups of unauthenticated users are limited to "
            f"{c.misses_per_s:g}/s (INFERSCALE_SERVE_STORAGE_MISSES_PER_S) and none was "
            f"free within {c.miss_wait_s:g} s; answered without memory"))

    def peek(self, user: str) -> UserMemory | None:
        """The memory held now, without loading or refreshing (benchmarks, status)."""
        entry = self._entries.get(user)
        return entry.memory if entry else None

    async def _first_load(self, user: str) -> Lookup:
        fut = self._loading.get(user)
        if fut is None:
            fut = asyncio.ensure_future(self._load(user, self._pins.get(user)))
            self._loading[user] = fut
            fut.add_done_callback(lambda _: self._loading.pop(user, None))
        return await asyncio.shield(fut)

    async def _load(self, user: str, pinned: str | None) -> Lookup:
        checked = time.monotonic()
        self._stats["storage_lookups"] += 1
        version = pinned
        try:
            if version is None:
                version = await self._timed("latest", self.latest, user)
                if version is None:  # nothing published: no memory, checked again later
                    self._put(user, _Entry(None, checked))
                    return Lookup(None)
            memory = await self._timed("read", self.read, user, version)
        except MemoryRefused as exc:
            why = self._refuse(user, exc)
            self._put(user, _Entry(None, checked, refused=exc.version, fallback=why))
            return Lookup(None, why)
        except Exception as exc:  # noqa: BLE001 - answered without memory, tried again soon
            old = self._negative.get(user)
            failures = (old.failures if old else 0) + 1
            delay = min(self.config.retry_s * 2 ** (failures - 1),
                        max(self.config.retry_s, self.config.refresh_s))
            self._stats["load_failures"] += 1
            log.warning("user %s: loading memory failed (%s: %s); answering without it, "
                        "trying again in %.1f s", user, type(exc).__name__, exc, delay)
            why = Fallback(MemoryFallbackReason.LOAD_FAILED, (
                f"memory load failed ({type(exc).__name__}: {str(exc)[:200]}); answered "
                f"without memory, tried again from {delay:.1f} s after the failure"))
            self._put(user, _Entry(None, checked, failures=failures,
                                   retry_at=time.monotonic() + delay, fallback=why))
            return Lookup(None, why)
        self._put(user, _Entry(memory, checked))
        return Lookup(memory)

    async def _refresh(self, user: str, entry: _Entry) -> None:
        checked = time.monotonic()
        held = entry.memory.version if entry.memory else None
        try:
            latest = await self._run(self.latest, user)
            if latest is None or latest in (held, entry.refused):
                entry.checked = checked
                return
            memory = await self._run(self.read, user, latest)
        except MemoryRefused as exc:
            why = self._refuse(user, exc)
            entry.refused, entry.checked = exc.version, checked
            if entry.memory is None:  # nothing held: answered without memory, saying why
                entry.fallback = why
            return
        except Exception as exc:  # noqa: BLE001 - keep what is held; check again soon
            log.warning("user %s: refreshing memory failed (%s: %s); keeping version %s",
                        user, type(exc).__name__, exc, held[:12] if held else None)
            entry.checked = checked - self.config.refresh_s + self.config.retry_s
            return
        finally:
            self._refreshing.discard(user)
        current = self._entries.get(user) or self._negative.get(user)
        if current is not entry or user in self._pins:
            return  # evicted, pinned or replaced by an admin meanwhile
        log.info("user %s: serving version %s (was %s)", user, memory.version[:12],
                 held[:12] if held else None)
        self._put(user, _Entry(memory, checked))

    def _refuse(self, user: str, exc: MemoryRefused) -> Fallback[MemoryFallbackReason]:
        """Count and log a refused version; what the answers without it say."""
        self._refused[exc.reason] = self._refused.get(exc.reason, 0) + 1
        log.warning("user %s: version %s refused (%s): %s; answering without it until "
                    "LATEST names another version", user, exc.version[:12], exc.reason, exc)
        return Fallback(MemoryFallbackReason.REFUSED,
                        f"version {exc.version[:12]} refused ({exc.reason}): {exc}")

    # ------------------------------------------------------------------ admin

    async def load(self, user: str, version: str = "latest") -> UserMemory:
        """Load ``version`` now (admin hydrate); an explicit version pins the user to it,
        ``"latest"`` unpins. Raises what reading raises."""
        checked = time.monotonic()
        memory = await self._run(self.read, user, version)
        if version == "latest":
            self._pins.pop(user, None)
        else:
            self._pins[user] = memory.version
        self._put(user, _Entry(memory, checked))
        return memory

    def put(self, memory: UserMemory, pinned: bool = False) -> None:
        """Hold ``memory`` (read by the caller), pinned or not (benchmarks)."""
        if pinned:
            self._pins[memory.user] = memory.version
        self._put(memory.user, _Entry(memory, time.monotonic()))

    def drop(self, user: str) -> None:
        """Forget the user (and its pin)."""
        self._pins.pop(user, None)
        self._pop(user)

    def held(self) -> dict[str, str | None]:
        """user -> version held (None: no usable memory), least recently used first
        (those with memory, then those without)."""
        out = {u: e.memory.version for u, e in self._entries.items() if e.memory}
        out.update(dict.fromkeys(self._negative))
        return out

    def stats(self) -> dict[str, Any]:
        """Counters since start (``/metrics``): users and bytes held, entries without
        memory and their evictions, storage lookups of uncached users, those the rate
        limit shed and those it delayed, failed loads, versions refused by reason, and
        the first loads' seconds by phase (:data:`LOAD_PHASES`)."""
        return {**self._stats, "users": len(self._entries), "bytes": self._bytes,
                "negative_entries": len(self._negative), "refused": dict(self._refused),
                "load_seconds": dict(self._load_s)}

    @property
    def nbytes(self) -> int:
        return self._bytes

    async def settle(self) -> None:
        """Wait for the background refreshes started so far (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ internals

    def _put(self, user: str, entry: _Entry) -> None:
        self._pop(user)
        if entry.memory is None:
            self._negative[user] = entry
            while len(self._negative) > self.config.max_negative:
                self._negative.popitem(last=False)
                self._stats["negative_evictions"] += 1
            return
        self._entries[user] = entry
        self._bytes += entry.memory.nbytes
        while self._bytes > self.config.budget_bytes and len(self._entries) > 1:
            victim, old = next(iter(self._entries.items()))
            if victim == user:
                break
            self._pop(victim)
            log.info("dropped user %s's facts (%d bytes) under the serving budget",
                     victim, old.memory.nbytes)

    def _pop(self, user: str) -> None:
        self._negative.pop(user, None)
        old = self._entries.pop(user, None)
        if old is not None and old.memory is not None:
            self._bytes -= old.memory.nbytes

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _timed(self, phase: str, fn: Callable[..., Any], *args: Any) -> Any:
        """:meth:`_run`, its time split into ``queued`` (for a load thread), ``phase``
        (on it) and ``handback`` (the loop taking the result back), summed per phase."""
        t0, span = time.perf_counter(), []

        def call() -> Any:
            span.append(time.perf_counter())
            try:
                return fn(*args)
            finally:
                span.append(time.perf_counter())

        try:
            return await self._run(call)
        finally:
            if len(span) == 2:
                self._load_s["queued"] += span[0] - t0
                self._load_s[phase] += span[1] - span[0]
                self._load_s["handback"] += max(0.0, time.perf_counter() - span[1])
