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


@pytest.mark.slow
@pytest.mark.engine
def test_kv_requests_follow_the_artifacts_layout(engine_env, embedder):
    """The server lays out a KV request by the composer settings its artifact carries
    (injected facts in ``memory_order``, the ``text_tail`` best as text before the
    question); the baseline stays every fact as text, best first."""
    from engine_helpers import limiting_memory
    from inferscale.artifacts.publish import Lineage, publish
    from inferscale.encode.compose import Composer, memory_layout
    from inferscale.serve.server import MemoryServer
    from inferscale.types import PREFIX_ID

    texts = ["Pip the cat is grey.", "Pip sleeps on the piano.", "The user plays piano.",
             "The user lives in Oslo.", "Pip was born in 2019."]
    mem, table = limiting_memory(engine_env.model.model, engine_env.model.tokenizer,
                                 "layout-user", texts, engine_env.model.fingerprint, embedder)
    mem.encoder_config.update(memory_order="chronological", text_tail=2)
    publish(engine_env.store, "layout-user", mem, table, Lineage("log-l", "f-l"),
            embeddings=False)
    server = MemoryServer(engine_env.engine, engine_env.model.tokenizer, embedder,
                          engine_env.store, top_k=4)
    engine_env.loop.run(server.hydrate("layout-user"))
    composer = Composer(engine_env.model.tokenizer)
    tokens = dict(zip(table.column("fact_id").to_pylist(), table.column("token_ids").to_pylist()))
    source = dict(zip(table.column("fact_id").to_pylist(),
                      table.column("source_index").to_pylist()))
    q = "Where does Pip sleep?"
    ids, ref, info = server.prepare("layout-user", q, mode="kv")
    injected, tail = memory_layout(info["facts"], "chronological", 2, source)
    assert len(injected) == 2 and tail == info["facts"][:2][::-1]
    assert [source[f] for f in injected] == sorted(source[f] for f in injected)
    assert ref.chunks == (PREFIX_ID, *injected)
    assert ids == composer.compose([composer.prefix_ids()] + [tokens[f] for f in injected], q,
                                   [tokens[f] for f in tail])[0]
    assert info["text_tail_tokens"] == sum(len(tokens[f]) for f in tail)
    pids, pref, pinfo = server.prepare("layout-user", q, mode="prompt")
    assert pref is None and pinfo["facts"] == info["facts"]
    assert pids == composer.compose([composer.prefix_ids()] + [tokens[f] for f in info["facts"]],
                                    q)[0]
    out = engine_env.loop.run(server.answer("layout-user", q, mode="kv", max_tokens=8))
    assert out["info"]["injected_tokens"] > 0 and out["generation"].fallback is None
