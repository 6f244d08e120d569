"""Shared fixtures: artifact stores on local disk and on a real S3-protocol server.

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

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/builders.py

S3_KEY = "testing"
S3_SECRET = "testing"
S3_REGION = "us-east-1"


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


def s3_options(endpoint: str) -> dict:
    return {"key": S3_KEY, "secret": S3_SECRET,
            "client_kwargs": {"endpoint_url": endpoint, "region_name": S3_REGION}}


@pytest.fixture
def s3_store(moto_endpoint):
    import boto3

    from inferscale.store import StoreConfig

    bucket = f"t-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name=S3_REGION,
                 aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET).create_bucket(Bucket=bucket)
    return StoreConfig(f"s3://{bucket}/artifacts", s3_options(moto_endpoint))


@pytest.fixture
def local_store(tmp_path):
    from inferscale.store import StoreConfig

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
