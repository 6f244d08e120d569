"""Property-based tests of the HTTP layer: arbitrary bodies (bytes, any JSON, chat- and
admin-shaped objects with any field values, lone surrogates, NaN, deep nesting) and
arbitrary headers (repeated identity headers, odd bytes, bogus Content-Length) never get
a 5xx: every bad input is a 4xx.

Once against the app alone (every access policy; the server behind it records what
reaches it, as in test_app.py), once against the real server on the real engine."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from inferscale.serve.access import AccessPolicy
from inferscale.types import user_id_problem

KEYS = {"key-ann": "ann", "key-bob": "bob"}
POLICIES = [
    AccessPolicy({}, None, None, loopback=True),
    AccessPolicy(KEYS, "admin", None, loopback=True),
    AccessPolicy(KEYS, "admin", "X-User", loopback=False, gateway_secret="s3cret"),
    AccessPolicy({}, "admin", "X-User", loopback=True, gateway_secret="s3cret"),
]

# any character, lone surrogates included (the default leaves them out), and text made
# mostly of the hostile ones, so that they turn up alone and often
HOSTILE = ["\ud800", "\udbff", "\udc00", "\udfff", "\x00", "\u202e", "\u200b", "\ufeff",
           "\n", "`", "<", "*", "a", " "]
TEXT = st.one_of(st.text(st.characters(exclude_categories=()), max_size=40),
                 st.text(st.sampled_from(HOSTILE), max_size=12))
NAMES = st.sampled_from(["ann", "ann", "bob", "x" * 129, "a/b", " ann", "\u202eann", ".."])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT | NAMES,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4),
    max_leaves=16)


def mostly(*likely, rest=JSON):
    """Draws from ``likely`` about three times in four, else from ``rest``: hostile
    values, but near-valid requests often enough to get past the first check."""
    return st.sampled_from([True, True, True, False]).flatmap(
        lambda yes: st.one_of(*likely) if yes else rest)


PART = mostly(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
              rest=JSON | st.fixed_dictionaries({"type": TEXT | JSON, "text": TEXT | JSON}))
MESSAGE = st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "user", "assistant"])),
                                 "content": mostly(TEXT, st.lists(PART, max_size=3))})
SMALL = mostly(st.integers(1, 5), rest=st.integers() | st.floats() | JSON)
CHAT = st.fixed_dictionaries({"messages": mostly(st.lists(MESSAGE, min_size=1, max_size=4))},
                             optional={
    "model": mostly(TEXT), "max_tokens": SMALL, "max_completion_tokens": SMALL,
    "temperature": mostly(st.floats(0, 2), rest=st.floats() | JSON), "top_k": SMALL,
    "user": mostly(NAMES, TEXT), "stream": mostly(st.booleans()),
    "ignore_eos": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({}, optional={"include_usage": JSON})),
    "inferscale": mostly(st.fixed_dictionaries({}, optional={
        "mode": mostly(st.sampled_from(["kv", "prompt"])), "top_k": SMALL}))})
ADMIN = mostly(st.fixed_dictionaries({"user": mostly(NAMES, TEXT)}, optional={
    "tier": mostly(st.sampled_from(["gpu", "host"])),
    "version": mostly(st.sampled_from(["latest", "0" * 32]), TEXT)}),
    rest=st.fixed_dictionaries({}, optional={"user": JSON, "tier": JSON, "version": JSON}))


def _dumps(value) -> bytes:
    return json.dumps(value).encode()  # ASCII: lone surrogates travel as \ud800 escapes


ANY_BODY = st.one_of(CHAT.map(_dumps), ADMIN.map(_dumps), JSON.map(_dumps),
                     st.binary(max_size=64))
HEADER_VALUES = st.sampled_from([
    b"Bearer key-ann", b"Bearer key-bob", b"Bearer admin", b"bearer admin", b"Bearer ",
    b"ann", b"bob", b"s3cret", b"", b"\xb2", b"1" * 30, b"-1", b"0"]) | st.binary(
        max_size=24).filter(lambda v: not any(c in v for c in b"\r\n\x00"))
HEADERS = st.lists(st.tuples(st.sampled_from([
    "Authorization", "X-User", "X-InferScale-Gateway-Secret", "Content-Type",
    "Content-Length", "X-Other"]), HEADER_VALUES), max_size=4)
# credentials each policy accepts (chat: ann's; admin: the admin key), often sent
GOOD = {"chat": [[], [("Authorization", "Bearer key-ann")],
                 [("Authorization", "Bearer key-ann"), ("X-User", "ann"),
                  ("X-InferScale-Gateway-Secret", "s3cret")],
                 [("X-User", "ann"), ("X-InferScale-Gateway-Secret", "s3cret")]],
        "admin": [[], [("Authorization", "Bearer admin")],
                  [("Authorization", "Bearer admin")], [("Authorization", "Bearer admin")]]}
ENDPOINTS = [("POST", "/v1/chat/completions")] * 3 + [("POST", "/admin/hydrate"),
                                                      ("POST", "/admin/evict")]


# found before (a 500 on the real server: the tokenizer refused the lone surrogate)
SURROGATE = (0, "POST", "/v1/chat/completions",
             b'{"messages": [{"role": "user", "content": "why\\ud800?"}]}', [])
# a valid streaming request (found by this test: the app's streaming path was never
# reached by the recording server, which lacked it)
STREAM = (0, "POST", "/v1/chat/completions",
          b'{"messages": [{"role": "user", "content": ""}, {"role": "user", "content": "0"}],'
          b' "stream": true}', [])


@st.composite
def requests(draw, endpoints=ENDPOINTS, policies=range(len(POLICIES))):
    """(policy index, method, path, body, headers): the policy's credentials (often),
    then arbitrary headers."""
    policy = draw(st.sampled_from(list(policies)))
    method, path = draw(st.sampled_from(endpoints))
    good = GOOD["chat" if path.startswith("/v1") else "admin"][policy]
    extra = draw(st.one_of(st.just([]), st.lists(st.tuples(st.sampled_from(
        ["Content-Type", "X-Other"]), HEADER_VALUES), max_size=2), HEADERS))
    headers = (good if draw(st.integers(0, 3)) else []) + extra
    body = draw(mostly((CHAT if path.startswith("/v1") else ADMIN).map(_dumps), rest=ANY_BODY))
    return policy, method, path, body, headers


@settings(max_examples=400, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=requests())
@example(request=SURROGATE)
@example(request=STREAM)
def test_the_app_never_answers_5xx(request):
    from fastapi.testclient import TestClient

    from inferscale.serve.app import create_app
    from tests.serve.recording_server import RecordingServer

    policy, method, path, body, headers = request
    server = RecordingServer()
    client = TestClient(create_app(server, POLICIES[policy], "m"),
                        raise_server_exceptions=False)
    r = client.request(method, path, content=body, headers=headers)
    event(f"status {r.status_code}")  # --hypothesis-show-statistics: how far requests get
    assert r.status_code < 500, (r.status_code, r.text)
    assert r.status_code in (200, 400, 401, 404, 409, 413), (r.status_code, r.text)
    for kind, call in server.calls:  # what passed validation is what the server can use
        call = call if isinstance(call, dict) else vars(call)  # an AnswerRequest
        if call.get("question") is not None:
            assert call["question"].strip() and call["question"].encode("utf-8")
        assert call.get("user") is None or not user_id_problem(call["user"]), call


@pytest.mark.slow
@pytest.mark.engine
def test_the_real_server_never_answers_5xx(engine_env, embedder):
    """The same on the real server and engine (the question reaches the tokenizer, the
    embedder, the memory cache and vLLM; admin calls reach the workers), over HTTP."""
    import h11
    import httpx

    from engine_helpers import served_app
    from inferscale.serve.api_models import RequestLimits
    from inferscale.serve.server import ServerConfig, build_server

    server = build_server(engine_env.engine, engine_env.model.tokenizer, embedder,
                          engine_env.store, ServerConfig(max_tokens=2))
    policy = AccessPolicy({}, None, None, loopback=True)
    endpoints = ENDPOINTS + [("GET", "/admin/status")]
    with served_app(engine_env.loop, server, policy,
                    limits=RequestLimits(max_output_tokens=2)) as url, \
            httpx.Client(base_url=url, timeout=300, trust_env=False) as client:

        @settings(max_examples=150, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(request=requests(endpoints, policies=[0]))
        @example(request=SURROGATE)
        def check(request):
            _, method, path, body, headers = request
            try:
                r = client.request(method, path, content=body, headers=headers)
            except (h11.LocalProtocolError, httpx.LocalProtocolError):
                return  # headers the client itself will not send
            assert r.status_code < 500, (r.status_code, r.text)

        check()
