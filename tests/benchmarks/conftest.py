"""Fixtures of the benchmarks' own tests: small LoCoMo-format conversations, the embedded
model's tokenizer, and the load benchmark's users built from those conversations."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

FP = "fp-load-test"


def write_conversation(path, name: str, turns: int) -> str:
    """A LoCoMo-format conversation of ``turns`` turns in two sessions, with questions of
    every category (5 included, which the benchmarks leave out)."""
    half = turns // 2
    session = lambda s, n: [  # noqa: E731
        {"speaker": "Ann" if i % 2 == 0 else "Bob", "dia_id": f"D{s}:{i + 1}",
         "text": f"{name} session {s} turn {i}: I went hiking near lake {i}."} for i in range(n)]
    conv = {"speaker_a": "Ann", "speaker_b": "Bob",
            "session_1_date_time": "1:56 pm on 8 May, 2023", "session_1": session(1, half),
            "session_2_date_time": "2:00 pm on 9 May, 2023", "session_2": session(2, turns - half)}
    qa = [{"question": f"{name} question {i}?", "answer": "x", "evidence": [], "category": c}
          for i, c in enumerate((1, 2, 3, 4, 5, 2))]
    out = path / f"{name}.json"
    out.write_text(json.dumps({"sample_id": name, "conversation": conv, "qa": qa}))
    return str(out)


@pytest.fixture
def conversations(tmp_path) -> list[str]:
    """Two conversations: ``c0`` (8 turns) and ``c1`` (6 turns)."""
    return [write_conversation(tmp_path, "c0", 8), write_conversation(tmp_path, "c1", 6)]


@pytest.fixture(scope="session")
def tokenizer(inferscale_home):
    from transformers import AutoTokenizer

    from inferscale.models import resolve_checkpoint

    return AutoTokenizer.from_pretrained(resolve_checkpoint("embedded", inferscale_home))


def random_vectors(texts: list[str]) -> np.ndarray:
    return np.random.default_rng(len(texts)).standard_normal((len(texts), 4)).astype(np.float32)


@pytest.fixture
def workload(conversations, tokenizer) -> SimpleNamespace:
    """The load benchmark's users over :func:`conversations` (random 4-dim embeddings):
    the pool, 2 memory groups of 9 facts, 4 users, their questions and shares."""
    from benchmarks.datasets import users as lu

    pool, embeddings = lu.pool_turns(conversations, tokenizer, random_vectors)
    groups = lu.make_groups(len(pool), 2, 9, 4)
    return SimpleNamespace(
        conversations=conversations, pool=pool, embeddings=embeddings, groups=groups,
        questions=lu.locomo_questions(conversations),
        shares={u: lu.shares(g, pool) for g in groups for u in g.users})


@pytest.fixture
def published(tmp_path, conversations, tokenizer, embedder) -> SimpleNamespace:
    """Three users in two groups of 6 facts over :func:`conversations`, embedded with the
    packaged MiniLM and published with random K/V (geometry ``(2, 2, 8)``, fingerprint
    :data:`FP`): the store, their versions, the pool, its embeddings, the groups, ``fp``."""
    from benchmarks.datasets import users as lu
    from benchmarks.lib.memory import vectors
    from inferscale.artifacts.layout import StoreConfig

    pool, embeddings = lu.pool_turns(conversations, tokenizer, vectors(embedder))
    groups = lu.make_groups(len(pool), 2, 6, 3)
    store = StoreConfig(str(tmp_path / "artifacts"))
    versions = lu.publish_users(store, groups, pool, embeddings, tokenizer, lambda g, f: (
        lu.group_memory(g, f, None, tokenizer, pool, FP, shape=(2, 2, 8))),
        progress=lambda m: None)
    return SimpleNamespace(store=store, versions=versions, pool=pool, embeddings=embeddings,
                           groups=groups, fp=FP)
