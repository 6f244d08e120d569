"""What crosses between the server and the connector, and between the connector's halves.

Server <-> scheduler, through a request's ``kv_transfer_params`` under :data:`PARAMS_KEY`:
:class:`MemoryRef` (which memory the request uses) in, :class:`MemoryReply` (what was
injected, from which tier, or why not: a :class:`~inferscale.vllm_plugin.failures.Fallback`
whose reason travels as its value) back with the finished request. Each has one
``to_params``/``from_params`` pair, used on both sides.

Scheduler -> worker, once per step: :class:`InferScaleMetadata` — the step's loads of
resident memory (:class:`LoadSpec`), reads of non-resident users' facts from storage
(:class:`FetchSpec`), background reloads (:class:`ReloadOrder`) and the durations of
the last busy steps.

Worker -> scheduler: :class:`ResidencyReport` — which (user, version) became resident
(:class:`ResidentAdded`, with its :class:`ResidentInfo`) or went away
(:class:`ResidentRemoved`) on which tensor-parallel rank, the reloads and loads that failed
(:class:`FailedReload`, :class:`FailedLoad`) and where each load's facts came from
(:class:`LoadSources`). Under tensor parallelism every rank reports; vLLM
merges the ranks' reports with :meth:`ResidencyReport.aggregate`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inferscale.hydrate.resident import Resident
from inferscale.vllm_plugin.compat import KVConnectorMetadata, KVConnectorWorkerMetadata
from inferscale.vllm_plugin.config import PARAMS_KEY
from inferscale.vllm_plugin.failures import Fallback, FallbackReason


def request_salt(user: str | None, version: str | None, kind: str) -> str:
    """The ``cache_salt`` of a request of ``user`` (None: anonymous) answered from memory
    ``version`` (None: none) in ``kind`` (``"kv"``: injected memory; ``"prompt"``: memory
    as text; ...). vLLM mixes it into the hash of the first block, so requests share
    prefix-cache blocks only when all three agree: never across users, never between
    injected and prefilled memory."""
    key = json.dumps(["inferscale", kind, user, version])
    return hashlib.sha256(key.encode()).hexdigest()


def _strs(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{what} must be a list of strings, got {type(value).__name__}")
    return tuple(value)


@dataclass(frozen=True)
class MemoryRef:
    """Which memory a request uses: a user's artifact version and its ordered chunks."""

    user: str
    version: str
    chunks: tuple[str, ...]  # "prefix" then fact ids
    # tokens of each chunk: lets the scheduler admit a user the workers do not hold, whose
    # facts are then read from storage for this request (empty: only resident users)
    lengths: tuple[int, ...] = ()
    # the version the caller serves the user from (its LATEST or pin): when the workers
    # hold another version of the user, they reload this one in the background
    supersedes: bool = False
    # when the user is in neither tier: read only the first ``cold_chunks`` chunks from
    # storage and prefill the rest as text (None: read them all; 0: prefill everything).
    # Ignored when the user is resident (everything is injected from memory then).
    cold_chunks: int | None = None
    # seconds the read from storage may take from its start (None: the connector's
    # fetch_timeout_s); past it the read is reported failed and vLLM recomputes
    read_deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.cold_chunks is not None and (type(self.cold_chunks) is not int or
                                             self.cold_chunks < 0):
            raise TypeError("cold_chunks must be a non-negative integer")
        if self.read_deadline_s is not None and not (
                isinstance(self.read_deadline_s, (int, float)) and
                not isinstance(self.read_deadline_s, bool) and
                0 <= self.read_deadline_s < float("inf")):
            raise TypeError("read_deadline_s must be a finite number >= 0")

    def cache_salt(self) -> str:
        """Unique to (user, version): prefix-cache blocks of injected memory are reused
        by this user's requests on this version only."""
        return request_salt(self.user, self.version, "kv")

    def to_params(self) -> dict:
        body: dict[str, Any] = {"user": self.user, "version": self.version,
                                "chunks": list(self.chunks)}
        if self.lengths:
            body["lengths"] = list(self.lengths)
        if self.supersedes:
            body["supersedes"] = True
        if self.cold_chunks is not None:
            body["cold_chunks"] = self.cold_chunks
        if self.read_deadline_s is not None:
            body["read_deadline_s"] = float(self.read_deadline_s)
        return {PARAMS_KEY: body}

    @classmethod
    def from_params(cls, params: dict | None) -> "MemoryRef | None":
        """The ref in a request's ``kv_transfer_params`` (None: none); TypeError or
        ValueError when it is malformed."""
        body = (params or {}).get(PARAMS_KEY)
        if body is None:
            return None
        if not isinstance(body, dict):
            raise TypeError(f"{PARAMS_KEY} must be an object")
        user, version = body.get("user"), body.get("version")
        if not isinstance(user, str) or not isinstance(version, str):
            raise TypeError("user and version must be strings")
        chunks = _strs(body.get("chunks"), "chunks")
        lengths = body.get("lengths") or ()
        if not isinstance(lengths, (list, tuple)) or not all(
                type(n) is int and n >= 0 for n in lengths):
            raise TypeError("lengths must be a list of non-negative integers")
        if lengths and len(lengths) != len(chunks):
            raise ValueError(f"{len(lengths)} lengths for {len(chunks)} chunks")
        return cls(user, version, chunks, tuple(lengths), body.get("supersedes") is True,
                   body.get("cold_chunks"), body.get("read_deadline_s"))


