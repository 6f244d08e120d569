"""Which users need encoding: LATEST's parent log hash and encoder settings vs the
encoding identity of this run."""

from __future__ import annotations

from dataclasses import replace

from builders import make_inputs
from inferscale.artifacts.publish import publish
from inferscale.artifacts.staleness import plan_users
from inferscale.encode.identity import EncoderConfig, EncodingIdentity


def test_plan_reasons(local_store, tmp_path):
    fp = "fp-test"
    identity = EncodingIdentity(EncoderConfig(window=2), fp, "float32", "cpu")
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
    other_enc = plan_users(local_store, replace(identity, encoder=EncoderConfig(window=7)),
                           {"maya": lineage.log_hash})
    assert other_enc["maya"].reason == "encoder-changed" and "window" in other_enc["maya"].detail
    # a calibrated encoder is another encoding: the backfill and nightly re-encode onto it
    calibrated = replace(identity, encoder=EncoderConfig(window=2, key_calibration="layer"))
    cal = plan_users(local_store, calibrated, {"maya": lineage.log_hash})["maya"]
    assert cal.reason == "encoder-changed" and cal.detail == "key_calibration"
    # KV computed on another device (or in another dtype) is as current
    gpu = replace(identity, compute_dtype="bfloat16", compute_device="cuda")
    assert plan_users(local_store, gpu, {"maya": lineage.log_hash})["maya"].reason == "up-to-date"
    other_model = plan_users(local_store, replace(identity, model_fingerprint="fp-other"),
                             {"maya": lineage.log_hash})
    assert other_model["maya"].reason == "new"


def _rewrite(store, user, fp, version, data: bytes) -> None:
    from inferscale.artifacts.blobs import Location

    store.filesystem().pipe_file(Location(store, user, fp).file(version, "manifest.json"), data)


def test_one_malformed_manifest_never_stops_the_others(local_store):
    """LATEST manifests re-signed with fields of the wrong type (the audit's: a string
    encoder config with null parents; a numeric creation time; ``kv`` a list) or too deep
    for the JSON parser: each of those users is planned ``unreadable`` (re-encoded: a new
    version repairs it) with the reason, and every other user is planned as usual."""
    import json

    from storage_schemas.manifest import _checksum

    fp = "fp-test"
    identity = EncodingIdentity(EncoderConfig(window=2), fp, "float32", "cpu")
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

