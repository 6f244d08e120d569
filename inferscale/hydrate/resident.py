"""The worker-resident memory store: per user, one KV slab and its chunk index.

Lives in the vLLM worker process (owned by the connector's worker side).
:class:`~inferscale.hydrate.loader.ResidentLoader` puts users' slabs here (an admin
hydration through the engine's collective RPC, or a reload the scheduler asked for); the
connector's ``start_load_kv`` gathers chunks from it.

Two tiers: ``gpu`` (device memory; on a CPU-only build, CPU memory) and ``host``
(pinned host memory when CUDA exists). A slab is always the logical ``[T, 2, L, H, D]``;
a store serving a CPU engine keeps it layer-major in memory (``[2, L, T, H, D]`` behind a
permuted view, see :func:`layer_major`) so the CPU injection kernel streams one layer's
rows per thread; slabs for a CUDA engine stay token-major, so a host-tier run of rows is
one contiguous pinned copy. A store made with a ``dtype`` (the connector passes the
engine's model dtype: the dtype its attention writes K/V in) converts every slab to it
when it is placed, once, at hydrate time: an artifact encoded in bfloat16 serves on a
float32 CPU engine, and the per-step injection never meets a second dtype.

Under tensor parallelism a worker holds only its rank's KV heads: a store made with a
:class:`HeadShard` keeps heads ``[start, start + count)`` of every slab, cut out in the same
copy that places it (the heads a rank does not serve never reach its device, nor its
budgets).

Each tier has a byte budget (counted in the converted dtype): when the gpu tier
overflows, its least-recently-used users move to host; when host overflows, its
least-recently-used users are dropped (a later request reloads them). A user holds at
most one version; putting a new version replaces the old one.

Only this module touches slabs; everything here is plain torch.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from inferscale.types import TIERS

if TYPE_CHECKING:
    from storage_schemas.manifest import Manifest

log = logging.getLogger("inferscale.hydrate.resident")


def layer_major(slab: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``slab [T, 2, L, H, D]`` copied (and converted to ``dtype``) in one pass into
    layer-major CPU memory, viewed as ``[T, 2, L, H, D]``."""
    src = slab.permute(1, 2, 0, 3, 4)  # [2, L, T, H, D] view
    out = torch.empty(src.shape, dtype=dtype or slab.dtype)
    out.copy_(src)
    return out.permute(2, 0, 1, 3, 4)


class ResidencyError(RuntimeError):
    """A slab that cannot be made resident (too large for every budget, bad shape)."""


@dataclass(frozen=True)
class HeadShard:
    """KV heads ``[start, start + count)`` of a model's ``total``: what one tensor-parallel
    rank holds (built by the connector's worker half from vLLM's sharding rule,
    :func:`inferscale.vllm_plugin.compat.kv_head_shard`)."""

    start: int
    count: int
    total: int

    def __post_init__(self) -> None:
        if not (0 <= self.start and 0 < self.count and self.start + self.count <= self.total):
            raise ValueError(f"heads [{self.start}, {self.start + self.count}) are not "
                             f"inside the model's {self.total} KV heads")

    def take(self, slab: torch.Tensor) -> torch.Tensor:
        """This shard's heads of ``slab [T, 2, L, H, D]``: a view ``[T, 2, L, count, D]``
        (nothing copied)."""
        if slab.dim() != 5 or slab.shape[3] != self.total:
            raise ResidencyError(f"slab {tuple(slab.shape)} has not the model's {self.total} "
                                 "KV heads in dimension 3 of [T, 2, L, H, D]")
        return slab[:, :, :, self.start:self.start + self.count]


