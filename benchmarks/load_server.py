"""The load benchmark's server process and the benchmark's handle on it.

The process (``python benchmarks/load_server.py CONFIG.json``): InferScale's
OpenAI-compatible app (:func:`inferscale.serve.app.serve_app`, the code ``inferscale
serve`` runs) on 127.0.0.1, over the engine the benchmark describes (a real checkpoint,
or a dummy-weight shape that ``inferscale serve`` cannot start). ``CONFIG.json``:
``{"engine": {EngineConfig fields}, "tokenizer": dir, "embedder": name or dir, "top_k":
k, "model_name": name, "port": p}``. No API keys: loopback only, the body's ``user``
field names the user (the app's loopback policy).

The handle (used by ``benchmarks/load.py``): :class:`ServerProcess` starts and stops it
(its own session, so nothing of it outlives the benchmark), :class:`Http` calls its
health, admin and metrics endpoints with the standard library (nothing the GPU machine
might lack), :func:`scrape` parses ``/metrics`` with prometheus_client's parser.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferscale.settings import offline_environment  # noqa: E402

offline_environment()

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``benchmarks/load_server.py`` in a subprocess; its output goes to ``log``."""

    def __init__(self, config: dict, work: Path, log: Path):
        self.port = config["port"]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg_path = work / "server.json"
        cfg_path.write_text(json.dumps(config))
        self.log = open(log, "ab")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, str(HERE / "load_server.py"),
                                      str(cfg_path)], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)

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


def scrape(http: Http) -> dict:
    """``/metrics`` -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = http.get("/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}: {text[:200]}")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(m: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in m.items()
               if n == name and all(dict(lab).get(k) == str(x) for k, x in labels.items()))


def metrics_delta(before: dict, after: dict) -> dict:
    def moved(name: str) -> float:
        return metric(after, name) - metric(before, name)

    d = {name: moved(f"inferscale_{name}_total")
         for name in ("reloads", "reload_failures", "worker_load_failures")}
    d["fallbacks"] = {lab[0][1]: v - before.get((n, lab), 0.0) for (n, lab), v in after.items()
                      if n == "inferscale_fallbacks_total" and v - before.get((n, lab), 0.0)}
    d["resident_users"] = {t: metric(after, "inferscale_resident_users", tier=t)
                           for t in ("gpu", "host")}
    d["preemptions"] = moved("vllm:num_preemptions_total")
    return d


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
    from transformers import AutoTokenizer

    from inferscale.artifacts.layout import StoreConfig
    from inferscale.serve.app import AccessPolicy, serve_app
    from inferscale.serve.engine import EngineConfig, MemoryEngine
    from inferscale.serve.retrieval import Embedder
    from inferscale.serve.server import MemoryServer

    cuda = torch.cuda.is_available()
    engine = await MemoryEngine(EngineConfig.of(**cfg["engine"])).start()
    embedder = Embedder(cfg["embedder"], device="cuda" if cuda else "cpu",
                        dtype=torch.float16 if cuda else None)
    server = MemoryServer(engine, AutoTokenizer.from_pretrained(cfg["tokenizer"]), embedder,
                          StoreConfig(cfg["engine"]["artifact_root"]), mode="kv",
                          top_k=cfg["top_k"])
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
