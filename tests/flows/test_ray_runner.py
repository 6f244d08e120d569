"""The encode flow's per-user tasks on a Ray cluster (a local Ray instance here)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow


def test_encode_on_local_ray(flow_env, tmp_path):
    import ray

    from flows.encode import encode_users
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.read import verify_version

    assert not ray.is_initialized()
    root = tmp_path / "artifacts"
    state = encode_users(artifact_root=str(root), fact_mode="raw", task_runner="ray",
                         return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    store = StoreConfig(str(root))
    assert sorted(report["users"]) == ["maya", "tomas"]
    for user, out in report["users"].items():
        assert out["status"] in ("published", "unchanged")
        host, pid = out["worker"].rsplit(":", 1)
        assert int(pid) != os.getpid()  # ran in a Ray worker process
        assert verify_version(store, user, report["model_fingerprint"]).version == out["version"]
    assert not ray.is_initialized()  # the runner started its own instance and stopped it
