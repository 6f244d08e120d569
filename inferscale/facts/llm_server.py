"""A local vLLM OpenAI-compatible server for fact extraction, as a context manager.

``with LocalLLMServer(LLMServerConfig(checkpoint)) as server:`` starts
``python -m vllm.entrypoints.openai.api_server`` on loopback (a free port), waits until
``/v1/models`` answers, and yields; ``server.base_url`` and ``server.model`` are what an
OpenAI client needs. On exit it stops the whole process group (SIGTERM, then SIGKILL
after ``stop_timeout_s``): the engine-core child goes too, and a server whose parent dies
gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``), so no orphan outlives the caller.
A server that exits or does not answer within ``startup_timeout_s`` raises
:class:`LLMServerError` carrying the tail of its log. The log lives in ``log_dir`` (or a
temporary directory, removed after a run that ended without error).

``PR_SET_PDEATHSIG`` fires when the *thread* that started the server ends: enter the
context manager in the thread that uses it (a Prefect task's own thread is fine).

The extractor starts it when no ``llm_base_url`` is configured (the embedded default).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1


class LLMServerError(RuntimeError):
    """The local LLM server failed to start or died; the message ends with its log tail."""


@dataclass(frozen=True)
class LLMServerConfig:
    """How to run the server. ``dtype="float32"``, ``enforce_eager`` and
    ``gpu_memory_utilization`` (host RAM share on CPU) suit the CPU build of vLLM."""

    checkpoint: Path
    served_name: str = "inferscale-extractor"
    host: str = "127.0.0.1"
    port: int | None = None  # None = a free port
    dtype: str = "float32"
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int | None = 1 << 30  # a side job: a small fixed KV cache
    enforce_eager: bool = True
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 30.0
    extra_args: tuple[str, ...] = ()
    log_dir: Path | None = None  # None = a temporary directory
    env: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        if not (Path(self.checkpoint) / "config.json").exists():
            raise ValueError(f"{self.checkpoint} is not a checkpoint directory (no config.json)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be > 0")
        if self.max_model_len < 256 or self.startup_timeout_s <= 0:
            raise ValueError("max_model_len >= 256 and startup_timeout_s > 0")


class LocalLLMServer:
    """Context manager owning one vLLM OpenAI server subprocess (module docstring)."""

    def __init__(self, config: LLMServerConfig):
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.log_path: Path | None = None
        self._log_file = None
        self._own_log_dir = False  # a temporary log directory, removed after a clean run
        self._failed = False

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}/v1"

    @property
    def model(self) -> str:
        return self.config.served_name

    def command(self) -> list[str]:
        c = self.config
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(c.checkpoint), "--served-model-name", c.served_name,
               "--dtype", c.dtype, "--max-model-len", str(c.max_model_len),
               "--gpu-memory-utilization", str(c.gpu_memory_utilization),
               "--host", c.host, "--port", str(self.port), "--disable-log-stats"]
        if c.kv_cache_memory_bytes:
            cmd += ["--kv-cache-memory-bytes", str(c.kv_cache_memory_bytes)]
        if c.enforce_eager:
            cmd.append("--enforce-eager")
        return cmd + list(c.extra_args)

    def start(self) -> "LocalLLMServer":
        c = self.config
        self.port = c.port or _free_port(c.host)
        self._own_log_dir = c.log_dir is None
        log_dir = Path(c.log_dir or tempfile.mkdtemp(prefix="inferscale-llm-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"vllm-{self.port}.log"
        self._log_file = open(self.log_path, "wb")
        env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
               "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), **dict(c.env)}
        self.proc = subprocess.Popen(
            self.command(), stdout=self._log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        try:
            self._wait_ready()
        except BaseException:
            self._failed = True  # keep the log the error points to
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        url = f"{self.base_url}/models"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LLMServerError(f"vLLM server exited with code {self.proc.returncode} "
                                     f"during start-up; log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise LLMServerError(f"vLLM server did not answer within "
                             f"{self.config.startup_timeout_s:.0f} s; log {self.log_path}:\n"
                             f"{self.log_tail()}")

    def stop(self) -> None:
        """Stop the server's process group; safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.config.stop_timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        if proc is not None:
            _signal_group(proc.pid, signal.SIGKILL)  # stragglers left in the group
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
            if self._own_log_dir and not self._failed and self.log_path is not None:
                shutil.rmtree(self.log_path.parent, ignore_errors=True)

    def log_tail(self, max_bytes: int = 6000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        data = self.log_path.read_bytes()[-max_bytes:]
        return data.decode("utf-8", "replace")

    def __enter__(self) -> "LocalLLMServer":
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        self._failed = self._failed or exc_type is not None
        self.stop()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the server leads its own session: its group id is its pid
    except (ProcessLookupError, PermissionError):
        pass


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies (Linux only)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
