"""What a Ray cluster named by a run receives: only allowed clusters, no secrets."""

from __future__ import annotations

import pytest

SECRETS = {
    "INFERSCALE_ADMIN_KEY": "adm1n-secret",
    "INFERSCALE_API_KEYS": '{"key-ann-secret": "ann"}',
    "INFERSCALE_S3_SECRET_ACCESS_KEY": "s3-secret",
    "INFERSCALE_S3_ACCESS_KEY_ID": "s3-key-id",
    "INFERSCALE_OPENAI_API_KEY": "sk-secret",
    "INFERSCALE_GATEWAY_SECRET": "gw-secret",
}


def test_ray_workers_get_no_secrets(monkeypatch):
    from flows.common import _ray_init_kwargs

    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("INFERSCALE_WINDOW", "7")
    monkeypatch.setenv("INFERSCALE_ARTIFACT_ROOT", "s3://bucket/artifacts")
    env = _ray_init_kwargs(None)["runtime_env"]["env_vars"]
    assert env["INFERSCALE_WINDOW"] == "7"
    assert env["INFERSCALE_ARTIFACT_ROOT"] == "s3://bucket/artifacts"
    leaked = {k for k in env if k in SECRETS} | {k for k, v in env.items()
                                                 if any(s in v for s in SECRETS.values())}
    assert not leaked, leaked


def test_only_listed_ray_clusters_are_used(monkeypatch):
    from flows.common import _runner, check_ray_address

    monkeypatch.delenv("INFERSCALE_RAY_ADDRESSES", raising=False)
    with pytest.raises(ValueError, match="INFERSCALE_RAY_ADDRESSES"):
        _runner("ray", 2, "ray://10.1.2.3:10001")
    check_ray_address(None, [])
    check_ray_address("local", [])
    check_ray_address("ray://head.internal:10001", ["ray://head.internal:10001"])
    with pytest.raises(ValueError):
        check_ray_address("auto", ["ray://head.internal:10001"])
    monkeypatch.setenv("INFERSCALE_RAY_ADDRESSES", '["ray://10.1.2.3:10001"]')
    assert _runner("ray", 2, "ray://10.1.2.3:10001") is not None  # nothing connects yet


def test_ray_workers_get_every_offline_switch(monkeypatch):
    """The offline environment has one list (``inferscale.settings.OFFLINE_ENV``); a Ray
    worker gets all of it, as this process has it."""
    from flows.common import _ray_init_kwargs
    from inferscale.settings import OFFLINE_ENV

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = _ray_init_kwargs(None)["runtime_env"]["env_vars"]
    assert set(OFFLINE_ENV) <= set(env)
    assert env["HF_HUB_OFFLINE"] == "1"
