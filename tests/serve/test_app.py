"""``inferscale serve``: who may use whose memory, and the OpenAI API on the real engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from inferscale.serve.access import GATEWAY_SECRET_HEADER, AccessPolicy
from inferscale.serve.app import create_app
from inferscale.serve.backend import AnswerRequest
from tests.serve.recording_server import RecordingServer

KEYS = {"key-ann": "ann", "key-bob": "bob"}
ANN = {"Authorization": "Bearer key-ann"}
ASK = {"model": "m", "messages": [{"role": "user", "content": "What is my dog called?"}]}


# ------------------------------------------------------------------ the HTTP layer alone


def http(policy: AccessPolicy | None = None, limits=None):
    from fastapi.testclient import TestClient

    server = RecordingServer()
    app = create_app(server, policy or AccessPolicy(KEYS, "admin", None, loopback=True), "m",
                     *([limits] if limits else []))
    return TestClient(app, raise_server_exceptions=False), server


def test_credentials_are_checked_before_the_body_is_read():
    client, server = http()
    for body in (b"{not json", b"[]", b'{"messages": 5}', b"\xff\xfe", b"[" * 100_000):
        for headers in ({}, {"Authorization": "Bearer nope"}):
            r = client.post("/v1/chat/completions", content=body, headers=headers)
            assert r.status_code == 401, (body[:20], headers, r.status_code, r.text)
        r = client.post("/admin/hydrate", content=body, headers=ANN)  # not the admin key
        assert r.status_code == 401
    assert server.calls == []


def test_a_missing_key_is_told_apart_from_an_unknown_one():
    client, _ = http()
    r = client.post("/v1/chat/completions", json=ASK)
    assert r.status_code == 401 and r.json()["detail"].startswith("missing API key")
    r = client.post("/v1/chat/completions", json=ASK, headers={"Authorization": "Bearer x"})
    assert r.status_code == 401 and r.json()["detail"] == "unknown API key"


def test_the_model_list_wants_a_key_when_keys_are_set():
    """As vLLM's ``--api-key`` guards every ``/v1`` route; without keys it stays open."""
    client, server = http()
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer x"}).status_code == 401
    r = client.get("/v1/models", headers=ANN)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["m"]
    gateway = AccessPolicy({}, "admin", "X-User", loopback=False, gateway_secret="s3cret")
    client, _ = http(gateway)
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={GATEWAY_SECRET_HEADER: "s3cret"}).status_code == 200
    client, _ = http(AccessPolicy({}, None, None, loopback=True))
    assert client.get("/v1/models").status_code == 200
    assert server.calls == []


def test_the_key_decides_whatever_header_or_body_say():
    client, server = http(AccessPolicy(KEYS, "admin", "X-User", loopback=True))
    assert client.post("/v1/chat/completions", json=ASK,
                       headers={"X-User": "ann"}).status_code == 401
    assert client.post("/v1/chat/completions", json=ASK,
                       headers={**ANN, "X-User": "bob"}).status_code == 401
    assert client.post("/v1/chat/completions", json={**ASK, "user": "bob"},
                       headers=ANN).status_code == 401
    r = client.post("/v1/chat/completions", json=ASK, headers={**ANN, "X-User": "ann"})
    assert r.status_code == 200 and [c.user for _, c in server.calls] == ["ann"]


