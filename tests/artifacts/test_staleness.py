"""Which users need encoding: LATEST's parent log hash and encoder config vs now."""

from __future__ import annotations

from builders import make_inputs
from inferscale.artifacts.publish import publish
from inferscale.artifacts.staleness import plan_users


def test_plan_reasons(local_store, tmp_path):
    fp = "fp-test"
    mem, facts, lineage = make_inputs("maya", 3, seed=1, fp=fp)
    v = publish(local_store, "maya", mem, facts, lineage).version
    enc = dict(mem.encoder_config)
    (tmp_path / "artifacts" / "users").mkdir(parents=True, exist_ok=True)
    (tmp_path / "artifacts" / "users" / "broken").write_text("a file, not a folder")
    plans = plan_users(local_store, fp, enc, {
        "maya": lineage.log_hash, "tomas": "h-tomas", "broken": "h-broken"})
    assert plans["maya"].reason == "up-to-date" and plans["maya"].latest == v
    assert not plans["maya"].needs_encoding
    assert plans["tomas"].reason == "new" and plans["tomas"].latest is None
    assert plans["broken"].reason == "unreadable" and plans["broken"].needs_encoding
    assert "NotADirectoryError" in plans["broken"].detail

    changed = plan_users(local_store, fp, enc, {"maya": "another-log-hash"})["maya"]
    assert changed.reason == "log-changed" and changed.latest == v and changed.needs_encoding
    other_enc = plan_users(local_store, fp, {**enc, "window": 7}, {"maya": lineage.log_hash})
    assert other_enc["maya"].reason == "encoder-changed" and "window" in other_enc["maya"].detail
    other_model = plan_users(local_store, "fp-other", enc, {"maya": lineage.log_hash})
    assert other_model["maya"].reason == "new"
