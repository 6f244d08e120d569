"""The seam between the HTTP app and what answers it: both backends implement the
:class:`~inferscale.serve.backend.MemoryBackend` protocol, the app depends on nothing
else, and an answer's info becomes the API's ``inferscale`` extra with the keys and
strings it always had."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from inferscale.serve.backend import AnswerInfo, AnswerRequest, MemoryBackend, Timings
from inferscale.serve.memory_cache import MemoryFallbackReason
from inferscale.vllm_plugin.failures import Fallback, FallbackReason

APP = Path(__file__).resolve().parents[2] / "inferscale" / "serve" / "app.py"


def protocol_members() -> dict[str, object]:
    return {n: v for n, v in vars(MemoryBackend).items()
            if not n.startswith("_") and (callable(v) or isinstance(v, property))}


def backends():
    from inferscale.serve.replica_set import ReplicaConfig, ReplicaSet
    from inferscale.serve.server import MemoryServer

    return {MemoryServer: MemoryServer,
            ReplicaSet: ReplicaSet(None, ReplicaConfig(), "kv", "app", "MemoryReplica")}


@pytest.mark.parametrize("name", sorted(protocol_members()))
def test_both_backends_implement_each_member_of_the_protocol(name):
    """Same parameters, same kind (a coroutine, an async iterator, a plain call)."""
    want = protocol_members()[name]
    for cls, obj in backends().items():
        assert hasattr(obj, name), (cls.__name__, name)
        if isinstance(want, property):
            continue
        have = getattr(cls, name)
        assert list(inspect.signature(have).parameters) == \
            list(inspect.signature(want).parameters), (cls.__name__, name)
        if inspect.iscoroutinefunction(want):
            assert inspect.iscoroutinefunction(have), (cls.__name__, name)
        elif name == "answer_stream":
            assert inspect.isasyncgenfunction(have), (cls.__name__, name)
        else:
            assert not inspect.iscoroutinefunction(have), (cls.__name__, name)


def test_the_app_depends_only_on_the_protocol():
    """app.py imports no backend, no engine, no cache, and reaches into no backend's
    parts (the replica set once had to imitate ``server.engine`` and ``.memories``)."""
    tree = ast.parse(APP.read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    serve = {m.removeprefix("inferscale.serve.") for m in imported
             if m and m.startswith("inferscale.serve.")}
    assert serve == {"access", "api_models", "backend", "streaming"}, serve
    reached = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
               and isinstance(n.value, ast.Name) and n.value.id == "server"}
    assert reached <= set(protocol_members()), reached - set(protocol_members())


def test_an_answer_without_memory_says_so_in_the_old_keys():
    info = AnswerInfo("ann", "none", timings_ms=Timings(retrieve=0.0, compose=1.5, memory=2.0))
    info.fallback = Fallback(MemoryFallbackReason.SHED, "memory lookup shed: ...")
    assert info.to_json() == {
        "user": "ann", "mode": "none", "facts": [], "version": None,
        "timings_ms": {"retrieve": 0.0, "compose": 1.5, "memory": 2.0},
        "fallback": "memory lookup shed: ...", "fallback_reason": "shed"}
    assert AnswerInfo(None, "none").to_json() == {
        "user": None, "mode": "none", "facts": [], "version": None, "timings_ms": {}}


def test_an_injected_answer_has_every_key_it_had():
    info = AnswerInfo("ann", "kv", ["f1", "f2"], "v" * 32, memory_tokens=40,
                      text_tail_tokens=7,
                      timings_ms=Timings(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, lookup=0.5),
                      fallback=Fallback(FallbackReason.STALE_VERSION, "stale version (...)"),
                      replica={"slot": 1, "home": 0}, injected_tokens=0, cached_tokens=3,
                      completion_tokens=8, facts_by_tier={"storage": 1}, storage_bytes=4096,
                      cold={"facts_loaded": 1, "facts_computed": 1, "bytes_read": 4096,
                            "split": None})
    out = info.to_json()
    assert set(out) == {"user", "mode", "facts", "version", "memory_tokens",
                        "text_tail_tokens", "timings_ms", "fallback", "fallback_reason",
                        "replica", "injected_tokens", "cached_tokens", "completion_tokens",
                        "facts_by_tier", "storage_bytes", "cold"}
    assert out["timings_ms"] == {"embed": 1.0, "retrieve": 2.0, "compose": 3.0, "memory": 4.0,
                                 "engine_ttft": 5.0, "query_to_first_token": 6.0,
                                 "lookup": 0.5}
    assert (out["fallback"], out["fallback_reason"]) == ("stale version (...)", "stale_version")
    assert out["injected_tokens"] == 0  # a zero is said, not left out


def test_a_request_is_built_once_from_the_body():
    """The app's body -> AnswerRequest, with the options' fallbacks applied."""
    from inferscale.serve.api_models import RequestLimits, chat_model

    body = chat_model(RequestLimits()).model_validate({
        "messages": [{"role": "user", "content": "Hi?"}], "top_k": 3,
        "max_completion_tokens": 9, "inferscale": {"mode": "prompt"}, "ignore_eos": True})
    assert body.answer_request("ann", shed=False) == AnswerRequest(
        "ann", "Hi?", top_k=3, mode="prompt", max_tokens=9, temperature=0.0,
        ignore_eos=True, shed=False)
