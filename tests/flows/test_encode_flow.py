"""The encode flow in this process against the real Prefect server: the project's sample
conversation (raw facts, the embedded model), lineage artifacts read back through the
API, reruns served from the content-hash caches."""

from __future__ import annotations

import base64

import pytest

from inferscale.types import DEFAULT_CONTEXT, DEFAULT_WINDOW
from prefect_env import (
    artifacts_of_run, artifacts_with_key, result_records, table_rows, task_runs_of,
)

pytestmark = pytest.mark.slow


def _states(flow_run_id) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in task_runs_of(flow_run_id):
        out.setdefault(r.name.rsplit("-", 1)[0] if r.name.startswith(("ingest", "resolve",
                       "record-lineage", "plan")) else r.name, []).append(r.state.name)
    return out


def test_encode_publishes_every_user_with_lineage(flow_env, tmp_path):
    from flows.encode import encode_users
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.lineage_view import artifact_key, version_of_rows
    from inferscale.artifacts.read import list_versions, read_manifest, verify_version
    from inferscale.ingest.logs import read_logs, sample_conversations

    root = tmp_path / "artifacts"
    state = encode_users(artifact_root=str(root), fact_mode="raw", return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    users = sorted(read_logs(str(sample_conversations())).turns)
    assert sorted(report["users"]) == users == ["maya", "tomas"]
    store = StoreConfig(str(root))
    fp = report["model_fingerprint"]
    hashes = read_logs(str(sample_conversations())).turns_hashes()
    for user in users:
        out = report["users"][user]
        assert out["status"] in ("published", "unchanged") and out["facts"] > 0
        m = verify_version(store, user, fp)  # LATEST, every checksum
        assert m.version == out["version"] and m.parents["log"] == hashes[user]
        assert [v.version for v in list_versions(store, user, fp)] == [m.version]
        # the lineage table of this (user, model) key describes LATEST
        key = artifact_key(user, fp)
        assert out["artifact_key"] == key
        arts = artifacts_with_key(key)
        assert arts and arts[-1].type == "table"
        rows = {r["field"]: r["value"] for r in table_rows(arts[-1])}
        assert version_of_rows(table_rows(arts[-1])) == m.version
        assert rows["parent: log"] == m.parents["log"]
        assert rows["parent: facts"] == m.parents["facts"]
        assert rows["model fingerprint"] == fp
        assert str(m.files["kv.arrow"].bytes) in rows["kv.arrow"]
        assert m.files["kv.arrow"].xxh3_128 in rows["kv.arrow"]
        assert rows["files"].endswith(f"/{m.version}") and rows["files"].startswith("file://")
        assert f'"window": {DEFAULT_WINDOW}' in rows["encoder config"]
        assert f'"context": "{DEFAULT_CONTEXT}"' in rows["encoder config"]
        assert read_manifest(store, user, fp).version == m.version
    # the run's markdown summary links each user's lineage key
    run_arts = artifacts_of_run(state.state_details.flow_run_id)
    summary = [a for a in run_arts if a.key == "inferscale-encode-summary"]
    assert len(summary) == 1 and summary[0].type == "markdown"
    for user in users:
        assert f"/artifacts/key/{artifact_key(user, fp)}" in summary[0].data

    # rerun on unchanged inputs: facts from the cache, nothing encoded or written, no
    # new lineage record, and it takes a fraction of the first run
    first_s = report["seconds"]
    again = encode_users(artifact_root=str(root), fact_mode="raw", return_state=True)
    assert again.is_completed()
    rep2 = again.result()
    assert {u: o["status"] for u, o in rep2["users"].items()} == {u: "unchanged" for u in users}
    states = _states(again.state_details.flow_run_id)
    assert states["extract-facts-maya"] == ["Cached"] and states["extract-facts-tomas"] == ["Cached"]
    assert not any(n.startswith(("encode-kv", "publish", "record-version")) for n in states)
    for user in users:
        assert len(artifacts_with_key(artifact_key(user, fp))) == len(
            [a for a in artifacts_with_key(artifact_key(user, fp))
             if a.flow_run_id != again.state_details.flow_run_id])
        assert [v.version for v in list_versions(store, user, fp)] == \
            [report["users"][user]["version"]]
    assert rep2["seconds"] < max(0.5 * first_s, 20), (rep2["seconds"], first_s)

    # a new store on the same inputs: KV comes from the cache, byte-identical files
    other = StoreConfig(str(tmp_path / "other"))
    third = encode_users(artifact_root=other.root, fact_mode="raw", return_state=True)
    assert third.is_completed()
    states = _states(third.state_details.flow_run_id)
    assert states["encode-kv-maya"] == ["Cached"] and states["encode-kv-tomas"] == ["Cached"]
    for user in users:
        a, b = verify_version(store, user, fp), verify_version(other, user, fp)
        assert a.version == b.version
        assert {n: (e.bytes, e.xxh3_128) for n, e in a.files.items()} == \
            {n: (e.bytes, e.xxh3_128) for n, e in b.files.items()}

    # result storage (this session's: earlier runs may have cached the same facts) holds
    # the cached facts and KV as Arrow; no pickle there holds either
    records = result_records()
    cached = {k: r["metadata"]["serializer"]["type"] for k, r in records.items()
              if k.startswith(("inferscale-kv-", "inferscale-facts-"))}  # tasks/caching.py
    assert set(cached.values()) == {"inferscale-encoded-kv-arrow", "inferscale-facts-arrow"}
    for r in records.values():
        if "metadata" not in r:  # a flow's report: JSON itself (flows.results), its
            continue  # metadata in the run's state
        if r["metadata"]["serializer"]["type"] == "json":  # JSON text (a failed task's
            continue  # exception under a JSON serializer among them): no pickle
        raw = base64.b64decode(r["result"])
        if raw.startswith(b"\x80"):  # a pickle (Prefect pickles a failed task's exception)
            assert not any(m in raw for m in (b"inferscale.encode", b"inferscale.facts",
                                              b"torch", b"pyarrow")), raw[:200]


def test_unknown_user_is_refused(flow_env, tmp_path):
    from flows.encode import encode_users

    state = encode_users(users=["nobody"], artifact_root=str(tmp_path / "a"), fact_mode="raw",
                         return_state=True)
    assert state.is_failed() and "nobody" in state.message
