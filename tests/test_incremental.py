"""Incremental re-encoding on the real small model (SmolLM2, CPU fp32): a new version
reuses the K/V of every fact whose content key is in the previous one and is
byte-identical to encoding everything from scratch — with a deleted fact, an updated
fact, facts whose window gained a turn or changed, and appended turns."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

from inferscale.artifacts.blobs import Location
from inferscale.artifacts.layout import KV_FILE, StoreConfig
from inferscale.artifacts.read import data_path, manifest_at
from inferscale.compose import Composer
from inferscale.encode.identity import EncoderConfig
from inferscale.facts.extractor import FactsConfig, facts_hash
from inferscale.facts.table import fact_id
from inferscale.hydrate.slab import hydrate
from inferscale.ingest.logs import turns_hash
from inferscale.pipeline import steps
from inferscale.pipeline.config import PipelineConfig
from inferscale.pipeline.steps import previous_kv, publish_user
from storage_schemas import facts as facts_schema
from storage_schemas import turns as turns_schema

pytestmark = pytest.mark.slow

USER = "caro"
EMB = 4

# (turn id, speaker, text, [facts])
V1 = [
    ("D1:0", "Caroline", "I adopted a dog last spring.", ["Caroline adopted a dog last spring."]),
    ("D1:1", "Melanie", "Oh nice, what is his name?", ["Melanie asked about Caroline's dog."]),
    ("D1:2", "Caroline", "Rex. He is a golden retriever and loves the river.",
     ["Caroline's dog is named Rex.", "Rex is a golden retriever."]),
    ("D1:3", "Melanie", "I ran my first marathon in May.", ["Melanie ran a marathon in May."]),
    ("D1:4", "Caroline", "I work night shifts as a nurse in Boston.",
     ["Caroline is a nurse in Boston."]),
    ("D1:5", "Melanie", "My sister just moved to Denver.", ["Melanie's sister moved to Denver."]),
    ("D1:6", "Caroline", "Rex and I go hiking every Sunday.",
     ["Caroline hikes with Rex on Sundays."]),
    ("D1:7", "Melanie", "I am learning to paint watercolors.",
     ["Melanie is learning watercolor painting."]),
]
INSERTED = ("D1:1b", "Melanie", "Actually, I have a cat called Luna too.",
            ["Melanie has a cat named Luna."])
APPENDED = [
    ("D2:0", "Caroline", "We are adopting a second dog next month.",
     ["Caroline is adopting a second dog."]),
    ("D2:1", "Melanie", "Luna will not like that at all!", ["Melanie's cat is Luna."]),
]


def v2_turns():
    """v1 with a turn inserted after D1:1 (the windows of D1:2's facts gain it), D1:5's
    fact updated, D1:6's fact deleted, two turns appended."""
    rows = [V1[0], V1[1], INSERTED, *V1[2:]]
    rows = [(t, s, x, ["Melanie's sister moved to Denver for a teaching job."]
             if t == "D1:5" else [] if t == "D1:6" else f) for t, s, x, f in rows]
    return rows + APPENDED


def tables(rows, tokenizer) -> tuple[pa.Table, pa.Table]:
    """(turns table, facts table) of one user, as ingest and extraction make them."""
    turns = pa.table({
        "user": [USER] * len(rows), "session": [t.split(":")[0] for t, *_ in rows],
        "turn_id": [t for t, *_ in rows], "turn_index": list(range(len(rows))),
        "speaker": [s for _, s, _, _ in rows], "text": [x for _, _, x, _ in rows],
        "timestamp": [None] * len(rows)}, schema=turns_schema.SCHEMA)
    composer = Composer(tokenizer)
    facts = [(i, tid, text) for i, (tid, _, _, fs) in enumerate(rows) for text in fs]
    g = torch.Generator().manual_seed(0)
    table = pa.table({
        "fact_id": [fact_id(USER, tid, text) for _, tid, text in facts],
        "user": [USER] * len(facts), "source_turn_id": [tid for _, tid, _ in facts],
        "source_index": [i for i, _, _ in facts], "text": [text for *_, text in facts],
        "token_ids": [composer.fact_ids(text) for *_, text in facts],
        "embedding": torch.randn(len(facts), EMB, generator=g).tolist(),
    }, schema=facts_schema.schema(EMB))
    return turns, table


def config(home, store: StoreConfig, **encoder) -> PipelineConfig:
    return PipelineConfig(home=home, model="embedded", device="cpu", model_dtype="float32",
                          encoder=EncoderConfig(**{"window": 3, "dtype": "float32", **encoder}),
                          artifact_root=store.root, storage_options=dict(store.storage_options))


def publish(cfg, turns, facts, encoded):
    run = cfg.run_identity(FactsConfig(mode="raw"), encoded.model_fingerprint)
    return publish_user(cfg, USER, encoded, facts, turns_hash(turns), facts_hash(facts, "test"),
                        run)


def encode_user_kv(cfg: PipelineConfig, turns, facts, previous: str | None = None):
    """The chain's encode step for ``USER`` with the embedded model's identity."""
    identity = cfg.identity(steps.serving_model(cfg).fingerprint)
    return steps.encode_user_kv(cfg, USER, turns, facts, identity, previous)


class Passes:
    """Counts the decoder's forward passes (one per encoded fact, batch-invariant)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.model.register_forward_hook(self.hook)

    def hook(self, *_):
        self.n += 1


def kv_bytes(store: StoreConfig, version: str, fp: str) -> bytes:
    loc = Location(store, USER, fp)
    return loc.blobs.read_bytes(data_path(loc, manifest_at(loc, version), KV_FILE))


def test_incremental_version_is_byte_identical_to_a_full_encode(store, inferscale_home,
                                                                 smollm2):
    tok, fp = smollm2.tokenizer, smollm2.fingerprint
    cfg = config(inferscale_home, store)
    turns1, facts1 = tables(V1, tok)
    v1 = publish(cfg, turns1, facts1, encode_user_kv(cfg, turns1, facts1))

    turns2, facts2 = tables(v2_turns(), tok)
    passes = Passes(steps.serving_model(cfg).model)
    try:
        inc = encode_user_kv(cfg, turns2, facts2, previous=v1.version)
    finally:
        passes.handle.remove()
    new2 = publish(cfg, turns2, facts2, inc)

    scratch_store = StoreConfig(store.root.rstrip("/") + "-scratch", dict(store.storage_options))
    scratch_cfg = config(inferscale_home, scratch_store)
    full = encode_user_kv(scratch_cfg, turns2, facts2)
    ref = publish(scratch_cfg, turns2, facts2, full)

    # same version id, same files (sizes and checksums; each publish stores its files
    # under names of its own), byte for byte
    assert new2.created and new2.version == ref.version != v1.version
    assert {n: (f.bytes, f.xxh3_128) for n, f in new2.manifest.files.items()} == {
        n: (f.bytes, f.xxh3_128) for n, f in ref.manifest.files.items()}
    assert kv_bytes(store, new2.version, fp) == kv_bytes(scratch_store, ref.version, fp)

    # what was reused: the facts of D1:0, D1:1 (windows before the inserted turn) and D1:7
    # (its window D1:4..6 kept its texts); the prefix. Encoded: the inserted turn's fact,
    # D1:2's two facts (their window gained a turn), D1:3, D1:4 (window changed), D1:5
    # (updated), the appended turns' facts. D1:6's fact is gone.
    ids = dict(zip(facts2.column("source_turn_id").to_pylist(),
                   facts2.column("fact_id").to_pylist()))
    reused = {ids["D1:0"], ids["D1:1"], ids["D1:7"]}
    assert inc.stats["reused"] == 3 and inc.stats["encoded"] == facts2.num_rows - 3 == 8
    assert inc.stats["prefix_reused"] and passes.n == 8  # no forward pass for the others
    assert full.stats["reused"] == 0 and inc.stats["forward_tokens"] < full.stats["forward_tokens"]

    old = hydrate(store, USER, fp, v1.version)
    new = hydrate(store, USER, fp, new2.version)
    assert set(new.content_keys) == set(facts2.column("fact_id").to_pylist()) | {"prefix"}
    for cid, key in new.content_keys.items():
        assert (key == old.content_keys.get(cid)) == (cid in reused | {"prefix"}), cid
    same_tokens = facts1.filter(pc.equal(facts1["source_turn_id"], "D1:2"))
    for cid in same_tokens.column("fact_id").to_pylist():  # same fact, same tokens, new window
        assert old.token_ids[cid] == new.token_ids[cid]
        assert old.content_keys[cid] != new.content_keys[cid]
    deleted = facts1.filter(pc.equal(facts1["source_turn_id"], "D1:6"))
    assert deleted.column("fact_id")[0].as_py() not in new.index


def test_unkeyed_or_unreadable_previous_versions_reuse_nothing(local_store, inferscale_home,
                                                              smollm2, caplog):
    """A previous version without keys (batched encoding) or that fails its checksum
    gives no rows to reuse: every fact is encoded."""
    tok, fp = smollm2.tokenizer, smollm2.fingerprint
    turns1, facts1 = tables(V1, tok)
    turns2, facts2 = tables(v2_turns(), tok)
    cfg = config(inferscale_home, local_store)
    batched_cfg = config(inferscale_home, local_store, batch_invariant=False)
    unkeyed = publish(batched_cfg, turns1, facts1, encode_user_kv(batched_cfg, turns1, facts1))
    assert hydrate(local_store, USER, fp, unkeyed.version).content_keys == {}
    inc = encode_user_kv(cfg, turns2, facts2, previous=unkeyed.version)
    assert (inc.stats["reused"], inc.stats["encoded"]) == (0, facts2.num_rows)
    assert not inc.stats["prefix_reused"]

    keyed = publish(cfg, turns1, facts1, encode_user_kv(cfg, turns1, facts1))
    loc = Location(local_store, USER, fp)
    path = data_path(loc, manifest_at(loc, keyed.version), KV_FILE)
    data = bytearray(loc.blobs.read_bytes(path))
    data[-200] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))
    with caplog.at_level(logging.WARNING, logger="inferscale.pipeline"):
        assert previous_kv(cfg, "nobody", fp, "latest") is None  # nothing published: quiet
        assert not caplog.text
        again = encode_user_kv(cfg, turns2, facts2, "latest")  # LATEST: the damaged version
    assert again.stats["reused"] == 0 and "unreadable, encoding every fact" in caplog.text
    assert keyed.version in caplog.text and "xxh3-128" in caplog.text


def test_serving_prefix_context_and_key_temperature(local_store, inferscale_home, smollm2):
    """With the serving prefix before each window (``context="memory"``) the key covers
    the prefix too, and reused keys, stored already divided by ``key_temperature``, are
    not divided again: the incremental chunks equal a full encode's, bit for bit."""
    tok = smollm2.tokenizer
    cfg = config(inferscale_home, local_store, context="memory", key_temperature=1.5)
    turns1, facts1 = tables(V1, tok)
    turns2, facts2 = tables(v2_turns(), tok)
    v1 = publish(cfg, turns1, facts1, encode_user_kv(cfg, turns1, facts1))
    inc = encode_user_kv(cfg, turns2, facts2, previous=v1.version)
    full = encode_user_kv(cfg, turns2, facts2)
    assert inc.stats["reused"] == 3 and full.stats["reused"] == 0
    assert [c.content_key for c in inc.chunks] == [c.content_key for c in full.chunks]
    for a, b in zip(inc.chunks, full.chunks):
        assert torch.equal(a.kv, b.kv), a.chunk_id