@dataclass
class Resident:
    """One user's verified KV memory of one artifact version: what hydration returns
    (:func:`inferscale.hydrate.slab.hydrate`) and what the store holds."""

    user: str
    version: str
    fingerprint: str  # the model fingerprint the KV was encoded with
    slab: torch.Tensor  # [T, 2, L, H, D], the stored dtype (in a store: its heads, dtype)
    index: dict[str, tuple[int, int]]  # chunk_id -> (row offset, length)
    token_ids: dict[str, tuple[int, ...]]  # chunk_id -> token ids
    tier: str = "gpu"  # where the slab is (the store sets it when it places the slab)
    manifest: Manifest | None = None  # the version's manifest, when read by hydration
    content_keys: dict[str, str] = field(default_factory=dict)  # chunk_id -> key (kv v2+)

    @property
    def nbytes(self) -> int:
        return self.slab.numel() * self.slab.element_size()

    def chunk(self, chunk_id: str) -> torch.Tensor:
        """Rows of one chunk: a view ``[t, 2, L, H, D]``."""
        offset, length = self.index[chunk_id]
        return self.slab[offset:offset + length]

    def kv_by_content_key(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``content key -> (keys, values)``, each a view ``[L, t, H, D]`` of the slab (the
        encoder's chunk layout), for every chunk stored with a key. Called by the pipeline
        to reuse a previous version's K/V (``encode.encoder.encode_facts(reuse=...)``)."""
        out = {}
        for chunk_id, key in self.content_keys.items():
            rows = self.chunk(chunk_id)  # [t, 2, L, H, D]
            out[key] = (rows[:, 0].permute(1, 0, 2, 3), rows[:, 1].permute(1, 0, 2, 3))
        return out

    def rows(self, chunk_ids: list[str]) -> list[tuple[int, int]]:
        """(offset, length) of each chunk, in request order; KeyError if unknown."""
        return [self.index[c] for c in chunk_ids]

    def runs(self, chunk_ids: list[str], start: int, end: int) -> list[tuple[int, int]]:
        """Memory tokens ``[start, end)`` of the chunks' concatenation as merged runs of
        slab rows: ``(first row, count)``."""
        runs: list[tuple[int, int]] = []
        pos = 0
        for off, length in self.rows(chunk_ids):
            lo, hi = max(start, pos), min(end, pos + length)
            if lo < hi:
                row = off + lo - pos
                if runs and runs[-1][0] + runs[-1][1] == row:
                    runs[-1] = (runs[-1][0], runs[-1][1] + hi - lo)
                else:
                    runs.append((row, hi - lo))
            pos += length
        return runs


@dataclass
class StoreEvent:
    """A resident added (``resident`` set) or removed, in the order it happened."""

    op: str  # "add" | "remove"
    user: str
    version: str
    resident: Resident | None = None


class ResidentStore:
    """Per-user slabs under gpu/host byte budgets with LRU demotion and eviction.

    Thread-safe: background reloads ``put`` while the forward path ``get``s.
    """

    def __init__(self, device: torch.device | str, gpu_budget_bytes: int,
                 host_budget_bytes: int, dtype: torch.dtype | None = None,
                 heads: HeadShard | None = None):
        self.device = torch.device(device)
        self.dtype = dtype  # every slab is converted to it when placed; None: kept as is
        self.heads = heads  # the KV heads kept of every slab; None: all of them
        self.budget = {"gpu": gpu_budget_bytes, "host": host_budget_bytes}
        self._lru: OrderedDict[str, Resident] = OrderedDict()  # user -> resident, LRU first
        self._lock = threading.RLock()
        self._events: list[StoreEvent] = []
        self.pin = torch.cuda.is_available()

    # ------------------------------------------------------------------ placement

    def place(self, slab: torch.Tensor, tier: str, owned: bool = False,
              all_heads: bool = True) -> torch.Tensor:
        """``slab`` in the memory, layout and dtype of ``tier`` (at most one copy), cut to
        the store's heads; ``owned``: it is already one of this store's slabs (a demotion);
        ``all_heads=False``: it holds only the store's heads already (the injection
        kernel's probe)."""
        dtype = self.dtype or slab.dtype
        cut = self.heads is not None and not owned and all_heads
        if cut:  # a strided view: the one copy below reads only these heads
            slab = self.heads.take(slab)
        if self.device.type == "cpu":  # CPU engine: both tiers in CPU memory, layer-major
            # (a copy, so the store owns its bytes rather than a file map)
            return slab if owned else layer_major(slab, dtype)
        if tier == "gpu":
            return slab.to(self.device, dtype)
        if slab.device.type == "cpu" and slab.dtype == dtype and not cut and \
                (slab.is_pinned() or not self.pin):
            return slab
        out = torch.empty(slab.shape, dtype=dtype, pin_memory=self.pin)
        out.copy_(slab)
        return out

    def placed_bytes(self, slab: torch.Tensor) -> int:
        """Bytes ``slab`` takes once placed (in the store's dtype, the store's heads)."""
        return self.share_of(slab.numel() * (self.dtype or slab.dtype).itemsize)

    def share_of(self, nbytes: int) -> int:
        """The bytes of the store's heads in a whole slab of ``nbytes`` (all of them
        without a :class:`HeadShard`)."""
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

    def put(self, resident: Resident, tier: str = "gpu") -> Resident:
        """Make ``resident`` available on ``tier`` (replacing the user's older version)
        and enforce budgets. Raises :class:`ResidencyError` if it fits no budget."""
        if resident.slab.dim() != 5 or resident.slab.shape[1] != 2:
            raise ResidencyError(f"slab must be [T, 2, L, H, D], got {tuple(resident.slab.shape)}")
        tier = self.fit_tier(resident.user, self.placed_bytes(resident.slab), tier)
        resident.slab = self.place(resident.slab, tier)
        resident.tier = tier
        with self._lock:
            old = self._lru.pop(resident.user, None)
            if old is not None and old.version != resident.version:
                self._events.append(StoreEvent("remove", old.user, old.version))
            self._lru[resident.user] = resident
            if old is None or old.version != resident.version:
                self._events.append(StoreEvent("add", resident.user, resident.version, resident))
            self._enforce_budgets()
        return resident

    def _enforce_budgets(self) -> None:
        # gpu overflow: demote least recently used to host
        while self.used("gpu") > self.budget["gpu"]:
            victim = next(r for r in self._lru.values() if r.tier == "gpu")
            victim.slab = self.place(victim.slab, "host", owned=True)
            victim.tier = "host"
            log.info("demoted user %s (%d bytes) to host memory", victim.user, victim.nbytes)
        # host overflow: drop least recently used
        while self.used("host") > self.budget["host"]:
            victim = next(r for r in self._lru.values() if r.tier == "host")
            del self._lru[victim.user]
            self._events.append(StoreEvent("remove", victim.user, victim.version))
            log.info("evicted user %s (%d bytes) from host memory", victim.user, victim.nbytes)

    def set_budgets(self, gpu_bytes: int, host_bytes: int) -> dict:
        if gpu_bytes < 0 or host_bytes < 0:
            raise ResidencyError("byte budgets must be >= 0")
        with self._lock:
            self.budget = {"gpu": gpu_bytes, "host": host_bytes}
            self._enforce_budgets()
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
        """Copy memory tokens ``[start, end)`` of the chunks' concatenation into ``out``.

        ``out``: ``[end - start, 2, L, H, D]`` on the compute device, any dtype (converted
        on the way). From a token-major slab on the compute device this is one
        ``index_select``; otherwise (host tier behind a GPU, layer-major CPU slabs) one
        non-blocking copy per contiguous run of needed rows (pinned host -> device),
        nothing else moved.
        """
        runs = resident.runs(chunk_ids, start, end)
        slab = resident.slab
        if slab.device == out.device and slab.is_contiguous():
            if len(runs) == 1:
                out.copy_(slab[runs[0][0]:runs[0][0] + runs[0][1]])
                return
            idx = torch.cat([torch.arange(r, r + n) for r, n in runs]).to(slab.device)
            if slab.dtype == out.dtype:
                torch.index_select(slab, 0, idx, out=out)
            else:
                out.copy_(torch.index_select(slab, 0, idx))
            return
        at = 0  # host -> device, or a layer-major slab: one strided copy per run
        for row, n in runs:
            out[at:at + n].copy_(slab[row:row + n], non_blocking=True)
            at += n

