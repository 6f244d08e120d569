"""The server's per-user memory (facts, token ids, retrieval index), kept fresh and bounded.

:class:`MemoryCache` is what ``inferscale.serve.MemoryServer`` asks for a user's memory
on every request:

- **First loads never block the event loop**: reading a user's facts and building the
  retrieval index run on a small thread pool, and concurrent first requests of one user
  share one load.
- **New versions arrive by themselves**: when a user's entry was last checked at least
  ``refresh_s`` seconds ago, a request starts a background re-read of the user's LATEST
  (a few bytes) and answers from the version it holds; if LATEST moved, the new version
  is loaded in the background and replaces the old one (its requests then name the new
  version, and the connector reloads the workers' KV). So a new LATEST serves from the
  first request that comes ``refresh_s`` after the previous check, plus the time to load
  it. A user with no usable memory is remembered as such and checked again the same way.
- **Bounded**: the entries' bytes (embeddings on the index's device, token ids, texts)
  stay under ``budget_bytes``; the least recently used users are dropped first (a later
  request loads them again).
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
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

log = logging.getLogger("inferscale.serve")


@dataclass
class UserMemory:
    """What the server holds per user: the version, facts and their retrieval index."""

    user: str
    version: str
    fact_ids: list[str]
    texts: list[str]
    token_ids: dict[str, list[int]]  # chunk id -> token ids ("prefix" included)
    index: Any  # retrieval.FactIndex
    source_index: dict[str, int] = field(default_factory=dict)  # fact id -> source turn index
    memory_order: str = "relevance"  # the artifact's composer settings (encoder config)
    text_tail: int = 0
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        emb = getattr(self.index, "embeddings", None)
        self.nbytes = ((emb.numel() * emb.element_size() if emb is not None else 0)
                       + 8 * sum(len(t) for t in self.token_ids.values())
                       + sum(len(t.encode()) for t in self.texts))


@dataclass(frozen=True)
class MemoryCacheConfig:
    """``refresh_s``: INFERSCALE_SERVE_REFRESH_S; ``budget_bytes``:
    INFERSCALE_SERVE_MEMORY_BUDGET_BYTES; ``load_threads``: concurrent loads."""

    refresh_s: float = 60.0
    budget_bytes: int = 2 << 30
    load_threads: int = 4

    def __post_init__(self) -> None:
        if self.refresh_s < 0:
            raise ValueError(f"refresh_s must be >= 0, got {self.refresh_s}")
        if self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {self.budget_bytes}")
        if self.load_threads < 1:
            raise ValueError(f"load_threads must be >= 1, got {self.load_threads}")


@dataclass
class _Entry:
    memory: UserMemory | None  # None: the user has no usable memory (checked at ``checked``)
    checked: float  # monotonic time of the LATEST read this entry reflects


class MemoryCache:
    """Per-user memories for the server (see the module docstring).

    ``read(user, version)`` (blocking; ``version`` may be ``"latest"``) loads one version;
    ``latest(user)`` (blocking) returns the id LATEST names, or None.
    """

    def __init__(self, read: Callable[[str, str], UserMemory],
                 latest: Callable[[str], str | None], config: MemoryCacheConfig | None = None):
        self.read, self.latest = read, latest
        self.config = config or MemoryCacheConfig()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # LRU first
        self._pins: dict[str, str] = {}  # user -> version an admin pinned
        self._bytes = 0
        self._loading: dict[str, asyncio.Future] = {}
        self._refreshing: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._pool = ThreadPoolExecutor(self.config.load_threads,
                                        thread_name_prefix="inferscale-load")

    # ------------------------------------------------------------------ requests

    async def get(self, user: str) -> UserMemory | None:
        """The user's memory (None: none usable); loads it off the event loop the first
        time and starts a background refresh when the last check is ``refresh_s`` old."""
        entry = self._entries.get(user)
        if entry is None:
            return await self._first_load(user)
        self._entries.move_to_end(user)
        if user not in self._pins and user not in self._refreshing and \
                time.monotonic() - entry.checked >= self.config.refresh_s:
            self._refreshing.add(user)
            self._spawn(self._refresh(user, entry))
        return entry.memory

    def peek(self, user: str) -> UserMemory | None:
        """The memory held now, without loading or refreshing (benchmarks, status)."""
        entry = self._entries.get(user)
        return entry.memory if entry else None

    async def _first_load(self, user: str) -> UserMemory | None:
        fut = self._loading.get(user)
        if fut is None:
            fut = asyncio.ensure_future(self._load(user, self._pins.get(user, "latest")))
            self._loading[user] = fut
            fut.add_done_callback(lambda _: self._loading.pop(user, None))
        return await asyncio.shield(fut)

    async def _load(self, user: str, version: str) -> UserMemory | None:
        checked = time.monotonic()
        try:
            memory = await self._run(self.read, user, version)
        except Exception as exc:  # noqa: BLE001 - no memory: answered without it
            log.info("user %s has no usable memory (%s: %s); answering without it until "
                     "the next check", user, type(exc).__name__, exc)
            memory = None
        self._put(user, _Entry(memory, checked))
        return memory

    async def _refresh(self, user: str, entry: _Entry) -> None:
        checked = time.monotonic()
        try:
            latest = await self._run(self.latest, user)
            held = entry.memory.version if entry.memory else None
            if latest is None or latest == held:
                entry.checked = checked
                return
            memory = await self._run(self.read, user, latest)
        except Exception as exc:  # noqa: BLE001 - keep serving what is held; retry later
            log.warning("user %s: refreshing memory failed (%s: %s); keeping version %s",
                        user, type(exc).__name__, exc,
                        entry.memory.version[:12] if entry.memory else None)
            entry.checked = checked
            return
        finally:
            self._refreshing.discard(user)
        if self._entries.get(user) is not entry or user in self._pins:
            return  # evicted, pinned or replaced by an admin meanwhile
        log.info("user %s: serving version %s (was %s)", user, memory.version[:12],
                 held[:12] if held else None)
        self._put(user, _Entry(memory, checked))

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
        """user -> version held (None: no usable memory), least recently used first."""
        return {u: e.memory.version if e.memory else None for u, e in self._entries.items()}

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
        self._entries[user] = entry
        self._entries.move_to_end(user)
        if entry.memory is not None:
            self._bytes += entry.memory.nbytes
        while self._bytes > self.config.budget_bytes and len(self._entries) > 1:
            victim, old = next(iter(self._entries.items()))
            if victim == user:
                break
            self._pop(victim)
            if old.memory is not None:
                log.info("dropped user %s's facts (%d bytes) under the serving budget",
                         victim, old.memory.nbytes)

    def _pop(self, user: str) -> None:
        old = self._entries.pop(user, None)
        if old is not None and old.memory is not None:
            self._bytes -= old.memory.nbytes

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