def test_a_repeated_identity_header_is_a_400_before_the_body_is_read():
    """Duplicate X-User (or Authorization, or gateway secret) headers: the last one used
    to win; now the request is refused, whichever values they carry."""
    client, server = http(AccessPolicy(KEYS, "admin", "X-User", loopback=True))
    for headers in ([("Authorization", "Bearer key-ann"), ("X-User", "ann"), ("X-User", "bob")],
                    [("Authorization", "Bearer key-bob"), ("X-User", "ann"), ("X-User", "bob")],
                    [("Authorization", "Bearer key-ann"), ("Authorization", "Bearer key-bob")],
                    [("Authorization", "Bearer key-ann"), ("X-User", "ann"), ("x-user", "ann")]):
        r = client.post("/v1/chat/completions", content=b"{not json", headers=headers)
        assert r.status_code == 400 and "more than once" in r.json()["detail"], (headers, r.text)
    admin = [("Authorization", "Bearer admin"), ("Authorization", "Bearer admin")]
    assert client.get("/admin/status", headers=admin).status_code == 400
    assert server.calls == []
    gateway = AccessPolicy({}, None, "X-User", loopback=True, gateway_secret="s3cret")
    client, server = http(gateway)
    r = client.post("/v1/chat/completions", json=ASK, headers=[
        ("X-InferScale-Gateway-Secret", "s3cret"), ("X-InferScale-Gateway-Secret", "wrong"),
        ("X-User", "ann")])
    assert r.status_code == 400 and server.calls == []


