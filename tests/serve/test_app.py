"""``inferscale serve``: who may use whose memory, and the OpenAI API on the real engine."""

from __future__ import annotations

import pytest

from inferscale.serve.app import AccessPolicy, ServeError, is_loopback

KEYS = {"key-ann": "ann", "key-bob": "bob"}


def test_beyond_loopback_without_keys_refuses_to_start():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")
    with pytest.raises(ServeError, match="API_KEYS"):
        AccessPolicy({}, "admin", None, loopback=False)
    with pytest.raises(ServeError, match="ADMIN_KEY"):
        AccessPolicy(KEYS, None, None, loopback=False)
    AccessPolicy(KEYS, "admin", None, loopback=False)  # keys: fine
    AccessPolicy({}, "admin", "x-user", loopback=False)  # a trusted gateway: fine


def test_api_keys_decide_the_user():
    policy = AccessPolicy(KEYS, "admin", None, loopback=False)
    auth = {"authorization": "Bearer key-ann"}
    assert policy.user_for(auth, None) == "ann"
    assert policy.user_for(auth, "ann") == "ann"
    with pytest.raises(PermissionError, match="another user"):
        policy.user_for(auth, "bob")
    with pytest.raises(PermissionError, match="unknown API key"):
        policy.user_for({"authorization": "Bearer nope"}, "ann")
    with pytest.raises(PermissionError, match="unknown API key"):
        policy.user_for({}, "ann")
    policy.check_admin({"authorization": "Bearer admin"})
    with pytest.raises(PermissionError):
        policy.check_admin(auth)


def test_trusted_header_decides_the_user():
    policy = AccessPolicy({}, "admin", "X-User", loopback=False)
    assert policy.user_for({"x-user": "bob"}, "ann") == "bob"
    with pytest.raises(PermissionError, match="X-User"):
        policy.user_for({}, "bob")


def test_loopback_without_keys_trusts_the_body():
    policy = AccessPolicy({}, None, None, loopback=True)
    assert policy.user_for({}, "ann") == "ann"
    policy.check_admin({})  # admin open on loopback only


@pytest.mark.slow
@pytest.mark.engine
def test_openai_client_against_the_server(engine_env, embedder):
    import httpx
    import openai

    from engine_helpers import limiting_memory, served_app
    from inferscale.artifacts.publish import Lineage, publish
    from inferscale.serve.server import MemoryServer

    for user, name in (("ann", "Pelican"), ("bob", "Tornado")):
        mem, table = limiting_memory(engine_env.model.model, engine_env.model.tokenizer, user,
                                     [f"The user's dog is named {name}.",
                                      "The user lives in a small town by the sea."],
                                     engine_env.model.fingerprint, embedder)
        publish(engine_env.store, user, mem, table, Lineage(f"log-{user}", f"f-{user}"),
                embeddings=False)
    server = MemoryServer(engine_env.engine, engine_env.model.tokenizer, embedder,
                          engine_env.store, top_k=5)
    policy = AccessPolicy(KEYS, "admin", None, loopback=True)
    with served_app(engine_env.loop, server, policy) as url:
        admin = httpx.Client(base_url=url, trust_env=False, timeout=300,
                             headers={"Authorization": "Bearer admin"})
        assert httpx.post(f"{url}/admin/hydrate", json={"user": "ann"},
                          trust_env=False).status_code == 401
        for user, tier in (("ann", "gpu"), ("bob", "host")):
            r = admin.post("/admin/hydrate", json={"user": user, "tier": tier})
            assert r.status_code == 200 and r.json()["tier"] == tier, r.text

        ann = openai.OpenAI(base_url=f"{url}/v1", api_key="key-ann")
        msg = [{"role": "user", "content": "What is the name of my dog?"}]
        r = ann.chat.completions.create(model="smollm2", messages=msg, max_tokens=16)
        info = r.model_extra["inferscale"]
        assert "Pelican" in r.choices[0].message.content
        assert info["user"] == "ann" and info["injected_tokens"] > 0 and info["mode"] == "kv"
        assert r.usage.prompt_tokens_details.cached_tokens >= info["injected_tokens"]

        # streaming, bob's key: bob's memory
        bob = openai.OpenAI(base_url=f"{url}/v1", api_key="key-bob")
        text = "".join(c.choices[0].delta.content or "" for c in bob.chat.completions.create(
            model="smollm2", messages=msg, max_tokens=16, stream=True))
        assert "Tornado" in text and "Pelican" not in text

        # the baseline on the same engine: same facts as text, nothing injected
        r = ann.chat.completions.create(model="smollm2", messages=msg, max_tokens=16,
                                        extra_body={"inferscale": {"mode": "prompt"}})
        assert r.model_extra["inferscale"]["injected_tokens"] == 0
        assert "Pelican" in r.choices[0].message.content

        # a key cannot borrow another user's memory; an unknown key gets nothing
        with pytest.raises(openai.AuthenticationError):
            ann.chat.completions.create(model="smollm2", messages=msg, user="bob")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope").chat.completions.create(
                model="smollm2", messages=msg)
        with pytest.raises(openai.BadRequestError):
            ann.chat.completions.create(model="smollm2", messages=[{"role": "user",
                                                                     "content": " "}])
        status = admin.get("/admin/status").json()
        assert {r["user"]: r["tier"] for r in status["engine"]["residents"]}["bob"] == "host"
        assert admin.post("/admin/evict", json={"user": "ann"}).json()["evicted"] is True