@dataclass(frozen=True)
class ColdSplit:
    """How a request of a user in neither tier was served: facts read from storage and
    injected (``loaded``) and facts prefilled as text (``computed``), and whether it
    waited for a read (an asynchronous load was admitted, whatever its outcome)."""

    loaded: int = 0
    computed: int = 0
    read: bool = False

    def to_params(self) -> dict:
        return {"loaded": self.loaded, "computed": self.computed, "read": self.read}

    @classmethod
    def from_params(cls, body: Any) -> "ColdSplit | None":
        if not isinstance(body, dict):
            return None
        return cls(int(body.get("loaded") or 0), int(body.get("computed") or 0),
                   body.get("read") is True)


@dataclass(frozen=True)
class MemoryReply:
    """What the connector did with a request's memory: tokens injected, facts by the
    tier they were read from, bytes read from storage, why memory was prefilled, and
    for a user in neither tier how its facts were split (:class:`ColdSplit`)."""

    injected_tokens: int = 0
    fallback: Fallback[FallbackReason] | None = None
    facts_by_tier: dict = field(default_factory=dict)  # "gpu" | "host" | "storage" -> n
    storage_bytes: int = 0
    cold: ColdSplit | None = None

    def to_params(self) -> dict:
        body: dict[str, Any] = {"injected_tokens": self.injected_tokens,
                                "facts_by_tier": dict(self.facts_by_tier),
                                "storage_bytes": self.storage_bytes}
        if self.fallback is not None:
            body["fallback"] = self.fallback.detail
            body["fallback_reason"] = self.fallback.reason.value
        if self.cold is not None:
            body["cold"] = self.cold.to_params()
        return {PARAMS_KEY: body}

    @classmethod
    def from_params(cls, params: dict | None) -> "MemoryReply":
        body = (params or {}).get(PARAMS_KEY) or {}
        fallback = None
        if body.get("fallback"):
            fallback = Fallback(FallbackReason.of(body.get("fallback_reason")),
                                str(body["fallback"]))
        return cls(int(body.get("injected_tokens") or 0), fallback,
                   dict(body.get("facts_by_tier") or {}), int(body.get("storage_bytes") or 0),
                   ColdSplit.from_params(body.get("cold")))


@dataclass
class LoadSpec:
    """One request's memory load for this step: tokens ``[start, end)`` of its memory."""

    req_id: str
    user: str
    version: str
    chunks: list[str]
    start: int
    end: int
    slot_mapping: np.ndarray  # [end - start] paged-cache slot of each token
    block_ids: list[int]  # blocks covering [start, end), reported if the load fails


@dataclass
class FetchSpec(LoadSpec):
    """A load of a user the workers do not hold: its chunks are read from storage
    (asynchronously; the request waits) and must carry exactly ``expected`` token ids
    (the prompt's tokens ``[start, end)``). ``deadline_s``: how long the read may take
    from its start (None: the connector's ``fetch_timeout_s``)."""

    expected: list[int] = field(default_factory=list)
    deadline_s: float | None = None


