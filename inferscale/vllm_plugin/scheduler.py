"""The connector's scheduler half (engine-core process): which requests get memory KV.

A request names its memory with a :class:`~inferscale.vllm_plugin.metadata.MemoryRef`.
:class:`ConnectorScheduler` keeps a *residency view* — which (user, version) the workers
hold, under which model fingerprint, and each chunk's token ids — built only from what
the workers report. Under tensor parallelism each rank holds its own KV heads of a user
and reports on its own: the view is kept per rank, and a user is resident only when
every rank holds that version.

:meth:`~ConnectorScheduler.get_num_new_matched_tokens` reports the memory tokens as
externally available when

- the user's version is resident, the fingerprint is the engine's, every chunk is known
  and the prompt begins with exactly the chunks' token ids: the workers inject it within
  the step (a synchronous load); or
- no rank holds the user (or holds an older version the request supersedes), the ref
  carries its chunks' lengths and the tokens in flight stay within ``fetch_tokens``: the
  workers read the first ``ref.cold_chunks`` chunks (all without it) from storage and
  inject them, and the request waits for that (an asynchronous load; a read that fails,
  or whose token ids are not the prompt's, is recomputed). vLLM lets loaded tokens be
  only a prefix of the prompt; the later chunks are in the prompt anyway and vLLM
  prefills them (the server's compute-or-load split; 0 chunks: no fallback). Meanwhile
  the whole user is reloaded in the background, so its later requests find it resident,
  when the promotion rule admits it (:mod:`~inferscale.vllm_plugin.promotion`: every miss
  while the tiers have room, then only users asked for a request more than the
  least-asked resident).

Otherwise it returns 0 and the request prefills (the reason is logged and returned); so
does a request whose load the workers reported failed (vLLM recomputes its blocks and
asks again: a read from storage that always fails, a version of another geometry, would
otherwise be admitted, fail and be recomputed forever). A miss orders a background
reload as described above, after a failed reload not before a back-off
(``reload_backoff_s``, doubling per failure). An exception in any hook degrades to "0
external tokens" (the request prefills; a request already admitted has its blocks
reported as load errors), logged and counted.

The scheduler also times the engine's busy steps (from one ``build_connector_meta`` to
the next while a request of the earlier step is still running) and its own hooks; both
go to the worker with the next metadata, whose histograms the server's /metrics reads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from inferscale.vllm_plugin.backlog import PrefillBacklog
from inferscale.vllm_plugin.compat import block_ids_of
from inferscale.vllm_plugin.config import ConnectorConfig
from inferscale.vllm_plugin.failures import Fallback, FallbackReason, Failures
from inferscale.vllm_plugin.promotion import Reloads
from inferscale.types import PREFIX_ID
from inferscale.vllm_plugin.metadata import (
    ColdSplit, FetchSpec, InferScaleMetadata, LoadSpec, MemoryRef, MemoryReply,
    ResidencyReport, ResidentAdded, ResidentInfo,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# Under vLLM's logger namespace, so its handlers print these in every engine process.
log = logging.getLogger("vllm.inferscale.connector")


@dataclass
class _Plan:
    ref: MemoryRef
    start: int
    end: int
    fetch: bool = False  # read from storage (the user is not resident)
    chunks: int = 0  # how many leading chunks of the ref are loaded


def _facts(chunks: tuple[str, ...]) -> int:
    return sum(c != PREFIX_ID for c in chunks)


class ConnectorScheduler:
    """The scheduler half: residency view, admission, per-step load specs."""

    def __init__(self, config: ConnectorConfig, block_size: int, tp_size: int = 1):
        self.config = config
        self.block_size = block_size
        self.tp_size = tp_size
        # per tensor-parallel rank: user -> the version that rank holds
        self._ranks: list[dict[str, ResidentInfo]] = [{} for _ in range(tp_size)]
        self._plans: dict[str, _Plan] = {}
        self._to_load: dict[str, _Plan] = {}
        self._fetches: list[FetchSpec] = []  # admitted this step, sent with its metadata
        self._fetching: dict[str, int] = {}  # request id -> tokens read for it (in flight)
        self.reloads = Reloads(config)  # whole-user reloads: which, pending, back-off
        self.injected_tokens: dict[str, int] = {}
        self._sources: dict[str, tuple[dict, int]] = {}  # request id -> facts by tier, bytes
        self._fallbacks: dict[str, Fallback] = {}  # request id -> why memory was prefilled
        self._cold: dict[str, ColdSplit] = {}  # request id -> its split (user in no tier)
        self._recompute: set[str] = set()  # its read failed: vLLM asks again, it prefills
        self._unloadable: set[str] = set()  # admitted, but no load could be planned
        self._disabled: Fallback | None = None  # set: no memory is admitted any more
        self.failures = Failures()
        # step timing: the last step's start and requests, requests finished since
        self._step_at: float | None = None
        self._step_reqs: set[str] = set()
        self._finished: set[str] = set()
        self._steps: list[float] = []
        self.backlog = PrefillBacklog()  # how congested prefill is (backlog.py)
        self._hook_s = 0.0

    # ------------------------------------------------------------------ admission

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Memory tokens beyond ``num_computed_tokens`` that the workers can inject, and
        whether they are loaded asynchronously (0 on any error: the request prefills)."""
        t0 = time.perf_counter()
        try:
            return self._matched(request, num_computed_tokens)
        except Exception as exc:  # noqa: BLE001 - never into vLLM's step
            self._failed("get_num_new_matched_tokens", request.request_id, exc)
            return 0, False
        finally:
            self._hook_s += time.perf_counter() - t0

    def _matched(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        ref = MemoryRef.from_params(request.kv_transfer_params)
        if ref is None:
            return 0, False
        req_id = request.request_id
        self._plans.pop(req_id, None)
        first = self.reloads.seen(req_id, ref.user)
        if req_id in self._recompute:  # a failed load from nothing valid: it is computed
            return 0, False
        self._cold.pop(req_id, None)
        why = fetch = None
        n = len(ref.chunks)  # chunks loaded: all of them, unless read from storage
        refused = self._refusal(ref, request, first)  # not from resident memory
        if refused is not None:
            if ref.cold_chunks is not None:
                n = min(n, ref.cold_chunks)
            why = self._unfetchable(ref, request, *refused, n)
            fetch = why is None  # from storage, then
        if why is not None:
            if self._fallbacks.get(req_id) != why:
                log.warning("request %s (user %s, version %s): prefilling memory, %s",
                            req_id, ref.user, ref.version[:12], why.detail)
            self._fallbacks[req_id] = why
            return 0, False
        self._fallbacks.pop(req_id, None)
        if fetch:
            memory = sum(ref.lengths[:n])
            self._cold[req_id] = ColdSplit(0, _facts(ref.chunks))  # until a read is admitted
        else:
            info = self._resident(ref.user, ref.version)
            memory = sum(len(info.token_ids[c]) for c in ref.chunks)
        end = min(memory, len(request.prompt_token_ids) - 1)  # at least one token computed
        if end <= num_computed_tokens:  # nothing to load (n = 0, or all found cached)
            return 0, False
        self._plans[req_id] = _Plan(ref, num_computed_tokens, end, bool(fetch), n)
        return end - num_computed_tokens, bool(fetch)

    def _unfetchable(self, ref: MemoryRef, request: "Request", why: Fallback,
                     fetchable: bool, n: int) -> Fallback | None:
        """None when a refused request's first ``n`` chunks can be read from storage for
        it instead (``fetchable``: nobody holds the user, or an older version it
        supersedes; the ref says how long its chunks are; the tokens in flight stay within
        ``fetch_tokens``), else why not."""
        if not (fetchable and ref.lengths and self.config.fetch_tokens and
                self.config.artifact_root) or self._disabled:
            return why
        need = sum(ref.lengths[:n])
        if len(request.prompt_token_ids) <= sum(ref.lengths):
            return why
        if need == 0:  # nothing read: the request prefills its memory, by choice
            return None
        in_flight = sum(self._fetching.values())
        if in_flight + need > self.config.fetch_tokens:
            return Fallback(why.reason, f"{why.detail}, storage reads busy ({in_flight} "
                                        "tokens in flight)")
        return None

    def _failed(self, hook: str, req_id: str, exc: BaseException) -> None:
        """A hook raised for ``req_id``: count, log, and prefill its memory."""
        self._plans.pop(req_id, None)
        fallback = Fallback(FallbackReason.CONNECTOR_ERROR,
                            f"connector error in {hook}: {type(exc).__name__}: {exc}")
        if self._fallbacks.get(req_id) != fallback:  # once per request, not per retry
            self.failures.record(f"request {req_id}: {hook}", exc, "prefilling its memory")
            self._fallbacks[req_id] = fallback

    def _refusal(self, ref: MemoryRef, request: "Request",
                 first: bool) -> tuple[Fallback, bool] | None:
        """Why this request's memory cannot be injected from resident memory, with whether
        its chunks may be read from storage instead (no rank holds the user, or the ranks
        hold an older version the request ``supersedes``); None when it can be injected.
        A miss orders a background reload when the workers (some ranks, under tensor
        parallelism) hold nothing of the user and the promotion rule admits it (decided
        once per request: its ``first`` ask), or hold another version it supersedes."""
        if self._disabled:
            return self._disabled, False
        user, version = ref.user, ref.version
        info = self._resident(user, version)
        if info is None:
            held = [r[user].version for r in self._ranks if user in r]
            others = [v for v in held if v != version]
            if not held:
                if first:  # a miss: promote the user if it is asked for enough
                    self.reloads.miss(user, version, self._ranks[0])
                return Fallback(FallbackReason.NOT_RESIDENT, "user not resident"), True
            if others:  # (some ranks may hold this version already: mid-reload)
                if ref.supersedes:
                    self.reloads.order(user, version, None)  # into the old version's tier
                return Fallback(FallbackReason.STALE_VERSION, "stale version (workers hold "
                                f"{others[0][:12]})"), ref.supersedes
            # some ranks hold this version, the others nothing (their own budgets dropped it)
            self.reloads.order(user, version, self.config.reload_tier)  # holders skip it
            why = f"user not resident on every rank ({len(held)} of {self.tp_size} hold it)"
            return Fallback(FallbackReason.NOT_RESIDENT, why), False
        if info.fingerprint != self.config.model_fingerprint:
            return Fallback(FallbackReason.FINGERPRINT_MISMATCH,
                            "artifact model fingerprint differs from the engine's"), False
        if not ref.chunks:
            return Fallback(FallbackReason.TOKEN_MISMATCH, "no chunks named"), False
        ids: list[int] = []
        for c in ref.chunks:
            if c not in info.token_ids:
                return Fallback(FallbackReason.TOKEN_MISMATCH, f"unknown chunk {c!r}"), False
            ids.extend(info.token_ids[c])
        prompt = request.prompt_token_ids or []
        if len(prompt) <= len(ids) or list(prompt[:len(ids)]) != ids:
            return Fallback(FallbackReason.TOKEN_MISMATCH,
                            "prompt does not begin with the memory's token ids"), False
        return None

    def _resident(self, user: str, version: str) -> ResidentInfo | None:
        """Rank 0's info on ``user``'s ``version`` when every rank holds it, else None."""
        infos = [r.get(user) for r in self._ranks]
        if any(i is None or i.version != version for i in infos):
            return None
        return infos[0]

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        t0 = time.perf_counter()
        req_id = request.request_id
        try:
            plan = self._plans.pop(req_id, None)
            if num_external_tokens <= 0 or plan is None:
                return
            plan.start = plan.end - num_external_tokens
            if not plan.fetch:
                self._to_load[req_id] = plan
                return
            # asynchronous: vLLM passes every block of the request; the load goes out
            # with this step's metadata and the request waits until the workers report it
            block_ids = list(blocks.get_block_ids()[0])
            slots, covered = self._slots(block_ids, plan.start, plan.end)
            ref, loaded = plan.ref, plan.ref.chunks[:plan.chunks]
            self._fetches.append(FetchSpec(
                req_id, ref.user, ref.version, list(loaded), plan.start, plan.end, slots,
                covered, expected=list(request.prompt_token_ids[plan.start:plan.end]),
                deadline_s=ref.read_deadline_s))
            self._fetching[req_id] = plan.end - plan.start
            self.injected_tokens[req_id] = plan.end - plan.start
            self._cold[req_id] = ColdSplit(_facts(loaded), _facts(ref.chunks[plan.chunks:]),
                                           read=True)
        except Exception as exc:  # noqa: BLE001 - never into vLLM's step
            self._failed("update_state_after_alloc", req_id, exc)
            if num_external_tokens > 0:  # vLLM counts them computed: report them failed
                self._unloadable.add(req_id)
        finally:
            self._hook_s += time.perf_counter() - t0

    def _slots(self, block_ids: list[int], start: int, end: int) -> tuple[np.ndarray, list[int]]:
        """Paged-cache slot of each token in ``[start, end)``, and the blocks they use."""
        bs = self.block_size
        pos = np.arange(start, end)
        slots = np.asarray(block_ids, dtype=np.int64)[pos // bs] * bs + pos % bs
        return slots, block_ids[start // bs:(end - 1) // bs + 1]

    # ------------------------------------------------------------------ each step

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> InferScaleMetadata:
        t0 = time.perf_counter()
        self._time_step(t0, scheduler_output)
        reloads, declined = self.reloads.take()
        meta = InferScaleMetadata(reloads=reloads, fetches=self._fetches,
                                  promotions_declined=declined)
        self._fetches = []
        try:
            self._plan_loads(meta, scheduler_output)
        except Exception as exc:  # noqa: BLE001 - never into vLLM's step
            # the blocks of this step's admitted loads are unknown: they can be neither
            # loaded nor reported, so no request is admitted from now on
            cause = self.failures.record("build_connector_meta", exc,
                                         "no memory is injected from now on")
            self._disabled = Fallback(FallbackReason.CONNECTOR_ERROR,
                                      f"connector disabled after an error ({cause})")
        meta.scheduler_errors = self.failures.count
        meta.step_seconds, self._steps = self._steps, []
        meta.prefill_busy, meta.prefill_tokens_per_s = self.backlog.busy, self.backlog.token_rate
        meta.prefill_token_s, meta.prefill_step_base_s, meta.prefill_request_s = \
            self.backlog.fitted(t0)
        meta.prefill_base_share = self.backlog.base_share(t0)
        self._hook_s += time.perf_counter() - t0
        meta.scheduler_seconds, self._hook_s = self._hook_s, 0.0
        return meta

    def _time_step(self, now: float, scheduler_output: "SchedulerOutput") -> None:
        """Close the previous step's interval if it was busy: one of its requests is
        still running, so the engine went straight on to this step."""
        busy = None
        if self._step_at is not None and self._step_reqs - self._finished:
            busy = now - self._step_at
            self._steps.append(busy)
        self.backlog.step(scheduler_output, busy, now)
        self._finished.clear()
        counts = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        self._step_reqs = set(counts)
        self._step_at = now if counts else None

    def _plan_loads(self, meta: InferScaleMetadata, scheduler_output: "SchedulerOutput") -> None:
        block_ids = self._scheduled_blocks(scheduler_output)
        for req_id in self._unloadable & block_ids.keys():
            self._unloadable.discard(req_id)
            meta.failed_blocks.extend(block_ids[req_id])
        for req_id, plan in list(self._to_load.items()):
            if req_id not in block_ids:
                continue  # not scheduled this step; stays pending
            del self._to_load[req_id]
            try:
                slots, blocks = self._slots(block_ids[req_id], plan.start, plan.end)
                meta.loads.append(LoadSpec(req_id, plan.ref.user, plan.ref.version,
                                           list(plan.ref.chunks), plan.start, plan.end,
                                           slots, blocks))
                self.injected_tokens[req_id] = plan.end - plan.start
            except Exception as exc:  # noqa: BLE001 - its blocks are recomputed instead
                self._failed("build_connector_meta", req_id, exc)
                meta.failed_blocks.extend(block_ids[req_id])

    def _scheduled_blocks(self, scheduler_output: "SchedulerOutput") -> dict[str, list[int]]:
        """Block ids of the requests this step schedules that may need a load."""
        block_ids: dict[str, list[int]] = {}
        for new_req in scheduler_output.scheduled_new_reqs:
            block_ids[new_req.req_id] = block_ids_of(new_req)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            # resumed after preemption: new_block_ids then lists all the request's blocks
            if (req_id in self._to_load or req_id in self._unloadable) and req_id in resumed \
                    and cached.new_block_ids[i]:
                block_ids[req_id] = list(cached.new_block_ids[i][0])
        return block_ids

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._fetching.pop(req_id, None)  # its storage read is done (or gave up)
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(report, ResidencyReport):
            return
        try:
            self._apply(report)
        except Exception as exc:  # noqa: BLE001 - the workers re-check every load anyway
            self.failures.record("update_connector_output", exc,
                                 "the residency view may lag (loads are checked by workers)")

    def _apply(self, report: ResidencyReport) -> None:
        for change in report.changes:
            held = self._ranks[change.rank]
            if not isinstance(change, ResidentAdded):  # removed
                user, version = change.user, change.version
                if user in held and held[user].version == version:
                    del held[user]
                self.reloads.removed(user, version, change.for_room)
                continue
            info = change.info
            held[info.user] = info  # a rank holds one version per user
            self.reloads.added(info.user, change.full)
            if self._resident(info.user, info.version) is not None:  # every rank holds it
                self.reloads.held(info.user, info.version)
        self.reloads.failed(report.failed_reloads)
        for load in report.failed_loads:  # the worker logged and counted it
            req_id = load.req_id
            if self.injected_tokens.pop(req_id, None) is not None:
                self._fallbacks[req_id] = Fallback(
                    FallbackReason.LOAD_ERROR, f"memory load failed ({load.reason}); recomputed")
            # vLLM asks again for a request whose asynchronous load left nothing valid
            self._recompute.add(req_id)
            cold = self._cold.get(req_id)
            if cold is not None:  # every fact was computed after all
                self._cold[req_id] = ColdSplit(0, cold.loaded + cold.computed, cold.read)
        for s in report.sources:
            self._sources[s.req_id] = (s.facts_by_tier, s.storage_bytes)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict | None]:
        """The request's :class:`MemoryReply`; its blocks stay allocated while a read
        from storage may still write them (the workers then report it finished)."""
        req_id = request.request_id
        self._finished.add(req_id)
        self.backlog.finished(req_id)
        self.reloads.finished(req_id)
        self._plans.pop(req_id, None)
        self._to_load.pop(req_id, None)
        self._unloadable.discard(req_id)
        self._recompute.discard(req_id)
        tiers, nbytes = self._sources.pop(req_id, ({}, 0))
        reply = MemoryReply(self.injected_tokens.pop(req_id, 0),
                            self._fallbacks.pop(req_id, None), tiers, nbytes,
                            self._cold.pop(req_id, None))
        return req_id in self._fetching, reply.to_params()
