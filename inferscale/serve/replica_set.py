"""The gateway's side of the memory replicas: the
:class:`~inferscale.serve.backend.MemoryBackend` the HTTP app
(:func:`inferscale.serve.app.create_app`) calls when several replicas serve, in place of a
single :class:`~inferscale.serve.server.MemoryServer`.

:class:`ReplicaSet` sends each call through a Ray Serve deployment handle tagged with a
routing key (:mod:`inferscale.serve.placement`), so the memory router
(:mod:`inferscale.serve.router`) sends it to the replica that holds the user's memory:

- chat: ``prepare`` (retrieve and compose on the user's replica; a prompt too long is a
  400 before any stream starts), then ``generate`` there; ``answer`` for unary requests;
  a stream the app stops reading (its client went) cancels the replica's call, which
  closes the replica's generation (vLLM aborts the request);
- ``hydrate``: the user's home only; ``evict``, ``status`` and ``/metrics``: every slot.

**When a replica dies** (its actor or its engine), a call that has sent no output to
the client is retried on the user's next choice, up to ``retries`` times; a stream that
has sent output ends with ``finish_reason: "error"`` and ``inferscale.error`` saying
so. Every wait for a replica (an answer, the next streamed token) is bounded by
``timeout_s``; past it the call is cancelled and answered 504 (or ends the stream with
the error). No request waits forever, and no request is sent to another user's key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Literal

from inferscale.serve.api_models import RequestError
from inferscale.serve.backend import Answer, AnswerRequest
from inferscale.serve.engine import Generation
from inferscale.serve.placement import home_key, slot_key, user_key
from inferscale.serve.server import Prepared

log = logging.getLogger("inferscale.serve.replicas")
Routing = Literal["memory", "default"]


@dataclass(frozen=True)
class ReplicaConfig:
    """How the gateway talks to the replicas (``INFERSCALE_REPLICA_*``).

    ``routing``: ``memory`` (this package's router; the default) or ``default`` (Ray
    Serve's own router and no routing keys: the benchmark's contrast; status and
    ``/metrics`` then reach whichever replicas Ray picks)."""

    timeout_s: float = 600.0
    retries: int = 2
    max_ongoing_requests: int = 32
    routing: Routing = "memory"

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError("replica timeout_s must be > 0")
        if self.retries < 0 or self.max_ongoing_requests < 1:
            raise ValueError("replica retries must be >= 0 and max_ongoing_requests >= 1")
        if self.routing not in ("memory", "default"):
            raise ValueError(f"routing must be 'memory' or 'default', not {self.routing!r}")

    @classmethod
    def from_settings(cls, settings: Any, routing: Routing = "memory") -> "ReplicaConfig":
        return cls(settings.replica_timeout_s, settings.replica_retries,
                   settings.replica_max_ongoing_requests, routing)


def replica_gone(exc: BaseException) -> bool:
    """Whether ``exc`` says the replica (its actor, or the engine inside it) is gone, so
    the call may go to another replica: not an error of the request itself."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError

    if isinstance(exc, (RayActorError, ReplicaUnavailableError)):
        return True
    return any(c.__name__ in ("EngineDeadError", "ReplicaDraining") for c in type(exc).__mro__)


def _own_error(exc: BaseException) -> BaseException:
    """The request's own error raised in a replica, as raised there (Ray wraps it in a
    RayTaskError that is also an instance of its class, but whose message carries the
    remote traceback): a PromptTooLong stays a PromptTooLong with its own message."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc


class GatewayMetrics:
    """The gateway's own counters, and ``/metrics``: every replica's scrape labelled with
    ``replica="<slot>"``, then these."""

    def __init__(self, replicas: "ReplicaSet") -> None:
        from prometheus_client import CollectorRegistry, Counter

        self.replicas = replicas
        self.registry = CollectorRegistry(auto_describe=True)
        self.retries = Counter("inferscale_gateway_retries",
                               "Requests sent again because their replica died before "
                               "any output", registry=self.registry)
        self.failures = Counter("inferscale_gateway_failures",
                                "Requests ended by the gateway: died_mid_stream, "
                                "no_replica (retries exhausted), timeout", ["reason"],
                                registry=self.registry)
        for reason in ("died_mid_stream", "no_replica", "timeout"):
            self.failures.labels(reason)

    async def render(self) -> bytes:
        from prometheus_client import generate_latest

        texts = {s["replica"]: s["text"] for s in await self.replicas.each_slot("metrics")
                 if s.get("state") == "running"}
        return labelled_scrapes(texts) + generate_latest(self.registry)


def labelled_scrapes(texts: dict[int, str]) -> bytes:
    """Prometheus scrapes of several replicas as one, each sample labelled with its
    replica's slot (families merged by name, so each HELP/TYPE appears once)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for slot, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            out = families.get(fam.name)
            if out is None:
                out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                  fam.unit)
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, "replica": str(slot)}, s.value,
                               s.timestamp, s.exemplar)

    class Scrapes:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Scrapes())
    return generate_latest(registry)


