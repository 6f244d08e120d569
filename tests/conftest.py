"""Shared fixtures: the real embedded model, artifact stores on local disk and on a real
S3-protocol server, one real engine per session (tiny models and random KV for the
encoder's tests: ``tests/tiny_models.py``).

The S3 server is moto in server mode (``ThreadedMotoServer``) on 127.0.0.1 and a free
port, started once per session; each test gets its own bucket.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from pathlib import Path

from inferscale.settings import offline_environment

offline_environment()

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers: tests/builders.py ...
sys.path.insert(1, str(REPO))  # flows/, tasks/, benchmarks/ (tests/benchmarks tests them)

from moto_s3 import S3_KEY, S3_REGION, S3_SECRET, s3_options  # noqa: E402

from hypothesis import HealthCheck, settings  # noqa: E402

# Property tests check behaviour, never speed: on CI's 2 cores, beside an engine or a Ray
# cluster of the same session, drawing one example can take over a second, which
# Hypothesis's timing checks (a deadline per example, too_slow) would report as a failure.
settings.register_profile("inferscale", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("inferscale")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_endpoint():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    for k, v in {"AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET,
                 "AWS_DEFAULT_REGION": S3_REGION}.items():
        os.environ.setdefault(k, v)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_store(moto_endpoint):
    import boto3

    from inferscale.artifacts.layout import StoreConfig

    bucket = f"t-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name=S3_REGION,
                 aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET).create_bucket(Bucket=bucket)
    return StoreConfig(f"s3://{bucket}/artifacts", s3_options(moto_endpoint))


@pytest.fixture
def local_store(tmp_path):
    from inferscale.artifacts.layout import StoreConfig

    return StoreConfig(str(tmp_path / "artifacts"))


@pytest.fixture(params=["local", "s3"])
def store(request):
    return request.getfixturevalue(f"{request.param}_store")


@pytest.fixture
def child_env():
    """Environment for subprocesses that import inferscale and tests/builders.py."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="session")
def inferscale_home():
    """Where the embedded checkpoint is converted once per machine (shared across runs)."""
    from inferscale.settings import Settings

    return Settings().home


@pytest.fixture
def own_home(tmp_path, monkeypatch, inferscale_home):
    """An InferScale home of this test's own (INFERSCALE_HOME: Mem0 scratch, the default
    artifact root, empty), sharing the converted model; INFERSCALE_ARTIFACT_ROOT unset."""
    home = tmp_path / "home"
    home.mkdir()
    for name in ("models", "fingerprints"):
        (inferscale_home / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(inferscale_home / name, target_is_directory=True)
    monkeypatch.setenv("INFERSCALE_HOME", str(home))
    monkeypatch.delenv("INFERSCALE_ARTIFACT_ROOT", raising=False)
    return home


@pytest.fixture(scope="session")
def smollm2(inferscale_home):
    """The real embedded SmolLM2-135M-Instruct, fp32 on CPU (converted once, ~40 s)."""
    from inferscale.models import load_model

    return load_model("embedded", inferscale_home, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def embedder():
    """The packaged MiniLM on CPU."""
    from inferscale.serve.retrieval import Embedder

    return Embedder("embedded", device="cpu")


@pytest.fixture(scope="session")
def engine_env(smollm2, tmp_path_factory):
    """One real vLLM engine (SmolLM2, float32, eager) with the connector, for the session.

    Yields a namespace: ``loop`` (runs coroutines), ``engine`` (MemoryEngine), ``store``
    (its artifact StoreConfig), ``model`` (the HF SmolLM2 for encoding) and ``log`` (the
    engine processes' stdout/stderr, which they inherit at start-up).
    """
    from types import SimpleNamespace

    from engine_helpers import LoopThread, start_engine
    from fault_injection import FAULT_EXTENSION

    from inferscale.artifacts.layout import StoreConfig
    from inferscale.serve.engine import EngineConfig, MemoryEngine

    root = tmp_path_factory.mktemp("engine") / "artifacts"
    loop = LoopThread()
    engine = MemoryEngine(EngineConfig.of(
        model=str(smollm2.checkpoint), model_fingerprint=smollm2.fingerprint,
        dtype="float32", kv_cache_memory_bytes=4 << 30, max_model_len=2048,
        artifact_root=str(root), worker_extension=FAULT_EXTENSION))
    log = root.parent / "engine.log"
    start_engine(loop, engine, log)
    yield SimpleNamespace(loop=loop, engine=engine, store=StoreConfig(str(root)), model=smollm2,
                          log=log)
    engine.shutdown()
    loop.close()


# The real Prefect server and the flows' environment (tests/flows, tests/tasks).
from prefect_env import flow_env, prefect_server  # noqa: E402,F401
