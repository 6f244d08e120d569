"""A real Prefect server for the orchestration tests, and helpers around it.

``prefect_server`` (session): ``prefect server start`` on 127.0.0.1 and a free port,
SQLite and every Prefect path (home, result storage, memo store) in a temporary
directory, analytics and the scheduler off (the nightly deployment's cron must not fire
during a test). This process and every subprocess it starts (CLI, workers, flow runs)
talk to it through the ``PREFECT_*`` variables set here.

``flow_env`` (session): the server, plus an InferScale home for flows — a temporary
directory whose ``models/`` and ``fingerprints/`` link to the machine's (the embedded
model is converted once per machine), so Mem0 scratch and artifacts never land in the
user's cache — and ``PYTHONPATH`` on the repository for subprocesses.

Imported by ``tests/conftest.py`` (fixtures); nothing here imports Prefect at import time.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PrefectServer:
    url: str  # UI root
    api_url: str
    home: Path
    env: dict[str, str]  # the variables set for this session
    log: Path
    process: subprocess.Popen = field(repr=False)

    def cli(self, *args: str, timeout: float = 300, cwd: Path = REPO) -> str:
        """Run ``prefect <args>`` against this server; its output (raises on failure)."""
        out = subprocess.run([*PREFECT, *args], cwd=cwd, env=os.environ.copy(),
                             capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise AssertionError(f"prefect {' '.join(args)} failed ({out.returncode}):\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out.stdout


def _wait_healthy(api_url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited ({proc.returncode}):\n"
                               f"{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{api_url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"prefect server not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


def kill_tree(proc: subprocess.Popen | int, sig_kill: bool = False, timeout: float = 20) -> None:
    """Stop a process we started and its descendants (by pid, children first listed)."""
    import psutil

    pid = proc if isinstance(proc, int) else proc.pid
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = [root, *root.children(recursive=True)]
    for p in procs:
        try:
            p.kill() if sig_kill else p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {
        "PREFECT_HOME": str(home),
        # 3.7.7 derives these from ~/.prefect, not from PREFECT_HOME: set them too
        "PREFECT_LOCAL_STORAGE_PATH": str(home / "storage"),
        "PREFECT_MEMO_STORE_PATH": str(home / "memo_store.toml"),
        "PREFECT_API_URL": api_url,
        "PREFECT_UI_API_URL": api_url,
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "5",
        "PREFECT_CLI_PROMPT": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    log = home / "server.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen([*PREFECT, "server", "start", "--host", "127.0.0.1",
                                 "--port", str(port)], env=os.environ.copy(), cwd=home,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(api_url, proc, log, timeout=180)
        if "prefect.context" in sys.modules:  # imported earlier: re-read the environment
            import prefect.context

            prefect.context.refresh_global_settings_context()
        yield PrefectServer(api_url.removesuffix("/api"), api_url, home, env, log, proc)
    finally:
        try:
            if "prefect.logging.handlers" in sys.modules:  # send buffered run logs first
                from prefect.logging.handlers import APILogHandler

                APILogHandler().flush()
        finally:
            kill_tree(proc)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if "prefect.context" in sys.modules:
            import prefect.context

            prefect.context.refresh_global_settings_context()


@pytest.fixture(scope="session")
def flow_env(prefect_server, tmp_path_factory):
    """The server, an InferScale home for flows, PYTHONPATH for subprocesses."""
    from inferscale.settings import Settings

    real = Settings().home
    home = tmp_path_factory.mktemp("inferscale-home")
    for name in ("models", "fingerprints"):
        (real / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(real / name, target_is_directory=True)
    env = {"INFERSCALE_HOME": str(home), "INFERSCALE_FACT_MODE": "raw",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                         if p)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield prefect_server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ------------------------------------------------------------------ reading the API back


def artifacts_with_key(key: str) -> list:
    """Every artifact version of ``key``, oldest first."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
            sort=ArtifactSort.CREATED_DESC)[::-1]


def artifacts_of_run(flow_run_id) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))


def task_runs_of(flow_run_id) -> list:
    """Task runs of a flow run (nested ones too), with their final states."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + 30
    with get_client(sync_client=True) as client:
        while True:  # task run states arrive as events: wait until none is still running
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[flow_run_id])), limit=200)
            if all(r.state and r.state.is_final() for r in runs) or time.monotonic() > deadline:
                return runs
            time.sleep(0.5)


def table_rows(artifact) -> list[dict]:
    import json

    data = artifact.data
    return json.loads(data) if isinstance(data, str) else data


def result_records() -> dict[str, dict]:
    """Every result record in this session's result storage by storage key (a cached
    task's cache key), as parsed JSON (``metadata.serializer.type`` names how
    ``result`` is encoded); a flow's persisted report is stored as its JSON alone (its
    metadata is in the run's state)."""
    import json

    root = Path(os.environ["PREFECT_LOCAL_STORAGE_PATH"])
    return {p.name: json.loads(p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}