@dataclass
class ReloadOrder:
    """Ask workers to hydrate a user's version in the background (``tier`` None: the tier
    the user's current version is on, else the connector's ``reload_tier``)."""

    user: str
    version: str
    tier: str | None


@dataclass
class InferScaleMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    loads: list[LoadSpec] = field(default_factory=list)
    fetches: list[FetchSpec] = field(default_factory=list)
    reloads: list[ReloadOrder] = field(default_factory=list)
    failed_blocks: list[int] = field(default_factory=list)  # admitted, then failed: recompute
    scheduler_errors: int = 0  # the scheduler side's failure count (shown in status)
    # wall seconds of the busy engine steps since the last metadata, and of the scheduler
    # hooks in them: the worker keeps the histograms the server's /metrics reads
    step_seconds: list[float] = field(default_factory=list)
    prefill_busy: float = 0.0  # share of recent time with prompt tokens left over (backlog.py)
    prefill_tokens_per_s: float = 0.0  # prompt tokens scheduled per second, recent (same)
    prefill_token_s: float = 0.0  # seconds a prompt token adds to a step; 0: unknown (same)
    prefill_step_base_s: float = 0.0  # a busy step's seconds without prompt tokens (same)
    prefill_request_s: float = 0.0  # what a request's prefill adds besides its tokens (same)
    prefill_base_share: float = 0.0  # share of time in prompt steps' bases and requests (same)
    scheduler_seconds: float = 0.0
    promotions_declined: int = 0  # misses that did not promote their user (promotion.py)


@dataclass
class ResidentInfo:
    """What the scheduler needs to know about one resident (user, version). Every rank
    reads the same artifact version, so only rank 0 sends the chunks' token ids (the
    other ranks' ``token_ids`` are empty)."""

    user: str
    version: str
    fingerprint: str
    token_ids: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, r: Resident, with_tokens: bool = True) -> "ResidentInfo":
        return cls(r.user, r.version, r.fingerprint, r.token_ids if with_tokens else {})


@dataclass(frozen=True)
class ResidentAdded:
    """Tensor-parallel rank ``rank`` holds ``info``'s (user, version) now; ``full``: its
    host tier has no room left for another user of this one's size (promotion.py)."""

    rank: int
    info: ResidentInfo
    full: bool = False


@dataclass(frozen=True)
class ResidentRemoved:
    """Tensor-parallel rank ``rank`` no longer holds ``user``'s ``version``; ``for_room``:
    dropped to make room for another user (not replaced, not evicted by an admin)."""

    rank: int
    user: str
    version: str
    for_room: bool = False


@dataclass(frozen=True)
class FailedReload:
    """A background reload of ``user``'s ``version`` that failed, and why."""

    user: str
    version: str
    reason: str


@dataclass(frozen=True)
class FailedLoad:
    """Request ``req_id``'s load that the worker refused or failed, and why (recomputed)."""

    req_id: str
    reason: str


@dataclass(frozen=True)
class LoadSources:
    """Where request ``req_id``'s injected facts came from: facts by tier, and the bytes
    read from storage for it."""

    req_id: str
    facts_by_tier: dict[str, int]
    storage_bytes: int = 0


@dataclass
class ResidencyReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler: residency changes since the last report, oldest first, each
    naming the reporting worker's tensor-parallel rank; the reloads and loads that failed;
    and per load where its facts came from (rank 0's only)."""

    changes: list[ResidentAdded | ResidentRemoved] = field(default_factory=list)
    failed_reloads: list[FailedReload] = field(default_factory=list)
    failed_loads: list[FailedLoad] = field(default_factory=list)
    sources: list[LoadSources] = field(default_factory=list)

    def aggregate(self, other: "ResidencyReport") -> "ResidencyReport":
        """vLLM's merge of the ranks' reports of one step (``KVOutputAggregator``, in
        rank order): each change keeps its rank, so concatenating loses nothing; the
        scheduler counts a user resident only once every rank has reported it."""
        return ResidencyReport(self.changes + other.changes,
                               self.failed_reloads + other.failed_reloads,
                               self.failed_loads + other.failed_loads,
                               self.sources + other.sources)