BAD_FIELDS = [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "user message"),
    ({"messages": [{"role": "user", "content": "   "}]}, "user message"),
    ({"top_k": "5"}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": 101}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"inferscale": {"top_k": "five"}}, "top_k"),
    ({"inferscale": {"top_k": -1}}, "top_k"),
    ({"inferscale": {"mode": "x"}}, "mode"),
    ({"inferscale": {"mode": 1}}, "mode"),
    ({"inferscale": {"topk": 3}}, "topk"),
    ({"inferscale": "kv"}, "inferscale"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 4097}, "max_tokens"),
    ({"max_tokens": 10 ** 30}, "max_tokens"),
    ({"max_completion_tokens": 1e9}, "max_completion_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stream_options": {"include_usage": 1}}, "include_usage"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": None, "stream": "yes"}, "stream"),
    ({"user": 5}, "user"),
    ({"user": "bob\n"}, "user"),
    ({"user": "\u202eann"}, "user"),
    ({"model": ["m"]}, "model"),
    ({"messages": [{"role": "user", "content": "why\ud800?"}]}, "content"),
    ({"messages": [{"role": "user", "content": "\udfff"}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud83d"}]}]},
     "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "content"),
    ({"messages": [{"role": "user", "content": ["text"]}]}, "content"),
    ({"messages": [{"role": "user", "content": []}]}, "user message"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": None}]},
     "user message"),
]


@pytest.mark.parametrize("patch,field", BAD_FIELDS)
def test_malformed_fields_are_400_naming_the_field(patch, field):
    client, server = http(AccessPolicy({}, None, None, loopback=True))
    r = client.post("/v1/chat/completions", content=json.dumps({**ASK, **patch}),  # ASCII:
                    headers={"Content-Type": "application/json"})  # lone surrogates escaped
    assert r.status_code == 400, (patch, r.status_code, r.text)
    assert field in r.json()["detail"], r.text
    assert server.calls == []


@pytest.mark.parametrize("body", [
    b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe{}", b"[" * 100_000 + b"]" * 100_000,
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"top_k": NaN, "messages": []}',
])
def test_bodies_that_are_not_a_json_object_are_400(body):
    client, server = http(AccessPolicy({}, None, None, loopback=True))
    r = client.post("/v1/chat/completions", content=body,
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400, (body[:30], r.status_code, r.text)
    assert server.calls == []


@pytest.mark.parametrize("length", ["\u00b2", "\u0661\u0662", "+5", " 5", "-1", "5" * 400, "x"])
def test_any_content_length_header_is_a_4xx_at_worst(length):
    """Servers pass the Content-Length header through as latin-1 text: "\\xb2" arrives
    as "²", which ``str.isdigit`` accepts and ``int`` refuses (it was a 500)."""
    import asyncio

    from inferscale.serve.api_models import RequestError, read_body

    async def body():
        yield b'{"a": 1}'
    try:
        assert asyncio.run(read_body(body(), length, 100)) == {"a": 1}
    except RequestError as exc:
        assert exc.status == 413 and length == "5" * 400


def test_size_limits():
    from inferscale.serve.api_models import RequestLimits

    client, server = http(AccessPolicy({}, None, None, loopback=True),
                          RequestLimits(max_body_bytes=4096, max_question_chars=100))
    long_question = {**ASK, "messages": [{"role": "user", "content": "x" * 101}]}
    r = client.post("/v1/chat/completions", json=long_question)
    assert r.status_code == 400 and "at most 100" in r.json()["detail"]
    padded = {**ASK, "padding": "x" * 5000}
    assert client.post("/v1/chat/completions", json=padded).status_code == 413

    def chunks():  # no Content-Length: counted while reading
        yield b'{"padding": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}'
    assert client.post("/v1/chat/completions", content=chunks()).status_code == 413
    assert server.calls == []


def test_a_valid_request_reaches_the_server_with_its_options():
    client, server = http()
    body = {**ASK, "max_tokens": 9, "temperature": 0.5, "top_k": 3, "stream": False,
            "inferscale": {"mode": "prompt", "top_k": 4}, "n": 1, "top_p": 1.0,
            "ignore_eos": True}
    r = client.post("/v1/chat/completions", json=body, headers=ANN)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "ok"
    assert server.calls == [("answer", AnswerRequest(
        "ann", "What is my dog called?", top_k=4, mode="prompt", max_tokens=9, temperature=0.5,
        ignore_eos=True, shed=False))]


def test_only_users_without_an_api_key_may_be_shed():
    """An API key's user (a closed set) is never shed under load; a user named by the
    body on loopback, or by a gateway's header, may be (its first memory lookup waits
    for its turn, boundedly), on the unary and the streaming path alike."""
    for policy, headers, shed in (
            (AccessPolicy(KEYS, "admin", None, loopback=True), ANN, False),
            (AccessPolicy({}, None, None, loopback=True), {}, True),
            (AccessPolicy({}, None, "X-User", loopback=True), {"X-User": "ann"}, True)):
        client, server = http(policy)
        for stream in (False, True):
            r = client.post("/v1/chat/completions", headers=headers,
                            json={**ASK, "user": "ann", "stream": stream})
            assert r.status_code == 200, r.text
        assert [(kind, c.shed) for kind, c in server.calls] == \
            [("answer", shed), ("prepare", shed)], policy


def test_the_last_user_message_is_answered_in_either_form():
    """The last user message is the question, whether a string or OpenAI content parts
    (text parts joined by newlines); an earlier string message is never taken instead."""
    client, server = http(AccessPolicy({}, None, None, loopback=True))
    for content, question in (
            ([{"type": "text", "text": "What is my dog called?"}], "What is my dog called?"),
            ([{"type": "text", "text": "Two parts:"}, {"type": "text", "text": "the dog?"}],
             "Two parts:\nthe dog?"),
            ("A plain string.", "A plain string.")):
        server.calls.clear()
        body = {"messages": [{"role": "user", "content": "An earlier question."},
                             {"role": "assistant", "content": "An answer."},
                             {"role": "user", "content": content},
                             {"role": "assistant", "content": "A prefill."}]}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert [c.question for _, c in server.calls] == [question]


def test_admin_bodies_are_validated():
    client, server = http()
    admin = {"Authorization": "Bearer admin"}
    for path, body, field in (
            ("/admin/hydrate", {}, "user"),
            ("/admin/hydrate", {"user": "bob\n"}, "user"),
            ("/admin/hydrate", {"user": 3}, "user"),
            ("/admin/hydrate", {"user": "ann", "tier": "disk"}, "tier"),
            ("/admin/hydrate", {"user": "ann", "version": "../../x"}, "version"),
            ("/admin/hydrate", {"user": "ann", "version": "a" * 32 + "\n"}, "version"),
            ("/admin/evict", {}, "user"),
            ("/admin/evict", {"user": None}, "user")):
        r = client.post(path, json=body, headers=admin)
        assert r.status_code == 400 and field in r.json()["detail"], (path, body, r.text)
    assert server.calls == []
    for tier in ("host", "facts"):
        r = client.post("/admin/hydrate", json={"user": "ann", "tier": tier}, headers=admin)
        assert r.status_code == 200
    assert client.post("/admin/evict", json={"user": "ann"}, headers=admin).json() == \
        {"user": "ann", "evicted": True}
    assert server.calls == [("hydrate", dict(user="ann", tier="host", version="latest")),
                            ("hydrate", dict(user="ann", tier="facts", version="latest")),
                            ("evict", dict(user="ann"))]


@pytest.mark.slow
@pytest.mark.engine
def test_openai_client_against_the_server(engine_env, embedder):
    import httpx
    import openai

    from engine_helpers import limiting_memory, served_app
    from inferscale.artifacts.publish import Lineage, publish
    from inferscale.serve.server import ServerConfig, build_server

    for user, name in (("ann", "Pelican"), ("bob", "Tornado")):
        mem, table = limiting_memory(engine_env.model.model, engine_env.model.tokenizer, user,
                                     [f"The user's dog is named {name}.",
                                      "The user lives in a small town by the sea."],
                                     engine_env.model.fingerprint, embedder)
        publish(engine_env.store, user, mem, table, Lineage(f"log-{user}", f"f-{user}"),
                embeddings=False)
    server = build_server(engine_env.engine, engine_env.model.tokenizer, embedder,
                          engine_env.store, ServerConfig(top_k=5))
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
        # of the engine's TTFT, the engine core's own queue and prefill (its clock)
        t = info["timings_ms"]
        assert t["engine_queued"] >= 0 and t["engine_prefill"] > 0
        assert t["engine_queued"] + t["engine_prefill"] <= t["engine_ttft"]

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
        assert set(status["cold_split"]["excess_residuals"]) == {"loaded", "computed"}
        assert admin.post("/admin/evict", json={"user": "ann"}).json()["evicted"] is True


@pytest.mark.slow
@pytest.mark.engine
def test_kv_requests_follow_the_artifacts_layout(engine_env, embedder):
    """The server lays out a KV request by the composer settings its artifact carries
    (injected facts in ``memory_order``, the ``text_tail`` best as text before the
    question); the baseline stays every fact as text, best first."""
    from engine_helpers import limiting_memory
    from inferscale.artifacts.publish import Lineage, publish
    from inferscale.compose import Composer, memory_layout
    from inferscale.serve.server import ServerConfig, build_server
    from inferscale.types import PREFIX_ID

    texts = ["Pip the cat is grey.", "Pip sleeps on the piano.", "The user plays piano.",
             "The user lives in Oslo.", "Pip was born in 2019."]
    mem, table = limiting_memory(engine_env.model.model, engine_env.model.tokenizer,
                                 "layout-user", texts, engine_env.model.fingerprint, embedder)
    mem.encoder_config.update(memory_order="chronological", text_tail=2)
    publish(engine_env.store, "layout-user", mem, table, Lineage("log-l", "f-l"),
            embeddings=False)
    server = build_server(engine_env.engine, engine_env.model.tokenizer, embedder,
                          engine_env.store, ServerConfig(top_k=4))
    engine_env.loop.run(server.hydrate("layout-user"))
    composer = Composer(engine_env.model.tokenizer)
    tokens = dict(zip(table.column("fact_id").to_pylist(), table.column("token_ids").to_pylist()))
    source = dict(zip(table.column("fact_id").to_pylist(),
                      table.column("source_index").to_pylist()))
    q = "Where does Pip sleep?"
    p = engine_env.loop.run(server.prepare(AnswerRequest("layout-user", q, mode="kv")))
    ids, ref, info = p.ids, p.ref, p.info
    injected, tail = memory_layout(info.facts, "chronological", 2, source)
    assert len(injected) == 2 and tail == info.facts[:2][::-1]
    assert [source[f] for f in injected] == sorted(source[f] for f in injected)
    assert ref.chunks == (PREFIX_ID, *injected)
    assert ids == composer.compose([composer.prefix_ids()] + [tokens[f] for f in injected], q,
                                   [tokens[f] for f in tail])[0]
    assert info.text_tail_tokens == sum(len(tokens[f]) for f in tail)
    p = engine_env.loop.run(server.prepare(AnswerRequest("layout-user", q, mode="prompt")))
    pids, pref, pinfo = p.ids, p.ref, p.info
    assert pref is None and pinfo.facts == info.facts
    assert pids == composer.compose([composer.prefix_ids()] + [tokens[f] for f in info.facts],
                                    q)[0]
    out = engine_env.loop.run(server.answer(AnswerRequest("layout-user", q, mode="kv",
                                                          max_tokens=8)))
    assert out.info.injected_tokens > 0 and out.generation.reply.fallback is None


def _request_bytes(body: str) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body.encode())


@pytest.mark.slow
@pytest.mark.engine
def test_a_request_whose_client_goes_away_stops_generating(engine_env, embedder):
    """A request whose client disconnects is aborted in the engine, whatever it was
    doing: a unary one, a streamed one awaiting its next token, and a streamed one whose
    sends were paused (a client on a slow link: 1 KiB receive buffer, 536-byte segments,
    reading nothing) when its client went. With the garbage collector off, so that
    nothing but the server closes the abandoned generator chain: each stops long before
    its ``max_tokens`` (vLLM's own generation-token counter), and each abort is counted
    in ``/metrics`` (``inferscale_requests_aborted_total{mode,reason}``, and the tokens
    it had generated)."""
    import gc
    import socket
    import time

    import httpx

    from engine_helpers import serving
    from inferscale.serve.server import build_server
    from inferscale.vllm_plugin.compat import engine_metrics_registry

    def generated() -> float:
        return sum(s.value for fam in engine_metrics_registry().collect()
                   for s in fam.samples if s.name == "vllm:generation_tokens_total")

    def wait_for(condition, what: str, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    def aborted(http) -> tuple[float, float]:
        from prometheus_client.parser import text_string_to_metric_families

        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(http.get("/metrics").text)
                   for s in fam.samples}
        return (samples[("inferscale_requests_aborted_total",
                         (("mode", "none"), ("reason", "client_disconnected")))],
                samples[("inferscale_aborted_completion_tokens_total", (("mode", "none"),))])

    llm = engine_env.engine.llm
    server = build_server(engine_env.engine, engine_env.model.tokenizer, embedder,
                          engine_env.store)
    max_tokens = 1800  # many minutes on this CPU when not aborted
    policy = AccessPolicy({}, None, None, loopback=True)
    with serving(engine_env.loop, server, policy) as (url, web), \
            httpx.Client(base_url=url, trust_env=False, timeout=60) as http:
        port = int(url.rsplit(":", 1)[1])
        counted = aborted(http)
        for case in ("unary", "stream", "paused stream"):
            body = json.dumps({"model": "smollm2", "max_tokens": max_tokens, "ignore_eos": True,
                               "stream": case != "unary", "messages": [
                                   {"role": "user", "content": "Tell me a long story."}]})
            wait_for(lambda: llm.get_num_unfinished_requests() == 0, "idle engine")
            before = generated()
            sock = socket.socket()
            if case == "paused stream":  # a slow link: tiny window, small segments
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
            sock.connect(("127.0.0.1", port))
            gc.disable()
            try:
                sock.sendall(_request_bytes(body))
                wait_for(lambda: generated() > before + 5, "the request to generate")
                if case == "paused stream":  # the server's sends to it have stopped
                    wait_for(lambda: any(c.flow is not None and c.flow.write_paused
                                         for c in web.server_state.connections),
                             "the server's writes to pause")
                    # and it has taken its next token since: now it waits in a send
                    paused_at = generated()
                    wait_for(lambda: generated() > paused_at + 10, "tokens after the pause")
                sock.close()
                wait_for(lambda: llm.get_num_unfinished_requests() == 0, "the request to end")
            finally:
                gc.enable()
            time.sleep(1.0)  # vLLM records a finished request's last tokens just after it
            assert generated() - before < max_tokens, case
            now = aborted(http)
            assert now[0] == counted[0] + 1, (case, counted, now)
            assert 0 < now[1] - counted[1] <= generated() - before, (case, counted, now)
            counted = now


# ------------------------------------------------------------------ on the real engine


def secret_facts(word: str) -> list[str]:
    return [f"The user's dog is named {word}.", "The user lives in a small town by the sea."]


def publish_secret(env, embedder, user: str, word: str, lineage: str) -> str:
    from engine_helpers import limiting_memory
    from inferscale.artifacts.publish import Lineage, publish

    mem, table = limiting_memory(env.model.model, env.model.tokenizer, user, secret_facts(word),
                                 env.model.fingerprint, embedder)
    return publish(env.store, user, mem, table, Lineage(lineage, f"f-{lineage}"),
                   embeddings=False).version


@pytest.mark.slow
@pytest.mark.engine
def test_users_never_share_prefix_cache_blocks(engine_env, embedder):
    """The same prompt text for two users shares no prefix-cache block, on the paths
    without injected memory too: no memory at all, and prompt mode (facts as text).
    The same user's repeat does hit its own blocks (the cache is on)."""
    from inferscale.serve.server import ServerConfig, build_server

    server = build_server(engine_env.engine, engine_env.model.tokenizer, embedder,
                          engine_env.store, ServerConfig(top_k=5))
    question = ("Here is a long note about my week, please read it carefully. " * 20
                + "What did I say about my week?")
    counters = engine_env.engine.prompt_token_counters

    def ask(user: str, mode: str | None = None) -> tuple[int, int]:
        before = counters()["local_cache_hit"]
        out = engine_env.loop.run(server.answer(AnswerRequest(user, question, mode=mode,
                                                              max_tokens=1)))
        return counters()["local_cache_hit"] - before, out.info.cached_tokens

    for word, user in (("Marigold", "twin-a"), ("Marigold", "twin-b")):
        publish_secret(engine_env, embedder, user, word, f"log-{user}")
    same = {u: engine_env.loop.run(server.prepare(AnswerRequest(u, question, mode="prompt"))).ids
            for u in ("twin-a", "twin-b")}
    assert same["twin-a"] == same["twin-b"] and len(same["twin-a"]) > 2 * 128
    nomem = engine_env.loop.run(server.prepare(AnswerRequest("nomem-x", question)))
    assert len(nomem.ids) > 128  # a block
    for first, second, mode in (("nomem-x", "nomem-y", None), ("twin-a", "twin-b", "prompt")):
        engine_env.loop.run(engine_env.engine.llm.reset_prefix_cache())
        ask(first, mode)
        assert ask(second, mode) == (0, 0), (first, second, mode)  # another user: no hit
        hits, cached = ask(first, mode)
        assert hits >= 128 and cached >= 128, (first, mode)  # its own blocks: a hit


@pytest.mark.slow
@pytest.mark.engine
def test_new_versions_reach_serving_while_requests_run(engine_env, embedder):
    """Two users ask in a loop; new versions are published (and gc removes the old ones)
    meanwhile: no request fails, each user moves to the new version once, within the
    refresh interval, and its KV is then injected (the workers reloaded it)."""
    import threading
    import time

    import httpx

    from engine_helpers import served_app
    from inferscale.artifacts.gc import gc
    from inferscale.serve.memory_cache import MemoryCacheConfig
    from inferscale.serve.server import ServerConfig, build_server

    refresh_s = 2.0
    words = {"fresh-ann": ("Pelican", "Walrus"), "fresh-bob": ("Tornado", "Biscuit")}
    v1 = {u: publish_secret(engine_env, embedder, u, old, f"{u}-1") for u, (old, _) in
          words.items()}
    server = build_server(engine_env.engine, engine_env.model.tokenizer, embedder,
                          engine_env.store,
                          ServerConfig(top_k=5, cache=MemoryCacheConfig(refresh_s=refresh_s)))
    results: list[dict] = []
    stop = threading.Event()

    def ask_in_a_loop(url: str) -> None:
        with httpx.Client(base_url=url, timeout=300, trust_env=False) as client:
            i = 0
            while not stop.is_set():
                user = sorted(words)[i % 2]
                i += 1
                start = time.monotonic()
                r = client.post("/v1/chat/completions", json={
                    "model": "smollm2", "user": user, "max_tokens": 16,
                    "messages": [{"role": "user", "content": "What is the name of my dog?"}]})
                row = {"user": user, "start": start, "status": r.status_code}
                if r.status_code == 200:
                    body = r.json()
                    row.update(version=body["inferscale"]["version"],
                               injected=body["inferscale"]["injected_tokens"],
                               text=body["choices"][0]["message"]["content"])
                results.append(row)

    def answers(user: str, version: str, since: float = 0.0) -> list[dict]:
        return [r for r in results if r["user"] == user and r.get("version") == version
                and r["start"] >= since]

    def wait_for(condition, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, results
            assert all(r["status"] == 200 for r in results), results
            time.sleep(0.2)

    with served_app(engine_env.loop, server,
                    AccessPolicy({}, None, None, loopback=True)) as url:
        loop = threading.Thread(target=ask_in_a_loop, args=(url,), daemon=True)
        loop.start()
        try:
            wait_for(lambda: all(len(answers(u, v1[u])) >= 2 for u in words))
            v2 = {u: publish_secret(engine_env, embedder, u, new, f"{u}-2") for u, (_, new) in
                  words.items()}
            published = time.monotonic()
            for u in words:  # the version the server holds is deleted under it
                assert gc(engine_env.store, u, engine_env.model.fingerprint, keep=1) == [v1[u]]
            wait_for(lambda: all(any(r["injected"] > 0 for r in answers(u, v2[u]))
                                 and len(answers(u, v2[u])) >= 3 for u in words))
        finally:
            stop.set()
            loop.join(300)
    assert results and all(r["status"] == 200 for r in results), results  # zero failures
    for user, (old, new) in words.items():
        mine = [r for r in results if r["user"] == user]
        versions = [r["version"] for r in mine]
        switch = versions.index(v2[user])
        assert set(versions[:switch]) == {v1[user]} and set(versions[switch:]) == {v2[user]}
        # within the interval: at most two requests started after it still used v1
        late = [r for r in mine if r["start"] > published + refresh_s
                and r["version"] == v1[user]]
        assert len(late) <= 2, mine
        texts = [r["text"] for r in mine[switch:]]
        assert not any(old.lower() in t.lower() for t in texts), texts
        assert any(new.lower() in t.lower() for t in texts), texts


def test_a_disconnect_waits_for_the_work_to_take_its_cancel():
    """The client goes while the answer runs: the answer is cancelled and its clean-up
    (vLLM's abort is awaited the same way) has finished before None is returned, even when
    that clean-up takes a while; an answer that ends first is returned as it is."""
    from inferscale.serve.app import _unless_disconnected

    class Receive:  # the ASGI receive of a request whose body was read
        def __init__(self, after: float):
            self.after = after

        async def receive(self):
            await asyncio.sleep(self.after)
            return {"type": "http.disconnect"}

    aborted = []

    async def answer(seconds: float):
        try:
            await asyncio.sleep(seconds)
            return "answer"
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # an abort that awaits the engine
            aborted.append(True)
            raise

    async def main():
        gone = await _unless_disconnected(Receive(0.01), answer(10))
        assert aborted == [True]  # the abort finished before the call returned
        return gone, await _unless_disconnected(Receive(10), answer(0.01))

    assert asyncio.run(main()) == (None, "answer")


@pytest.mark.slow
@pytest.mark.engine
def test_a_cold_start_answers_every_user_with_its_memory_or_a_named_fallback(engine_env,
                                                                            embedder):
    """300 users with published memory ask at once a server that holds none of them (a
    restart, a failover), with the default rate limit of first lookups. With API keys
    every one is answered from its own memory: an API key's user is never shed. Without
    (loopback, the body names the user) each is answered from its own memory or, when
    its lookup was shed (beyond the burst and the bounded wait for a turn), without it,
    saying so (``fallback_reason: shed``), never silently; ``/metrics`` counts those."""
    import asyncio

    import httpx

    from engine_helpers import limiting_memory, served_app
    from inferscale.artifacts.publish import Lineage, publish
    from inferscale.serve.memory_cache import MemoryCacheConfig
    from inferscale.serve.server import ServerConfig, build_server

    env = engine_env
    users = [f"cold-{i:03d}" for i in range(300)]
    fact_ids = {}
    for i, user in enumerate(users):
        mem, table = limiting_memory(env.model.model, env.model.tokenizer, user,
                                     [f"The user's locker number is {1000 + i}."],
                                     env.model.fingerprint, embedder)
        publish(env.store, user, mem, table, Lineage(f"log-{user}", "f"), embeddings=False)
        fact_ids[user] = set(table.column("fact_id").to_pylist())
    keys = {f"key-{u}": u for u in users}
    ask = {"model": "smollm2", "max_tokens": 1,
           "messages": [{"role": "user", "content": "What is my locker number?"}]}

    async def everyone(url: str, keyed: bool) -> list[dict]:
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=900,
                                     limits=httpx.Limits(max_connections=len(users))) as c:
            async def one(user: str) -> dict:
                r = await c.post("/v1/chat/completions", json=ask if keyed else
                                 {**ask, "user": user},
                                 headers={"Authorization": f"Bearer key-{user}"} if keyed
                                 else {})
                assert r.status_code == 200, r.text
                return r.json()["inferscale"]
            return await asyncio.gather(*(one(u) for u in users))

    for keyed in (True, False):
        config = MemoryCacheConfig()
        assert config.miss_burst < len(users)  # the defaults shed some of them
        server = build_server(env.engine, env.model.tokenizer, embedder, env.store,
                              ServerConfig(top_k=1, cache=config))  # fresh: nothing held
        policy = AccessPolicy(keys if keyed else {}, "admin" if keyed else None, None,
                              loopback=True)
        with served_app(env.loop, server, policy) as url:
            infos = asyncio.run(everyone(url, keyed))
            metrics = httpx.get(f"{url}/metrics", trust_env=False).text
        server.memories.close()
        shed = []
        for user, info in zip(users, infos):
            assert info["user"] == user
            if info["mode"] == "kv":  # its own memory (injected, or prefilled from it)
                assert info["facts"] and set(info["facts"]) <= fact_ids[user], info
            else:
                assert info["mode"] == "none" and info["fallback_reason"] == "shed", info
                assert "answered without memory" in info["fallback"]
                shed.append(user)
        if keyed:
            assert shed == []
        else:  # the burst at least, then as many as took a turn within the wait
            assert len(shed) <= len(users) - config.miss_burst
            assert f'inferscale_memory_fallbacks_total{{reason="shed"}} {float(len(shed))}' \
                in metrics
            assert f"inferscale_memory_lookups_limited_total {float(len(shed))}" in metrics


def test_the_startup_heap_is_frozen_out_of_full_collections():
    """``serve_app`` freezes what start-up built before it serves: a full collection no
    longer walks it (stock ``vllm serve`` does the same)."""
    import gc

    from inferscale.serve.app import freeze_startup_heap

    held = [[i] for i in range(50_000)]  # start-up's objects (lists: tracked)
    try:
        assert freeze_startup_heap() >= 50_000
        collected = {id(o) for o in gc.get_objects()}  # the generations a collection walks
        assert not any(id(x) in collected for x in held)
    finally:
        gc.unfreeze()
    assert {id(x) for x in held[:100]} <= {id(o) for o in gc.get_objects()}  # walked again
