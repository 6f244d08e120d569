"""The load and replicas benchmarks' users: memory groups of pooled LoCoMo turns (the
pipeline's raw facts), linked artifacts that hydrate and verify like any other, their
questions and popularity."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from benchmarks.datasets import users as lu
from inferscale.artifacts.blobs import Location
from inferscale.artifacts.layout import KV_FILE, StoreConfig
from inferscale.facts.table import raw_facts
from inferscale.hydrate.slab import hydrate

FP = "fp-users-test"


def test_groups_windows_and_users():
    groups = lu.make_groups(pool_size=10, groups=3, facts=4, users=7)
    assert [g.turns for g in groups] == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert [g.users for g in groups] == [["load-0000", "load-0003", "load-0006"],
                                         ["load-0001", "load-0004"], ["load-0002", "load-0005"]]
    assert lu.make_groups(10, 2, 8, 2)[1].turns == [5, 6, 7, 8, 9, 0, 1, 2]  # wraps around
    with pytest.raises(ValueError, match="facts per user"):
        lu.make_groups(10, 2, 11, 4)
    with pytest.raises(ValueError, match="groups <= users"):
        lu.make_groups(10, 5, 4, 4)


def test_the_pool_is_every_conversations_raw_facts(conversations, tokenizer):
    from inferscale.ingest.logs import read_logs

    def embed(texts):
        return [[float(len(t)), 1.0] for t in texts]

    pool, embeddings = lu.pool_turns(conversations, tokenizer, embed)
    assert len(pool) == 14 and pool[8].conversation == 1 and embeddings.shape == (14, 2)
    (turns,) = read_logs(conversations[1]).turns.values()
    c1 = raw_facts(turns, tokenizer, embed)
    assert [t.text for t in pool[8:]] == c1["text"].to_pylist()
    assert [t.token_ids for t in pool[8:]] == c1["token_ids"].to_pylist()
    assert embeddings[8:].tolist() == c1["embedding"].to_pylist()


def _kv_path(store, resident) -> str:
    name = resident.manifest.files[KV_FILE].stored_name(KV_FILE)
    return Location(store, resident.user, FP).file(resident.version, name)


def test_linked_users_hydrate_verified_and_share_one_file(tmp_path, workload, tokenizer):
    pool = workload.pool
    store = StoreConfig(str(tmp_path / "artifacts"))
    groups = lu.make_groups(len(pool), 2, 9, 5)

    def memory_of(group, fids):
        return lu.group_memory(group, fids, None, tokenizer, pool, FP, shape=(2, 2, 8))

    versions = lu.publish_users(store, groups, pool, workload.embeddings, tokenizer, memory_of,
                                progress=lambda m: None)
    assert sorted(versions) == [f"load-{i:04d}" for i in range(5)]
    for group in groups:
        first, *others = group.users
        a = hydrate(store, first, FP, device="cpu")  # checksums, sizes, fingerprint verified
        assert a.nbytes == versions[first]["slab_bytes"]
        inode = os.stat(_kv_path(store, a)).st_ino
        for user in others:
            b = hydrate(store, user, FP, device="cpu")
            assert b.user == user and b.version == versions[user]["version"] != a.version
            assert torch.equal(a.slab, b.slab) and a.index == b.index
            assert os.stat(_kv_path(store, b)).st_ino == inode
        # the group's facts, in its pooled order; every user's table names that user
        assert len(a.index) == 1 + len(group.turns)
    # two groups hold different memories
    a, b = (hydrate(store, g.users[0], FP, device="cpu") for g in groups)
    assert not torch.equal(a.slab[: min(len(a.slab), len(b.slab))],
                           b.slab[: min(len(a.slab), len(b.slab))])


def test_fp8_users_are_published_with_their_scales_at_half_the_bytes(tmp_path, workload,
                                                                    tokenizer):
    """``--memory-dtype float8_e4m3fn``: the same random K/V drawn in bfloat16, each chunk
    quantized with its scales; the slab is fp8, read back within e4m3's error."""
    pool = workload.pool
    groups = lu.make_groups(len(pool), 2, 9, 2)
    slabs = {}
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        store = StoreConfig(str(tmp_path / str(dtype)))

        def memory_of(group, fids, dtype=dtype):
            return lu.group_memory(group, fids, None, tokenizer, pool, FP, shape=(2, 2, 8),
                                   dtype=dtype)

        memory = memory_of(groups[0], [f"f{i}" for i in groups[0].turns])
        assert all((c.scales is not None) == (dtype == torch.float8_e4m3fn)
                   for c in memory.chunks)
        versions = lu.publish_users(store, groups, pool, workload.embeddings, tokenizer,
                                    memory_of, progress=lambda m: None)
        slabs[dtype] = (hydrate(store, "load-0000", FP, device="cpu"),
                        versions["load-0000"]["slab_bytes"])
    (bf16, bf16_bytes), (fp8, fp8_bytes) = slabs[torch.bfloat16], slabs[torch.float8_e4m3fn]
    assert fp8.slab.dtype == torch.float8_e4m3fn and fp8_bytes < 0.6 * bf16_bytes
    assert fp8.index == bf16.index
    for offset, length in bf16.index.values():
        rows = torch.arange(offset, offset + length)
        assert torch.allclose(fp8.rows_float(rows), bf16.rows_float(rows), rtol=0.07, atol=0.02)


def test_questions_follow_the_users_conversations(workload):
    pool, questions = workload.pool, workload.questions
    assert questions[0] == [f"c0 question {i}?" for i in (0, 1, 2, 3, 5)]  # category 5 left out
    only_c1 = lu.Group(0, [8, 9, 10])
    assert lu.shares(only_c1, pool) == {1: 1.0}
    deck = lu.QuestionDeck(questions, lu.shares(only_c1, pool), seed=3)
    asked = [deck.next() for _ in range(10)]
    assert set(asked[:5]) == set(questions[1]) and asked[5:] == asked[:5]  # cycles
    again = lu.QuestionDeck(questions, lu.shares(only_c1, pool), seed=3)
    assert [again.next() for _ in range(10)] == asked  # same seed, same questions
    with pytest.raises(ValueError, match="no questions"):
        lu.QuestionDeck({0: []}, {0: 1.0}, seed=0)


def test_popularity_is_zipf():
    w = lu.popularity(4, 1.0)
    assert w.sum() == pytest.approx(1.0)
    assert w[0] / w[3] == pytest.approx(4.0)
    assert np.allclose(lu.popularity(3, 0.0), 1 / 3)
