"""The server's side of the compute-or-load split (:mod:`inferscale.serve.cold_split`).

:class:`ColdRequests` decides each ``kv`` request's split at composition, from the
estimates of now (vLLM's stats of finished requests, the workers' storage statistics,
read at most every ``poll_s``, and the prefill this server handed the engine that is
still ahead: :class:`~inferscale.serve.prefill_queue.PrefillQueue`, which every request
enters when it is handed over and leaves at its first token); asks the workers to start
reading the split's chunks before the engine sees the request (the ``inferscale_prefetch``
RPC, sent ahead of it on the same socket), unless the user was in a tier when last seen
(an answer, or the server's own hydrate or eviction, says); and, once the request
has finished, feeds the estimator (a cold request also with its split's branch, for what
loads cost beyond the rule: :mod:`inferscale.serve.load_excess`), remembers where the
user was found, and reports a cold request's split in its answer. Event-loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict

from inferscale.serve.backend import AnswerInfo
from inferscale.serve.cold_split import ColdSplitConfig, LoadEstimator, Split, split
from inferscale.serve.engine import Generation, MemoryEngine
from inferscale.serve.load_excess import Branch
from inferscale.serve.prefill_queue import PrefillQueue
from inferscale.vllm_plugin.metadata import MemoryRef

log = logging.getLogger("inferscale.serve")
REMEMBERED = 10_000  # users whose last known residency is kept (least recent dropped)


def branch(s: Split) -> Branch:
    """What the rule predicted for split ``s`` besides its computed tokens (loading,
    ``max(R, W) + D``; computing everything, ``W``), the ``ρ`` and the ``W`` it saw."""
    e = s.estimates
    predicted = max(s.read_s, e.wait_s) + e.overhead_s if s.chunks else e.wait_s
    return bool(s.chunks), predicted, e.prefill_busy, e.wait_s


class ColdRequests:
    """Splits, prefetches and the estimator of one server's engine."""

    def __init__(self, config: ColdSplitConfig | None = None):
        self.config = config or ColdSplitConfig()
        self.estimator = LoadEstimator(self.config)
        self._poll: asyncio.Future | None = None  # the workers' storage statistics
        self._resident: OrderedDict[str, bool] = OrderedDict()  # user -> last seen in a tier
        self.queue = PrefillQueue()  # prefill handed to the engine, not come back yet
        # the same account of the reads asked for (seconds at B), by prefill handle
        self.reads = PrefillQueue()
        self._read_of: dict[int, int] = {}

    @property
    def on(self) -> bool:
        return self.config.mode != "off"

    def split(self, engine: MemoryEngine, lengths: tuple[int, ...], row_bytes: int) -> Split:
        """The split of a request's memory chunks by the estimates of now (and ask the
        workers for fresh storage statistics when they are older than ``poll_s``)."""
        self.estimator.queue(*engine.waiting_now())
        at = self.estimator.storage_at
        if (self._poll is None or self._poll.done()) and \
                (at is None or time.monotonic() - at > self.config.poll_s):
            self._poll = asyncio.ensure_future(engine.storage_stats())
            self._poll.add_done_callback(self._storage_stats)
        pinned = self.config.pinned_chunks if self.config.mode == "pinned" else None
        est = self.estimator.estimates(ahead_s=self.queue.ahead(),
                                       reads_ahead_s=self.reads.ahead())
        return split(lengths, row_bytes, est, self.config.deadline_factor, pinned)

    def handed_over(self, prompt_tokens: int, ref: MemoryRef | None, s: Split | None) -> int:
        """Enter a request handed to the engine in the prefill queue with its predicted
        prefill: a busy step plus ``c`` a token it computes (its prompt less the memory a
        tier or the split's read gives it; a user neither answered nor hydrated yet counts
        as in storage, as for the prefetch), and its split's read (what :meth:`prefetch`
        asks for) in the read queue at ``B``; the handle for :meth:`came_back`."""
        injected, read = 0, None
        if ref is not None:
            if self._resident.get(ref.user):
                injected = sum(ref.lengths)
            elif s is not None:
                injected = s.tokens
                read = s.bytes if s.chunks else None
        est = self.estimator.estimates()
        handle = self.queue.submit(
            est.step_s + est.compute_s_per_token * max(0, prompt_tokens - injected))
        if read is not None:
            self._read_of[handle] = self.reads.submit(est.read_overhead_s
                                                      + read / est.bandwidth)
        return handle

    def came_back(self, handle: int) -> None:
        """The request's first token came, or it ended without one (its read, if any,
        is over: it was injected or given up)."""
        self.queue.done(handle)
        read = self._read_of.pop(handle, None)
        if read is not None:
            self.reads.done(read)

    def _storage_stats(self, done: asyncio.Future) -> list[dict] | None:
        if done.cancelled() or done.exception() is not None:
            log.warning("reading the workers' storage statistics failed: %r",
                        None if done.cancelled() else done.exception())
            return None
        self.estimator.storage(done.result())
        return done.result()

    async def prefetch(self, engine: MemoryEngine, ref: MemoryRef | None,
                       s: Split | None) -> None:
        """Have the workers start reading the split's chunks before the engine sees the
        request, unless the user was in a tier when last seen (a stale guess only costs
        the overlap: the read then starts when the engine schedules the request)."""
        if ref is None or s is None or not s.chunks or self._resident.get(ref.user):
            return
        deadline = engine.config.connector.fetch_timeout_s if s.deadline_s is None \
            else s.deadline_s
        task = await engine.prefetch(ref, s.chunks, deadline, s.bytes)

        def done(t: asyncio.Future) -> None:
            stats = self._storage_stats(t)
            if stats:
                self.seen(ref.user, all(r.get("resident") for r in stats))

        task.add_done_callback(done)

    def status(self) -> dict:
        """The split's estimates now and the residuals ``E`` stands on (``/admin/status``)."""
        now = time.monotonic()
        est = self.estimator.estimates(now, self.queue.ahead(), self.reads.ahead()).info()
        return {"mode": self.config.mode,  # JSON has no inf: an unknown figure is None
                "estimates": {k: v if v is None or math.isfinite(v) else None
                              for k, v in est.items()},
                "excess_residuals": self.estimator.excess.snapshot(now)}

    def seen(self, user: str, resident: bool) -> None:
        """Where ``user`` was found (an answer) or put (an admin hydrate or eviction): in a
        tier or not."""
        self._resident[user] = resident
        self._resident.move_to_end(user)
        while len(self._resident) > REMEMBERED:
            self._resident.popitem(last=False)

    def finished(self, ref: MemoryRef | None, s: Split | None, gen: Generation,
                 info: AnswerInfo) -> None:
        """Feed the estimator (vLLM's queue and prefill times of the request, when its
        answer has them) and the residency guess; report a cold request's split in its
        answer's ``info``."""
        cold, tiers = gen.reply.cold, gen.reply.facts_by_tier
        if gen.stages_s is not None:
            self.estimator.finished(
                *gen.stages_s, max(0, gen.prompt_tokens - gen.cached_tokens),
                bool(cold and cold.read),
                branch(s) if cold is not None and s is not None else None)
        if ref is None:
            return
        if cold is not None:
            self.seen(ref.user, False)
            info.cold = {"facts_loaded": cold.loaded, "facts_computed": cold.computed,
                         "bytes_read": gen.reply.storage_bytes,
                         "split": s.info() if s else None}
        elif tiers.get("gpu") or tiers.get("host"):
            self.seen(ref.user, True)
