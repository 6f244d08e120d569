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
