"""The load benchmark's server process and the benchmark's handle on it.

The process (``python -m benchmarks.lib.load.server_process CONFIG.json``): InferScale's
OpenAI-compatible app (:func:`inferscale.serve.app.serve_app`, the code ``inferscale
serve`` runs) on 127.0.0.1, over the engine the benchmark describes (a real checkpoint,
or a dummy-weight shape that ``inferscale serve`` cannot start). ``CONFIG.json``:
``{"engine": {EngineConfig fields}, "tokenizer": dir, "embedder": name or dir, "top_k":
k, "model_name": name, "port": p, "memory_cache": {MemoryCacheConfig fields},
"cold_split": {ColdSplitConfig fields}, "info_path": file}`` (the engine's version and
effective scheduling limits are written to ``info_path`` once it is up). No API keys:
loopback only, the body's ``user`` field names the user (the app's loopback policy). The
memory cache's limits come from the config, not from ``INFERSCALE_SERVE_*``, so that the
result records them: a run of many users at once needs a storage-miss burst of at least
the number of users, or their first lookups are shed (docs/serving.md).

The handle (used by ``benchmarks.load``): :class:`ServerProcess` starts and stops it
or stock ``vllm serve`` (:mod:`benchmarks.lib.load.peer`) (its own session, so nothing of it
outlives the benchmark), :class:`Http` calls its
health, admin and metrics endpoints with the standard library (nothing the GPU machine
might lack), :func:`scrape` reads ``/metrics`` (parsed by :mod:`benchmarks.lib.load.scrapes`),
:func:`evict_all` empties the workers' tiers between scenarios.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from inferscale.settings import offline_environment

offline_environment()

from benchmarks.lib.load.scrapes import metric, parse  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server in a subprocess of its own session (``argv``, answering on 127.0.0.1 at
    ``port``); its output goes to ``log``. :meth:`inferscale`: this module's server."""

    def __init__(self, argv: list[str], port: int, log: Path, env: dict | None = None):
        self.argv, self.port = argv, port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})},
                                     start_new_session=True)

    @classmethod
    def inferscale(cls, config: dict, work: Path, log: Path) -> "ServerProcess":
        """This module's server on ``config`` (written to ``work``); once it
        is up, :meth:`engine_info` holds its engine's effective scheduling limits."""
        cfg_path = work / "server.json"
        config = {**config, "info_path": str(work / "server-info.json")}
        cfg_path.write_text(json.dumps(config))
        Path(config["info_path"]).unlink(missing_ok=True)
        env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        server = cls([sys.executable, "-m", __spec__.name, str(cfg_path)], config["port"], log,
                     env)
        server.info_path = Path(config["info_path"])
        return server

    def engine_info(self) -> dict | None:
        """What the InferScale server wrote once its engine was up (None: nothing)."""
        path = getattr(self, "info_path", None)
        return json.loads(path.read_text()) if path and path.is_file() else None

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; "
                                   f"see {self.log.name}")
            try:
                if Http(self.url, timeout=2).get("/health")[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not answer within {timeout:.0f} s")
            time.sleep(1)

    def stop(self) -> None:
        """SIGTERM (uvicorn stops, the engine shuts down), then whatever of the server's
        process group is left (vLLM's engine core and workers) is killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 0)):
            try:
                os.killpg(self.proc.pid, sig)  # its own session: nothing else is in it
            except ProcessLookupError:
                break
            time.sleep(wait)
        self.proc.wait(30)
        self.log.close()


class Http:
    """A blocking client of the server's own endpoints (health, admin, metrics), from the
    standard library: no proxy, nothing the GPU machine might lack."""

    def __init__(self, base: str, timeout: float = 600):
        import urllib.request

        self.base, self.timeout = base, timeout
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _call(self, req) -> tuple[int, str]:
        import urllib.error

        try:
            with self.opener.open(req, timeout=self.timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def get(self, path: str) -> tuple[int, str]:
        return self._call(self.base + path)

    def post(self, path: str, body: dict) -> tuple[int, str]:
        import urllib.request

        return self._call(urllib.request.Request(
            self.base + path, data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"}))


def scrape_text(http: Http) -> str:
    status, text = http.get("/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}: {text[:200]}")
    return text


def scrape(http: Http) -> dict:
    """``/metrics`` -> {(sample name, sorted labels): value}
    (:mod:`benchmarks.lib.load.scrapes`)."""
    return parse(scrape_text(http))


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from ``/proc``; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def engine_core_pid(server_pid: int) -> int | None:
    """vLLM's engine-core process under the server: the one vLLM titles ``EngineCore``
    (``VLLM::EngineCore`` where setproctitle is installed, the multiprocessing name
    otherwise); failing that, the largest other Python child (not multiprocessing's
    resource tracker, not a worker), which holds the model and the tiers."""
    best, best_rss = None, -1
    for pid in descendants(server_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            comm = Path(f"/proc/{pid}/comm").read_text()
            rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if "EngineCore" in cmd or "EngineCore" in comm:
            return pid
        if ("resource_tracker" not in cmd and "VLLM::Worker" not in cmd
                and "python" in (cmd + comm).lower() and rss > best_rss):
            best, best_rss = pid, rss
    return best


def worker_pids(server_pid: int) -> list[int]:
    """vLLM's worker processes under the server (``VLLM::Worker*``: the CPU build and
    tensor parallelism; a single GPU runs its worker inside the engine core)."""
    out = []
    for pid in descendants(server_pid):
        try:
            if b"VLLM::Worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            continue
    return sorted(out)


def admin_status(http: Http) -> dict:
    """The server's ``/admin/status``; raises unless it answered 200."""
    status, text = http.get("/admin/status")
    if status != 200:
        raise RuntimeError(f"/admin/status answered {status}: {text[:300]}")
    return json.loads(text)


