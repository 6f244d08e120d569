"""Which users need encoding: LATEST's parent log hash and recorded settings vs the
identity of this run (the facts config and the encoding)."""

from __future__ import annotations

import json
from dataclasses import replace

from builders import make_inputs
from inferscale.artifacts.publish import publish
from inferscale.artifacts.staleness import plan_users
from inferscale.encode.identity import EncoderConfig, EncodingIdentity, RunIdentity
from inferscale.facts.extractor import FactsConfig

RAW = FactsConfig(mode="raw")


def test_plan_reasons(local_store, tmp_path):
    fp = "fp-test"
    identity = RunIdentity.of(RAW, EncodingIdentity(EncoderConfig(window=2), fp, "float32",
                                                    "cpu"))
    mem, facts, lineage = make_inputs("maya", 3, seed=1, fp=fp)
    mem.encoder_config = identity.record()
    v = publish(local_store, "maya", mem, facts, lineage).version
    (tmp_path / "artifacts" / "users").mkdir(parents=True, exist_ok=True)
    (tmp_path / "artifacts" / "users" / "broken").write_text("a file, not a folder")
    plans = plan_users(local_store, identity, {
        "maya": lineage.log_hash, "tomas": "h-tomas", "broken": "h-broken"})
    assert plans["maya"].reason == "up-to-date" and plans["maya"].latest == v
    assert not plans["maya"].needs_encoding
    assert plans["tomas"].reason == "new" and plans["tomas"].latest is None
    assert plans["broken"].reason == "unreadable" and plans["broken"].needs_encoding
    assert "NotADirectoryError" in plans["broken"].detail

    changed = plan_users(local_store, identity, {"maya": "another-log-hash"})["maya"]
    assert changed.reason == "log-changed" and changed.latest == v and changed.needs_encoding
    enc = identity.encoding
    other_enc = plan_users(local_store, replace(identity, encoding=replace(
        enc, encoder=EncoderConfig(window=7))), {"maya": lineage.log_hash})
    assert other_enc["maya"].reason == "encoder-changed" and "window" in other_enc["maya"].detail
    # a calibrated encoder is another encoding: the backfill and nightly re-encode onto it
    calibrated = replace(identity, encoding=replace(
        enc, encoder=EncoderConfig(window=2, key_calibration="layer")))
    cal = plan_users(local_store, calibrated, {"maya": lineage.log_hash})["maya"]
    assert cal.reason == "encoder-changed" and cal.detail == "key_calibration"
    # KV computed on another device (or in another dtype) is as current
    gpu = replace(identity, encoding=replace(enc, compute_dtype="bfloat16",
                                             compute_device="cuda"))
    assert plan_users(local_store, gpu, {"maya": lineage.log_hash})["maya"].reason == "up-to-date"
    other_model = plan_users(local_store, replace(identity, encoding=replace(
        enc, model_fingerprint="fp-other")), {"maya": lineage.log_hash})
    assert other_model["maya"].reason == "new"


