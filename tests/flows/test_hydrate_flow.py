"""The hydrate flow against a running server: the real vLLM engine (CPU) behind
``inferscale.serve``'s app, users published by the encode flow, loaded through the
admin API to the host and GPU tiers; an unknown user fails alone, without retries."""

from __future__ import annotations

import pytest

from prefect_env import task_runs_of

pytestmark = [pytest.mark.slow, pytest.mark.engine]


@pytest.fixture
def served(engine_env, embedder):
    """``inferscale.serve``'s app over the session's engine, on 127.0.0.1 (admin open on
    loopback, as the server allows)."""
    from engine_helpers import served_app

    from inferscale.serve.access import AccessPolicy
    from inferscale.serve.server import build_server

    server = build_server(engine_env.engine, engine_env.model.tokenizer, embedder,
                          engine_env.store)
    with served_app(engine_env.loop, server, AccessPolicy({}, None, None, loopback=True)) as url:
        yield url


def test_hydrate_users_into_running_server(flow_env, engine_env, served):
    from flows.encode import encode_users
    from flows.hydrate import hydrate_serving
    from inferscale.artifacts.read import latest_version
    from inferscale.serve.admin_client import AdminClient

    published = encode_users(artifact_root=engine_env.store.root, fact_mode="raw")
    assert published["model_fingerprint"] == engine_env.engine.config.model_fingerprint
    latest = {u: latest_version(engine_env.store, u, published["model_fingerprint"])
              for u in ("maya", "tomas")}

    state = hydrate_serving(users=["maya", "tomas"], server_url=served, tier="host",
                            return_state=True)
    assert state.is_completed(), state.message
    rows = state.result()["users"]
    for user in ("maya", "tomas"):
        assert rows[user]["status"] == "hydrated" and rows[user]["version"] == latest[user]
        assert int(rows[user]["bytes"]) > 0
    admin = AdminClient(served)
    status = admin.status()
    assert {"maya", "tomas"} <= set(status["users"])
    tiers = {r["user"]: r["tier"] for r in status["engine"]["residents"]}
    assert tiers["maya"] == tiers["tomas"] == "host"

    # an unknown user fails alone (404, not retried); maya moves to the GPU tier
    state = hydrate_serving(users=["maya", "nobody"], server_url=served, tier="gpu",
                            return_state=True)
    assert state.is_failed() and "nobody" in state.message
    rows = state.result(raise_on_failure=False).report["users"]  # flows.results.UsersFailed
    assert rows["maya"]["status"] == "hydrated" and rows["nobody"]["status"] == "failed"
    assert "404" in rows["nobody"]["error"]
    (run,) = [r for r in task_runs_of(state.state_details.flow_run_id)
              if r.name == "hydrate-nobody"]
    assert run.run_count == 1  # a permanent error is not retried
    tiers = {r["user"]: r["tier"] for r in admin.status()["engine"]["residents"]}
    assert tiers["maya"] == "gpu"
    for user in ("maya", "tomas"):
        admin.evict(user)

    # facts only: tomas's facts are held for retrieval, its KV in no tier
    state = hydrate_serving(users=["tomas"], server_url=served, tier="facts",
                            return_state=True)
    assert state.is_completed(), state.message
    row = state.result()["users"]["tomas"]
    assert (row["tier"], row["version"], row["bytes"]) == ("facts", latest["tomas"], 0)
    assert int(row["facts"]) > 0
    status = admin.status()
    assert status["versions"] == {"tomas": latest["tomas"]}
    assert status["engine"]["residents"] == []
    assert admin.hydrate("tomas", tier="facts")["index_primed"] is True  # on every worker
    admin.evict("tomas")