def engine_status(http: Http) -> dict:
    """The workers' status (``/admin/status``'s ``engine``: rank 0's, every rank's under
    ``ranks``)."""
    return admin_status(http)["engine"]


def split_state(http: Http) -> dict | None:
    """The compute-or-load split's estimates now and the residuals its ``E`` stands on
    (``/admin/status``'s ``cold_split``; None in prompt mode)."""
    return admin_status(http).get("cold_split")


def residency(http: Http) -> dict[str, str]:
    """user -> tier of every user a worker rank holds (``/admin/status``)."""
    engine = engine_status(http)
    return {r["user"]: r["tier"] for rank in engine.get("ranks", [engine])
            for r in rank.get("residents", [])}


def evict_all(http: Http, tries: int = 3) -> list[str]:
    """Evict every resident user through the admin API (a background reload still landing
    can add one back: tried again); the users evicted. Raises if users stay."""
    evicted: list[str] = []
    for _ in range(tries):
        users = sorted(residency(http))
        if not users:
            return evicted
        for user in users:
            status, text = http.post("/admin/evict", {"user": user})
            if status != 200:
                raise RuntimeError(f"evicting {user}: {status} {text[:300]}")
            evicted.append(user)
        time.sleep(0.5)
    left = sorted(residency(http))
    if left:
        raise RuntimeError(f"{len(left)} users still resident after eviction: {left[:5]}")
    return evicted


def hydrate_plan(http: Http, tiers: dict[str, list[str]], flagged: list[str] = ()) -> float:
    """Hydrate the planned users (``tiers``: tier -> users, most active first), least
    active first, so that the most active are the most recently used (the host tier
    evicts the least recently used). Seconds taken.

    ``flagged``: users of the storage tier that an earlier admin eviction keeps from being
    reloaded (the workers reload no admin-evicted user until it is hydrated again):
    hydrated into the host tier first, which lifts that, then pushed out of it by the
    planned host users (least recently used)."""
    t0 = time.perf_counter()
    for tier, users in (("host", flagged), ("host", tiers["host"][::-1]),
                        ("gpu", tiers["gpu"][::-1])):
        for user in users:
            status, text = http.post("/admin/hydrate", {"user": user, "tier": tier})
            if status != 200 or json.loads(text)["tier"] != tier:
                raise RuntimeError(f"hydrating {user} into {tier}: {status} {text[:300]}")
    return time.perf_counter() - t0


