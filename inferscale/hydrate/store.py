"""The worker's resident store: per user one KV slab in the gpu or host tier, under byte
budgets, least recently used users demoted (gpu -> host) and then dropped.

Lives in the vLLM worker process (owned by the connector's worker half). Loader threads
(:mod:`inferscale.hydrate.loader`) put users here; the engine's thread reads slabs in
``start_load_kv``.

Memory: each tier is one arena allocated once (:mod:`inferscale.hydrate.arena`: device
memory for ``gpu`` and pinned host memory for ``host`` when the engine runs on CUDA), and
each arena also holds a *staging* reserve: reads from storage land in the host one
(whole-user hydrations and per-request reads of single facts), and a request's facts
read from storage wait in the device one until the step that injects them. Placing, demoting and dropping users
never allocates or frees pinned or device memory, and copies run outside the store's
lock on side streams, so the engine's step never waits for them. A CPU engine keeps both
tiers in CPU memory, layer-major (:attr:`~inferscale.types.KVFormat.LAYER_MAJOR`:
``[2, L, T, H, D]`` behind a ``[T, 2, L, H, D]`` view) so the CPU kernel streams one
layer's rows per thread; CUDA slabs stay token-major (as stored) so a run of host rows is
one contiguous copy.

Every slab is converted once, when placed, to the store's ``dtype`` (the engine's) and cut
to its :class:`~inferscale.hydrate.resident.HeadShard` under tensor parallelism; budgets
count those bytes. fp8 slabs (``inferscale.kv_quant``) stay fp8 on CUDA, their scales
beside them in host memory (the injection kernel dequantizes the rows it reads); a CPU
engine dequantizes them once, when placed, to its float32.

Reuse safety: the engine enqueues its reads of slabs while holding the store's lock
(:meth:`ResidentStore.reading`) and stamps the residents it read with a fence recorded on
the compute stream after them (:meth:`ResidentStore.mark_used`); a demotion or drop swaps
a resident under the same lock and frees its memory with that fence, which the memory's
next writer waits for. So nothing is overwritten while an enqueued injection may still
read it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator

import torch

from inferscale.hydrate.arena import (
    NO_FENCE, Arena, ArenaFull, Fence, HeapArena, Region, copy_into,
)
from inferscale.hydrate.resident import (
    HeadShard, ResidencyError, Resident, StoreEvent, check_servable, layer_major,
)
from inferscale.kv_quant import dequantize, dequantize_into, is_quantized
from inferscale.types import TIERS, KVFormat, KVGeometry

log = logging.getLogger("vllm.inferscale.store")

_SLACK = 64 << 20  # arena bytes beyond the budget: alignment and fragmentation


def kept_dtype(stored: torch.dtype, dtype: torch.dtype | None, cuda: bool) -> torch.dtype:
    """The dtype a store of ``dtype`` (the engine's; None: each slab's own) keeps a slab
    stored in ``stored`` in: fp8 stays fp8 on CUDA (the kernel dequantizes), on the CPU
    it becomes ``dtype`` (float32 by default); any other dtype becomes ``dtype``."""
    if is_quantized(stored):
        return stored if cuda else (dtype or torch.float32)
    return dtype or stored


class ResidentStore:
    """Per-user slabs under gpu/host byte budgets (see the module docstring)."""

    def __init__(self, device: torch.device | str, gpu_budget_bytes: int,
                 host_budget_bytes: int, dtype: torch.dtype | None = None,
                 heads: HeadShard | None = None, staging_bytes: int = 1 << 30,
                 device_staging_bytes: int = 256 << 20, geometry: KVGeometry | None = None):
        self.device = torch.device(device)
        self.dtype = dtype  # every slab is converted to it when placed; None: kept as is
        self.heads = heads  # the KV heads kept of every slab; None: all of them
        # the model's KV geometry (all heads): every slab must have it (None: any)
        self.geometry = KVGeometry(*geometry) if geometry is not None else None
        self.budget = {"gpu": gpu_budget_bytes, "host": host_budget_bytes}
        self.reserve = {"host": staging_bytes, "gpu": device_staging_bytes}
        self.cuda = self.device.type == "cuda"
        self._lru: OrderedDict[str, Resident] = OrderedDict()  # user -> resident, LRU first
        self._lock = threading.RLock()  # the index and slab swaps: held only briefly
        self._placing = threading.Lock()  # placements, demotions, budget changes
        self._staged = threading.Condition(threading.Lock())
        self._staging_used = {"host": 0, "gpu": 0}
        self._events: list[StoreEvent] = []
        self._arenas: dict[str, Arena | HeapArena] | None = None
        self._seq = 0

    # ------------------------------------------------------------------ memory

    def allocate(self) -> None:
        """Take each tier's memory, once (the worker calls it at start-up, after vLLM has
        its KV cache; otherwise the first placement does)."""
        if self._arenas is not None:
            return
        with self._staged:
            if self._arenas is not None:
                return
            host = self.budget["host"] + self.reserve["host"]
            if self.cuda:
                try:
                    gpu = Arena(self.budget["gpu"] + self.reserve["gpu"] + _SLACK, self.device)
                except torch.OutOfMemoryError as exc:
                    raise ResidencyError(
                        f"the gpu tier's budget ({self.budget['gpu']} bytes, "
                        "INFERSCALE_GPU_BUDGET_BYTES) does not fit beside vLLM's KV cache; "
                        "lower it or vLLM's share of the GPU") from exc
                arenas = {"gpu": gpu, "host": Arena(host + _SLACK, "cpu", pin=True)}
            else:
                arenas = {"gpu": HeapArena(1 << 62), "host": HeapArena(1 << 62)}
            self._arenas = arenas

    def fence(self) -> Fence:
        """A fence after everything enqueued so far on the current stream."""
        self._seq += 1
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return Fence(self._seq, event)

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold while enqueueing reads of slabs and until :meth:`mark_used`: no slab is
        swapped or freed meanwhile."""
        with self._lock:
            yield

    def mark_used(self, residents: list[Resident]) -> None:
        """Stamp ``residents`` (read by work just enqueued) with a fence after it."""
        if residents:
            fence = self.fence()
            for r in residents:
                r.last_use = fence

    def staging(self, nbytes: int, timeout: float | None = None, tier: str = "host") -> Region:
        """Memory for data on its way in, from ``tier``'s staging reserve (host: pinned
        with CUDA, where reads from storage land; gpu: device memory holding a request's
        facts until they are injected); waits up to ``timeout`` seconds for room (None: as
        long as it takes). Give it back with :meth:`release`."""
        self.allocate()
        if nbytes > self.reserve[tier]:
            raise ResidencyError(f"{nbytes} bytes exceed the {tier} staging reserve "
                                 f"({self.reserve[tier]} bytes)")
        with self._staged:
            if not self._staged.wait_for(
                    lambda: self._staging_used[tier] + nbytes <= self.reserve[tier], timeout):
                raise TimeoutError(f"no {tier} staging room for {nbytes} bytes within "
                                   f"{timeout} s")
            self._staging_used[tier] += nbytes
        try:
            region = self._alloc(tier, nbytes)
        except BaseException:
            self._unstage(tier, nbytes)
            raise
        region.wait_host()
        region.staged, region.tier = nbytes, tier
        return region

    def release(self, region: Region, fence: Fence | None = None) -> None:
        """Give back a staging region (``fence``: enqueued work that still reads it)."""
        self._arenas[region.tier].free(region, fence or NO_FENCE)
        self._unstage(region.tier, region.staged)

    def _unstage(self, tier: str, nbytes: int) -> None:
        with self._staged:
            self._staging_used[tier] -= nbytes
            self._staged.notify_all()

    def _alloc(self, tier: str, nbytes: int) -> Region:
        """A region of ``tier``'s arena, dropping/demoting LRU users if fragmentation
        leaves no extent large enough."""
        while True:
            try:
                return self._arenas[tier].alloc(nbytes)
            except ArenaFull:
                if not self._make_room(tier):
                    raise

    # ------------------------------------------------------------------ placement

    def kept_dtype(self, stored: torch.dtype) -> torch.dtype:  # the module's rule
        return kept_dtype(stored, self.dtype, self.cuda)

    def place(self, slab: torch.Tensor, tier: str = "gpu", all_heads: bool = True,
              region: Region | None = None, row_scales: torch.Tensor | None = None
              ) -> torch.Tensor:
        """``slab`` in the memory format of ``tier`` (device, dtype, layout, heads) in one
        copy, into ``region`` (after its fence) or a new tensor (the kernel's start-up
        probe); ``all_heads=False``: it holds only the store's heads already (and so do
        ``row_scales``). An fp8 slab converted to a float dtype needs its ``row_scales``
        ``[T, 2, L, H]`` (:meth:`Resident.row_scales`)."""
        dtype = self.kept_dtype(slab.dtype)
        if self.heads is not None and all_heads:  # a strided view: the copy reads only these
            slab = self.heads.take(slab)
            row_scales = self.heads.take(row_scales[..., None])[..., 0] \
                if row_scales is not None else None
        order = (KVFormat.TOKEN_MAJOR if self.cuda else KVFormat.LAYER_MAJOR).order
        if is_quantized(slab.dtype) and dtype != slab.dtype:  # the CPU: dequantized, once
            if row_scales is None:
                raise ResidencyError("an fp8 slab needs its scales to be converted")
            if region is None:
                return layer_major(dequantize(slab, row_scales), dtype)
            region.wait_host()
            return dequantize_into(region.view(tuple(slab.shape), dtype, order), slab,
                                   row_scales)
        if region is None:
            if not self.cuda:
                return layer_major(slab, dtype)
            return slab.to(self.device if tier == "gpu" else "cpu", dtype)
        return copy_into(slab, region.view(tuple(slab.shape), dtype, order), region)

    def kept_scales(self, resident: Resident) -> torch.Tensor | None:
        """The scales a placed ``resident`` keeps (its heads): None unless it stays fp8."""
        if resident.scales is None or not is_quantized(self.kept_dtype(resident.slab.dtype)):
            return None
        return self.heads.take_scales(resident.scales) if self.heads is not None \
            else resident.scales

    def placed_bytes(self, slab: torch.Tensor, scales: torch.Tensor | None = None) -> int:
        """Bytes ``slab`` takes once placed (in the dtype it is kept in, the store's
        heads), with its fp8 ``scales`` ``[C, 2, L, H]`` when it stays fp8."""
        dtype = self.kept_dtype(slab.dtype)
        extra = scales.numel() * 4 if scales is not None and is_quantized(dtype) else 0
        return self.share_of(slab.numel() * dtype.itemsize + extra)

    def share_of(self, nbytes: int) -> int:
        """The bytes of the store's heads in a whole slab of ``nbytes``."""
        if self.heads is None:
            return nbytes
        return nbytes // self.heads.total * self.heads.count

    def fit_tier(self, user: str, nbytes: int, tier: str) -> str:
        """The tier a slab of ``nbytes`` asked for on ``tier`` lands on (``gpu`` falls
        back to ``host``), or :class:`ResidencyError` when it exceeds every budget it may
        use. Hydration calls it with the manifest's size before reading anything."""
        if tier not in TIERS:
            raise ResidencyError(f"unknown tier {tier!r}; choose one of {TIERS}")
        if nbytes <= self.budget[tier]:
            return tier
        if tier == "gpu" and nbytes <= self.budget["host"]:
            return "host"
        raise ResidencyError(f"user {user!r}: {nbytes} bytes exceed the {tier} budget "
                             f"({self.budget[tier]} bytes)")

    def used(self, tier: str) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._lru.values() if r.tier == tier)

    def check(self, resident: Resident) -> None:
        """:func:`~inferscale.hydrate.resident.check_servable` for this store's model (its
        geometry, its dtype): once per slab, before it is placed, so nothing of another
        geometry reaches a tier, the device staging memory or a kernel."""
        check_servable(resident, self.geometry, self.dtype or torch.float32)

    def put(self, resident: Resident, tier: str = "gpu") -> Resident:
        """Make ``resident`` available on ``tier`` (replacing the user's older version),
        least recently used users making room. Its slab may sit in a staging region
        (``resident.region``), which is given back (or adopted, when the slab is already
        in the host tier's format). Raises :class:`ResidencyError` if it fits no budget
        or fails :meth:`check`."""
        slab = resident.slab
        staged = resident.region
        try:
            self.check(resident)
            with self._placing:
                self.allocate()
                nbytes = self.placed_bytes(slab, resident.scales)
                tier = self.fit_tier(resident.user, nbytes, tier)
                while self._over(tier, nbytes):
                    if not self._make_room(tier):
                        raise ResidencyError(f"user {resident.user!r}: {nbytes} bytes do "
                                             f"not fit the {tier} budget")
                if self._adoptable(resident, tier):  # already in place: keep its bytes
                    resident.region, staged = staged, None
                    self._unstage("host", resident.region.staged)
                    resident.region.staged = 0
                else:
                    region = self._alloc(tier, self.placed_bytes(slab))
                    dequant = resident.scales is not None and \
                        self.kept_dtype(slab.dtype) != slab.dtype
                    resident.slab = self.place(slab, tier, region=region, row_scales=(
                        resident.row_scales() if dequant else None))
                    resident.region = region
                resident.scales = self.kept_scales(resident)
                resident.tier = tier
                self._insert(resident)
        finally:
            if staged is not None:
                self.release(staged)
        return resident

    def _adoptable(self, r: Resident, tier: str) -> bool:
        return (self.cuda and tier == "host" and r.region is not None and self.heads is None
                and r.slab.dtype == self.kept_dtype(r.slab.dtype) and r.slab.is_contiguous())

    def _insert(self, resident: Resident) -> None:
        with self._lock:
            old = self._lru.pop(resident.user, None)
            if old is not None:
                if old.version != resident.version:
                    self._events.append(StoreEvent("remove", old.user, old.version))
                self._free(old)
            self._lru[resident.user] = resident
            if old is None or old.version != resident.version:
                self._events.append(StoreEvent("add", resident.user, resident.version, resident,
                                               full=self._over("host", resident.nbytes)))

    def _free(self, r: Resident) -> None:
        """Give back ``r``'s tier memory (under the lock: ``r.last_use`` is final)."""
        if r.region is not None:
            self._arenas[r.tier].free(r.region, r.last_use)
            r.region = None

    def _over(self, tier: str, nbytes: int) -> bool:
        return self.used(tier) + nbytes > self.budget[tier]

    def _make_room(self, tier: str) -> bool:
        """Demote (gpu) or drop (host) the tier's least recently used user; False when
        the tier holds nobody."""
        with self._lock:
            victim = next((r for r in self._lru.values() if r.tier == tier), None)
        if victim is None:
            return False
        if tier == "gpu":
            self._demote(victim)
        else:
            self._drop(victim)
        return True

    def _demote(self, victim: Resident) -> None:
        """Copy ``victim`` to the host tier (outside the lock; it keeps serving from the
        gpu meanwhile), then swap."""
        while self._over("host", victim.nbytes):
            if not self._make_room("host"):
                return self._drop(victim)
        src = victim.slab
        region = self._alloc("host", src.numel() * src.element_size())
        order = tuple(sorted(range(src.dim()), key=lambda i: -src.stride(i)))
        dst = copy_into(src, region.view(tuple(src.shape), src.dtype, order), region)
        with self._lock:
            if self._lru.get(victim.user) is not victim:  # replaced or evicted meanwhile
                self._arenas["host"].free(region)
                return
            self._free(victim)
            victim.slab, victim.region, victim.tier = dst, region, "host"
        log.info("demoted user %s (%d bytes) to host memory", victim.user, victim.nbytes)

    def _drop(self, victim: Resident) -> None:
        with self._lock:
            if self._lru.get(victim.user) is not victim:
                return
            del self._lru[victim.user]
            self._events.append(StoreEvent("remove", victim.user, victim.version, None, True))
            self._free(victim)
        log.info("evicted user %s (%d bytes) from %s memory", victim.user, victim.nbytes,
                 victim.tier)

    def set_budgets(self, gpu_bytes: int, host_bytes: int) -> dict:
        """New byte budgets (at most the arenas' sizes once allocated); over-budget users
        are demoted/dropped now."""
        if gpu_bytes < 0 or host_bytes < 0:
            raise ResidencyError("byte budgets must be >= 0")
        with self._placing:
            if self._arenas is not None and isinstance(self._arenas["gpu"], Arena):
                cap = {t: self._arenas[t].capacity - _SLACK - self.reserve[t] for t in TIERS}
                if gpu_bytes > cap["gpu"] or host_bytes > cap["host"]:
                    raise ResidencyError(f"budgets beyond the memory taken at start-up "
                                         f"({cap}); restart with larger budgets")
            self.budget = {"gpu": gpu_bytes, "host": host_bytes}
            for tier in TIERS:
                while self._over(tier, 0) and self._make_room(tier):
                    pass
        return dict(self.budget)

    # ------------------------------------------------------------------ access

    def get(self, user: str, version: str) -> Resident | None:
        """The user's resident version if it is ``version``; marks it recently used."""
        with self._lock:
            r = self._lru.get(user)
            if r is None or r.version != version:
                return None
            self._lru.move_to_end(user)
            return r

    def held(self, user: str) -> Resident | None:
        """The user's resident, whatever its version (not marked as used)."""
        with self._lock:
            return self._lru.get(user)

    def evict(self, user: str) -> bool:
        with self._lock:
            r = self._lru.pop(user, None)
            if r is not None:
                self._events.append(StoreEvent("remove", r.user, r.version))
                self._free(r)
            return r is not None

    def residents(self) -> list[dict]:
        """A summary per resident user, most recently used last."""
        with self._lock:
            return [{"user": r.user, "version": r.version, "tier": r.tier, "bytes": r.nbytes,
                     "dtype": str(r.slab.dtype).removeprefix("torch."), "chunks": len(r.index)}
                    for r in self._lru.values()]

    def take_events(self) -> list[StoreEvent]:
        """Events since the last call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
            return events

    # ------------------------------------------------------------------ gathering

    def gather(self, resident: Resident, chunk_ids: list[str], start: int, end: int,
               out: torch.Tensor) -> None:
        """:meth:`Resident.gather` (memory tokens ``[start, end)`` into ``out``)."""
        resident.gather(chunk_ids, start, end, out)