@dataclass
class RemotePrepared:
    """A chat request prepared on a replica: its :class:`Prepared` and routing key.
    (``abort_reason`` is set by the app like a :class:`Prepared`'s; the replica counts a
    cancelled call as ``cancelled``.)"""

    prepared: Prepared
    key: str
    abort_reason: str | None = None


class ReplicaSet:
    """The :class:`~inferscale.serve.backend.MemoryBackend` of the replicas: each call
    goes to the replica that owns the user (see the module's docstring)."""

    def __init__(self, handle: Any, config: ReplicaConfig, mode: str, app_name: str,
                 deployment: str):
        self.handle, self.config, self.mode = handle, config, mode
        self.app_name, self.deployment = app_name, deployment
        self.metrics = GatewayMetrics(self)

    # ------------------------------------------------------------------ calls

    def _handle(self, key: str, stream: bool = False) -> Any:
        opts: dict[str, Any] = {"stream": stream}
        if self.config.routing == "memory" and key:
            opts["multiplexed_model_id"] = key
        return self.handle.options(**opts)

    async def _call(self, key: str, method: str, *args: Any, timeout_s: float | None = None,
                    **kwargs: Any) -> Any:
        """One unary call, retried on the next replica while replicas die under it."""
        timeout = timeout_s or self.config.timeout_s
        for attempt in range(self.config.retries + 1):
            response = getattr(self._handle(key), method).remote(*args, **kwargs)
            try:
                return await asyncio.wait_for(_result(response), timeout)
            except asyncio.TimeoutError:
                response.cancel()
                self.metrics.failures.labels("timeout").inc()
                raise RequestError(504, f"no replica answered {method} within {timeout:g} s "
                                   "(INFERSCALE_REPLICA_TIMEOUT_S)") from None
            except Exception as exc:  # noqa: BLE001 - sorted below
                if not replica_gone(exc):
                    raise _own_error(exc) from None
                log.warning("replica died under %s (attempt %d): %s", method, attempt + 1,
                            str(exc).splitlines()[0])
                if attempt < self.config.retries:
                    self.metrics.retries.inc()
        self.metrics.failures.labels("no_replica").inc()
        raise RequestError(503, f"{method}: the replicas serving this request died "
                           f"{self.config.retries + 1} times; try again")

    async def each_slot(self, method: str, *args: Any) -> list[dict]:
        """``method(slot, *args)`` on every slot's replica: one dict per slot,
        ``state: "unavailable"`` (with the reason) for a slot no live replica holds.

        One slot after the other: Ray Serve 2.60's router indexes a pending request by
        its ``internal_request_id``, which every handle call made while serving one HTTP
        request shares, so concurrent calls of one request can be paired with each
        other's replicas."""
        slots = await self.slot_count()
        timeout = min(self.config.timeout_s, 60.0)

        async def one(slot: int) -> dict:
            try:
                return await self._call(slot_key(slot), method, slot, *args, timeout_s=timeout)
            except Exception as exc:  # noqa: BLE001 - reported per slot
                return {"replica": slot, "state": "unavailable",
                        "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}

        return [await one(s) for s in range(slots)]

    async def slot_count(self) -> int:
        """The deployment's replicas (running, starting or restarting), from Ray Serve's
        controller: the slots 0 .. n-1."""
        from ray import serve

        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(self.app_name)
        dep = app.deployments.get(self.deployment) if app else None
        if dep is None:
            return 0
        return sum(n for state, n in dep.replica_states.items() if state != "STOPPING")

    # ------------------------------------------------------------------ the app's API

    async def prepare(self, request: AnswerRequest) -> RemotePrepared:
        key = user_key(request.user)
        return RemotePrepared(await self._call(key, "prepare", request), key)

    async def answer_stream(self, prepared: RemotePrepared,
                            started: float) -> AsyncIterator[str | Answer]:
        """The replica's stream; retried while nothing was sent, an error item after.
        Closed or cancelled once the replica has answered, it cancels the replica's call
        (before that, cancelling the wait cancels the call)."""
        sent = 0
        for attempt in range(self.config.retries + 1):
            stream = self._handle(prepared.key, stream=True).generate.remote(
                prepared.prepared, time.perf_counter() - started)
            answered = False
            try:
                while True:
                    try:
                        item = await asyncio.wait_for(stream.__anext__(), self.config.timeout_s)
                    except StopAsyncIteration:
                        return
                    answered = True
                    if isinstance(item, str):
                        sent += 1
                    yield item
            except (GeneratorExit, asyncio.CancelledError):
                # only once answered: its replica is known, so cancel() does not block on
                # the router (Ray Serve 2.60 resolves the assignment synchronously)
                if answered:
                    stream.cancel()
                raise
            except asyncio.TimeoutError:
                stream.cancel()
                self.metrics.failures.labels("timeout").inc()
                yield _error_item(prepared, f"no output from the replica for "
                                     f"{self.config.timeout_s:g} s", sent)
                return
            except Exception as exc:  # noqa: BLE001 - sorted below
                first = str(_own_error(exc)).splitlines()[0][:300]
                if not replica_gone(exc):  # the stream has begun: end it, saying why
                    yield _error_item(prepared, f"the replica failed: {first}", sent)
                    return
                if sent:
                    self.metrics.failures.labels("died_mid_stream").inc()
                    yield _error_item(prepared, f"the replica serving this answer died after "
                                         f"{sent} outputs ({first}); the answer is incomplete",
                                      sent)
                    return
                log.warning("replica died before any output (attempt %d): %s", attempt + 1,
                            first)
                if attempt < self.config.retries:
                    self.metrics.retries.inc()
        self.metrics.failures.labels("no_replica").inc()
        yield _error_item(prepared, f"the replicas serving this answer died "
                             f"{self.config.retries + 1} times", 0)

    async def answer(self, request: AnswerRequest) -> Answer:
        return await self._call(user_key(request.user), "answer", request)

    async def hydrate(self, user: str, *, version: str = "latest", tier: str = "gpu") -> dict:
        """On the user's home replica (``hydrate maya`` lands where maya's requests go)."""
        return await self._call(home_key(user), "hydrate", user, version=version, tier=tier)

    async def evict(self, user: str) -> bool:
        """On every replica: a user spilled or failed over may be held by more than one."""
        results = await self.each_slot("evict", user)
        down = [r["replica"] for r in results if r.get("state") != "running"]
        if down:
            raise RequestError(503, f"replicas {down} are not running: {user} may still be "
                               "held there; evict again once they are back")
        return any(r["evicted"] for r in results)

    async def status(self) -> dict:
        replicas = await self.each_slot("status")
        users = sorted({u for r in replicas for u in r.get("users", [])})
        return {"mode": self.mode, "routing": self.config.routing, "users": users,
                "replicas": replicas}

    async def render_metrics(self) -> bytes:
        """Every running replica's scrape labelled with its slot, then the gateway's."""
        return await self.metrics.render()

    def close(self) -> None:
        """Nothing to release: Ray Serve owns the replicas (and their engines)."""


async def _result(response: Any) -> Any:
    return await response


def _error_item(p: RemotePrepared, message: str, sent: int) -> Answer:
    """The last item of a stream the gateway ends: finish_reason ``error``, and why."""
    gen = Generation([], "", 0.0, len(p.prepared.ids), 0, "error")
    return Answer(gen, replace(p.prepared.info, error=message))