def preload_facts(http: Http, versions: dict[str, str], threads: int = 8,
                  timeout_s: float = 600) -> dict:
    """Hydrate the facts alone (``tier: facts``) of every user of ``versions`` (user ->
    version) the server does not hold at that version, ``threads`` at a time: their
    requests then find their facts and retrieval index held, as a vector store holds
    them, while their KV stays in storage; then wait (at most ``timeout_s``) until the
    workers have read the chunk indexes those hydrates primed. The users loaded, the
    seconds taken, and of them the wait for the indexes."""
    from concurrent.futures import ThreadPoolExecutor

    held = admin_status(http).get("versions") or {}
    todo = [u for u, v in versions.items() if held.get(u) != v]
    t0 = time.perf_counter()

    def one(user: str) -> None:
        status, text = http.post("/admin/hydrate", {"user": user, "tier": "facts"})
        if status != 200 or json.loads(text)["version"] != versions[user]:
            raise RuntimeError(f"preloading {user}'s facts: {status} {text[:300]}")

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, todo))
    t1 = time.perf_counter()
    while (left := _priming(http)) and time.perf_counter() < t1 + timeout_s:
        time.sleep(0.5)
    return {"users": len(todo), "held_before": len(versions) - len(todo),
            "seconds": round(time.perf_counter() - t0, 1),
            "index_wait_seconds": round(time.perf_counter() - t1, 1), "indexes_left": left}


def _priming(http: Http) -> int:
    """Chunk indexes the workers (every rank) are still priming."""
    engine = engine_status(http)
    return sum(r.get("fetches", {}).get("priming", 0) for r in engine.get("ranks", [engine]))


async def wait_idle(http, timeout: float) -> None:
    """Until vLLM runs and queues no request (the previous step drained)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = await asyncio.to_thread(scrape, http)
        if metric(m, "vllm:num_requests_running") + metric(m, "vllm:num_requests_waiting") == 0:
            return
        await asyncio.sleep(0.5)


async def serve(cfg: dict) -> None:
    import torch

    from inferscale.artifacts.layout import StoreConfig
    from inferscale.serve.access import AccessPolicy
    from inferscale.serve.app import serve_app
    from inferscale.serve.engine import EngineConfig, MemoryEngine
    from inferscale.serve.retrieval import Embedder
    from inferscale.serve.server import ServerConfig, build_server

    import vllm

    from inferscale.serve.cold_split import ColdSplitConfig
    from inferscale.serve.memory_cache import MemoryCacheConfig

    cuda = torch.cuda.is_available()
    engine = await MemoryEngine(EngineConfig.of(**cfg["engine"])).start()
    if cfg.get("info_path"):  # what the benchmark records of the running engine
        Path(cfg["info_path"]).write_text(json.dumps(
            {"vllm_version": vllm.__version__, "scheduler": engine.scheduler_limits()}))
    embedder = Embedder(cfg["embedder"], device="cuda" if cuda else "cpu",
                        dtype=torch.float16 if cuda else None)
    server = build_server(engine, cfg["tokenizer"], embedder,
                          StoreConfig(cfg["engine"]["artifact_root"],
                                      direct_io=cfg["engine"].get("direct_io", False)),
                          ServerConfig(mode="kv", top_k=cfg["top_k"],
                                       cache=MemoryCacheConfig(**cfg.get("memory_cache", {})),
                                       cold=ColdSplitConfig(**cfg.get("cold_split", {}))))
    await serve_app(server, AccessPolicy({}, None, None, loopback=True), cfg["model_name"],
                    "127.0.0.1", cfg["port"], log_level="warning")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if args and args[0] in ("-h", "--help") else 2)
    asyncio.run(serve(json.loads(Path(args[0]).read_text())))


if __name__ == "__main__":
    main()
