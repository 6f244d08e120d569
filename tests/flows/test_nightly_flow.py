"""Nightly re-encode: only users whose log content changed since their LATEST (or who are
new) are encoded; unchanged users are not even extracted."""

from __future__ import annotations

import json

import pytest

from prefect_env import artifacts_of_run, artifacts_with_key, table_rows, task_runs_of

pytestmark = pytest.mark.slow


def test_only_changed_users_are_reencoded(flow_env, tmp_path):
    from flows.encode import encode_users
    from flows.nightly import nightly_reencode
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.lineage_view import artifact_key
    from inferscale.artifacts.read import latest_version, list_versions, verify_version
    from inferscale.ingest.logs import read_logs, sample_conversations

    root = tmp_path / "artifacts"
    store = StoreConfig(str(root))
    first = encode_users(artifact_root=str(root), fact_mode="raw")
    fp = first["model_fingerprint"]
    total = sum(o["facts"] for o in first["users"].values())
    # encoded now, or by an earlier test's run on the same inputs (KV from the task cache)
    assert first["facts"] in ({"reused": 0, "encoded": total}, {"reused": 0, "encoded": 0})
    before = {u: o["version"] for u, o in first["users"].items()}

    # tomas says one more thing; maya's turns stay exactly the same
    logs = tmp_path / "logs.jsonl"
    lines = sample_conversations().read_text().splitlines()
    lines.append(json.dumps({"user": "tomas", "session": "9", "turn": "S9:1",
                             "speaker": "Tomas", "text": "I finally bought the cargo bike.",
                             "timestamp": "2024-06-01T10:00:00"}))
    logs.write_text("\n".join(lines) + "\n")

    state = nightly_reencode(logs=[str(logs)], artifact_root=str(root), fact_mode="raw",
                             return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    users = report["users"]
    assert users["maya"]["status"] == "up-to-date" and users["maya"]["version"] == before["maya"]
    assert users["tomas"]["status"] == "published" and users["tomas"]["reason"] == "log-changed"
    names = {r.name for r in task_runs_of(state.state_details.flow_run_id)}
    assert not any(n.endswith("-maya") for n in names), names  # maya cost no task at all
    assert {"encode-user-tomas", "extract-facts-tomas", "encode-kv-tomas"} <= names

    # tomas's earlier facts (one per turn in raw mode) keep their windows: only the new
    # turn's fact is encoded, the others' K/V are read from his previous version
    assert (users["tomas"]["reused"], users["tomas"]["encoded"]) == (
        first["users"]["tomas"]["facts"], 1)
    assert report["facts"] == {"reused": first["users"]["tomas"]["facts"], "encoded": 1}
    (summary,) = [a for a in artifacts_of_run(state.state_details.flow_run_id)
                  if a.key == "inferscale-nightly-summary"]
    assert f"facts: {first['users']['tomas']['facts']} reused, 1 encoded" in summary.data

    new = users["tomas"]["version"]
    assert new != before["tomas"] and latest_version(store, "tomas", fp) == new
    assert_same_as_full_encode(root, tmp_path / "scratch", logs, new, fp)
    m = verify_version(store, "tomas", fp)
    assert m.parents["log"] == read_logs(str(logs)).turns_hashes()["tomas"]
    assert [v.version for v in list_versions(store, "tomas", fp)] == [before["tomas"], new]
    assert latest_version(store, "maya", fp) == before["maya"]
    # the lineage timeline of tomas now ends with the new version, pointing back
    rows = {r["field"]: r["value"]
            for r in table_rows(artifacts_with_key(artifact_key("tomas", fp))[-1])}
    assert rows["version"] == new and rows["previous version"] == before["tomas"]

    # nothing changed since: nobody is encoded
    again = nightly_reencode(logs=[str(logs)], artifact_root=str(root), fact_mode="raw",
                             return_state=True)
    assert {u: o["status"] for u, o in again.result()["users"].items()} == \
        {"maya": "up-to-date", "tomas": "up-to-date"}
    names = {r.name for r in task_runs_of(again.state_details.flow_run_id)}
    assert not any(n.startswith(("encode-user", "extract-facts", "encode-kv")) for n in names)


def test_a_facts_config_change_is_reencoded(flow_env, tmp_path, monkeypatch):
    """Another facts config (here another embedder: the packaged one under another name,
    so the facts' text and K/V are the same) is another run, as for ``inferscale
    encode``: the nightly re-encodes every user (``facts-changed``), computing no K/V,
    onto a version recording it with the same KV bytes; the next run skips them."""
    from flows.encode import encode_users
    from flows.nightly import nightly_reencode
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.read import read_manifest
    from inferscale.facts.extractor import embedded_embedder_path

    root = tmp_path / "artifacts"
    store = StoreConfig(str(root))
    first = encode_users(artifact_root=str(root), fact_mode="raw")
    fp = first["model_fingerprint"]
    renamed = tmp_path / "minilm-renamed"
    renamed.symlink_to(embedded_embedder_path(), target_is_directory=True)
    monkeypatch.setenv("INFERSCALE_EMBEDDER", str(renamed))
    state = nightly_reencode(artifact_root=str(root), fact_mode="raw", return_state=True)
    assert state.is_completed(), state.message
    users = state.result()["users"]
    assert {u: (o["status"], o["reason"]) for u, o in users.items()} == {
        u: ("published", "facts-changed") for u in first["users"]}
    for user, o in users.items():
        assert o["encoded"] == 0  # the KV step's cache (or every fact reused)
        old = read_manifest(store, user, fp, first["users"][user]["version"])
        new = read_manifest(store, user, fp, o["version"])
        assert new.encoder_config["facts"]["embedder"] == "st:minilm-renamed:384"
        assert new.files["kv.arrow"].xxh3_128 == old.files["kv.arrow"].xxh3_128
        assert new.parents["log"] == old.parents["log"]
    again = nightly_reencode(artifact_root=str(root), fact_mode="raw", return_state=True)
    assert {o["status"] for o in again.result()["users"].values()} == {"up-to-date"}


def assert_same_as_full_encode(root, scratch, logs, version, fp):
    """The flow's incremental version of tomas == encoding all his facts from scratch."""
    from inferscale.artifacts.blobs import Location
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.read import data_path, read_facts, read_manifest
    from inferscale.ingest.logs import read_logs
    from inferscale.pipeline.config import configs_from_settings
    from inferscale.pipeline.steps import encode_user_kv, publish_user
    from inferscale.settings import Settings

    cfg, facts_cfg = configs_from_settings(Settings(), fact_mode="raw",
                                           artifact_root=str(scratch))
    store = StoreConfig(str(root))
    facts = read_facts(store, "tomas", fp, version)
    m = read_manifest(store, "tomas", fp, version)
    turns = read_logs(str(logs)).turns["tomas"]
    full = encode_user_kv(cfg, "tomas", turns, facts, cfg.identity(fp))
    assert full.stats["reused"] == 0
    ref = publish_user(cfg, "tomas", full, facts, m.parents["log"], m.parents["facts"],
                       cfg.run_identity(facts_cfg, fp))
    assert ref.version == version
    assert {n: (f.bytes, f.xxh3_128) for n, f in ref.manifest.files.items()} == {
        n: (f.bytes, f.xxh3_128) for n, f in m.files.items()}  # stored names differ
    a, b = Location(store, "tomas", fp), Location(cfg.store(), "tomas", fp)
    assert a.blobs.read_bytes(data_path(a, m, "kv.arrow")) == \
        b.blobs.read_bytes(data_path(b, ref.manifest, "kv.arrow"))
