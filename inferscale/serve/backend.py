"""What the HTTP app needs from whatever answers it: the :class:`MemoryBackend` protocol.

:func:`~inferscale.serve.app.create_app` talks only to a :class:`MemoryBackend`, as vLLM's
OpenAI server talks to an ``EngineClient`` whichever engine stands behind it: the
single-engine :class:`~inferscale.serve.server.MemoryServer`, or the Ray Serve gateway's
:class:`~inferscale.serve.replica_set.ReplicaSet`, which sends each call to the replica
that holds the user's memory. What crosses the seam is typed here, once:

- :class:`AnswerRequest`: one request's parameters, as the app reads them from the body
  and the server (on a replica too) uses them;
- :class:`Answer`: the engine's :class:`~inferscale.serve.engine.Generation` and the
  :class:`AnswerInfo` the API returns as its ``inferscale`` extra (:meth:`AnswerInfo.
  to_json`) and the server's metrics count;
- :class:`PromptTooLong`: the request's own error the app answers with a 400.

Imports nothing heavy: the app and the request models import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, AsyncIterator, Literal, Protocol

if TYPE_CHECKING:
    from inferscale.serve.engine import Generation
    from inferscale.types import HydrateTarget
    from inferscale.vllm_plugin.failures import Fallback

Mode = Literal["kv", "prompt"]


class PromptTooLong(ValueError):
    """A composed prompt plus ``max_tokens`` beyond the engine's ``max_model_len``."""


@dataclass(frozen=True)
class AnswerRequest:
    """One chat request's parameters (the app builds it from the body and the caller's
    identity; a backend answers it)."""

    user: str | None  # whose memory it may use (None: none)
    question: str
    top_k: int | None = None  # None: the server's
    mode: Mode | None = None  # None: the server's
    max_tokens: int | None = None  # None: the server's
    temperature: float = 0.0
    ignore_eos: bool = False  # generate exactly max_tokens (vLLM's extension)
    shed: bool = True  # the user's first memory lookup may be shed (False: an API key's user)


@dataclass
class Timings:
    """Milliseconds spent per stage of one answer (None: the stage did not run)."""

    embed: float | None = None
    retrieve: float | None = None
    compose: float | None = None
    memory: float | None = None  # the memory lookup, retrieval and composition together
    engine_ttft: float | None = None
    query_to_first_token: float | None = None
    lookup: float | None = None  # of ``memory``, the lookup alone (a first load reads storage)
    # of ``engine_ttft``, as the engine core timed them: queued until first scheduled (an
    # asynchronous load of memory included), then its prefill; the rest is the hops
    # between the engine's processes, its output processing and the wait for the step in
    # progress when the request arrived (the engine core queues a request between steps)
    engine_queued: float | None = None
    engine_prefill: float | None = None

    def to_json(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


@dataclass
class AnswerInfo:
    """What an answer says about its memory: the API's ``inferscale`` extra
    (:meth:`to_json`; docs/serving.md lists it) and what the server's metrics count.

    ``mode`` is ``kv``, ``prompt`` or ``none`` (answered from the question alone);
    ``memory_tokens``: the memory's tokens in the prompt however vLLM got them (injected,
    prefix-cache hits, or prefilled); ``injected_tokens``: those the connector injected;
    ``fallback``: why memory went unused (the connector's, or the server's own:
    :class:`~inferscale.vllm_plugin.failures.Fallback`). A field that is None is left out
    of the JSON, except ``user`` and ``version``."""

    user: str | None
    mode: str
    facts: list[str] = field(default_factory=list)
    version: str | None = None
    memory_tokens: int | None = None
    text_tail_tokens: int | None = None
    timings_ms: Timings = field(default_factory=Timings)
    fallback: Fallback | None = None
    replica: dict | None = None  # {"slot", "home"}: the replica that served it
    injected_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    facts_by_tier: dict[str, int] | None = None  # where the injected facts were read from
    storage_bytes: int | None = None
    cold: dict | None = None  # a user in neither tier: facts loaded and computed, the split
    error: str | None = None  # a stream the gateway ended: why

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "timings_ms":
                out[f.name] = value.to_json()
            elif f.name == "fallback":
                if value is not None:
                    out.update(fallback=value.detail, fallback_reason=value.reason.value)
            elif value is not None or f.name in ("user", "version"):
                out[f.name] = value
        return out


@dataclass
class Answer:
    """A finished answer: the engine's generation and what it says about its memory."""

    generation: Generation
    info: AnswerInfo


class Prepared(Protocol):
    """A request a backend has prepared (memory looked up, prompt composed) and will
    stream. Whoever stops reading its answer and knows why says so in ``abort_reason``
    (``client_disconnected``: the HTTP layer), for the abort count."""

    abort_reason: str | None


class MemoryBackend(Protocol):
    """What the HTTP app calls: chat (unary, or prepared then streamed), admin and status,
    and its metrics. Errors of the request itself: :class:`PromptTooLong`,
    :class:`~inferscale.serve.api_models.RequestError` (with its status)."""

    @property
    def mode(self) -> str:
        """The default memory mode (``kv`` or ``prompt``), for ``/health``."""
        ...

    async def prepare(self, request: AnswerRequest) -> Prepared:
        """Look up the user's memory and compose the prompt: before a stream starts, so
        that a prompt too long is a 400, not a broken stream."""
        ...

    def answer_stream(self, prepared: Prepared, started: float) -> AsyncIterator[str | Answer]:
        """The text of each new output as it arrives, then the :class:`Answer`. Closing
        it aborts the request in the engine. ``started``: when the request began
        (``time.perf_counter()``), for its query-to-first-token time."""
        ...

    async def answer(self, request: AnswerRequest) -> Answer:
        """:meth:`prepare`, then the whole answer."""
        ...

    async def hydrate(self, user: str, *, version: str = "latest",
                      tier: HydrateTarget = "gpu") -> dict:
        """Load the user's memory (an explicit version pins it) and its KV into ``tier``
        (``facts``: the memory alone)."""
        ...

    async def evict(self, user: str) -> bool:
        """Drop the user everywhere; whether it was held."""
        ...

    async def status(self) -> dict:
        """``/admin/status``: the users and versions held, and the engines' status."""
        ...

    async def render_metrics(self) -> bytes:
        """``/metrics``: one scrape in the Prometheus text format."""
        ...

    def close(self) -> None:
        """Release what the backend owns (its engine, its loading threads)."""
        ...