def test_a_facts_config_change_is_stale(local_store):
    """Another fact_mode (or any facts setting) is another run: its users need encoding,
    as ``inferscale encode`` republishes them; a version recorded without a facts config
    (published before it was recorded) is re-encoded once. A credential in the LLM's URL
    is no setting: neither recorded nor compared."""
    fp = "fp-test"
    enc = EncodingIdentity(EncoderConfig(window=2), fp, "float32", "cpu")
    mem0 = FactsConfig(mode="mem0", llm_base_url="http://llm:8000/v1", llm_model="m")
    users = {"raw-user": RunIdentity.of(RAW, enc), "mem0-user": RunIdentity.of(mem0, enc)}
    hashes = {}
    for i, (user, run) in enumerate(users.items()):
        mem, facts, lineage = make_inputs(user, 2, seed=i, fp=fp)
        mem.encoder_config = run.record()
        publish(local_store, user, mem, facts, lineage, embeddings=False)
        hashes[user] = lineage.log_hash
    mem, facts, lineage = make_inputs("old-user", 2, seed=9, fp=fp)
    mem.encoder_config = enc.record()  # as versions were recorded before the facts config
    publish(local_store, "old-user", mem, facts, lineage, embeddings=False)
    hashes["old-user"] = lineage.log_hash

    as_raw = plan_users(local_store, RunIdentity.of(RAW, enc), hashes)
    assert as_raw["raw-user"].reason == "up-to-date"
    assert as_raw["mem0-user"].reason == "facts-changed" and as_raw["mem0-user"].needs_encoding
    assert "facts.mode" in as_raw["mem0-user"].detail.split(", ")
    assert as_raw["old-user"].reason == "facts-changed" and as_raw["old-user"].detail == "facts"
    with_password = replace(mem0, llm_base_url="http://me:s3cret@llm:8000/v1")
    as_mem0 = plan_users(local_store, RunIdentity.of(with_password, enc), hashes)
    assert as_mem0["mem0-user"].reason == "up-to-date"
    assert as_mem0["raw-user"].reason == "facts-changed"
    assert "s3cret" not in json.dumps(RunIdentity.of(with_password, enc).record())
    # an encoder change beside a facts change is an encoder change
    both = RunIdentity.of(mem0, replace(enc, encoder=EncoderConfig(window=5)))
    assert plan_users(local_store, both, hashes)["raw-user"].reason == "encoder-changed"


def _rewrite(store, user, fp, version, data: bytes) -> None:
    from inferscale.artifacts.blobs import Location

    store.filesystem().pipe_file(Location(store, user, fp).file(version, "manifest.json"), data)


def test_one_malformed_manifest_never_stops_the_others(local_store):
    """LATEST manifests re-signed with fields of the wrong type (the audit's: a string
    encoder config with null parents; a numeric creation time; ``kv`` a list) or too deep
    for the JSON parser: each of those users is planned ``unreadable`` (re-encoded: a new
    version repairs it) with the reason, and every other user is planned as usual."""
    from storage_schemas.manifest import _checksum

    fp = "fp-test"
    identity = RunIdentity.of(RAW, EncodingIdentity(EncoderConfig(window=2), fp, "float32",
                                                    "cpu"))
    hashes, versions = {}, {}
    users = ("ann", "bad-config", "bad-created", "bad-kv", "deep")
    for i, user in enumerate(users):
        mem, facts, lineage = make_inputs(user, 2, seed=i, fp=fp)
        mem.encoder_config = identity.record()
        versions[user] = publish(local_store, user, mem, facts, lineage,
                                 embeddings=False).version
        hashes[user] = lineage.log_hash
    for user, change in (("bad-config", {"encoder_config": "window=2", "parents": None}),
                         ("bad-created", {"created": 1767225600}), ("bad-kv", {"kv": [1]})):
        path = local_store.root + f"/users/{user}/{fp}/{versions[user]}/manifest.json"
        body = {k: v for k, v in json.loads(open(path).read()).items() if k != "checksum"}
        body.update(change)
        _rewrite(local_store, user, fp, versions[user],
                 json.dumps({**body, "checksum": _checksum(body)}).encode())
    _rewrite(local_store, "deep", fp, versions["deep"], b"[" * 100_000 + b"]" * 100_000)
    plans = plan_users(local_store, identity, {**hashes, "new-user": "h"})
    assert plans["ann"].reason == "up-to-date" and plans["new-user"].reason == "new"
    for user in ("bad-config", "bad-created", "bad-kv", "deep"):
        assert plans[user].reason == "unreadable" and plans[user].needs_encoding, plans[user]
        assert plans[user].detail.startswith("CorruptArtifact"), plans[user].detail
    assert "encoder_config must be an object" in plans["bad-config"].detail
    assert "created must be a string" in plans["bad-created"].detail

