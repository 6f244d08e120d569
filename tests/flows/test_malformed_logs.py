"""Malformed logs: bad records are quarantined and reported; every user with valid turns
is still published."""

from __future__ import annotations

import json

import pytest

from prefect_env import artifacts_of_run

pytestmark = pytest.mark.slow

BAD_LINES = [
    '{"user": "maya", "session": "1", "turn": "S1:1", "speaker": "Maya", "text": "dup", '
    '"timestamp": "2024-03-04"}',                                        # duplicate_turn_id
    '{"user": "tomas", "session": "9", "turn": "X1", "speaker": "Tomas"',  # invalid_json
    '{"user": "ivy", "session": "1", "turn": "I9", "speaker": "Ivy", "timestamp": null}',  # missing_field
    '{"user": "ivy", "session": "1", "turn": "I8", "speaker": "Ivy", "text": "  ", '
    '"timestamp": null}',                                                # empty_text
    '{"user": "ivy", "session": "1", "turn": "I7", "speaker": "Ivy", "text": "hi", '
    '"timestamp": "yesterday"}',                                         # bad_timestamp
    '{"user": "ghost", "session": 1, "turn": "G1", "speaker": "Ghost", "text": "boo", '
    '"timestamp": null}',                                                # wrong_type
    '[1, 2, 3]',                                                         # not_an_object
    '{"user": "ann smith", "session": "1", "turn": "A1", "speaker": "Ann", "text": "hi", '
    '"timestamp": null}',                                # bad_user (Mem0 refuses spaces)
    '{"user": "ivy", "session": "1", "turn": "I6", "speaker": "I\\udfffvy", '
    '"text": "bees \\ud800", "timestamp": null}',      # invalid_unicode (lone surrogates)
]
IVY = [
    {"user": "ivy", "session": "1", "turn": "I1", "speaker": "Ivy",
     "text": "I keep bees on the roof of my flat in Bristol.", "timestamp": "2024-05-02"},
    {"user": "ivy", "session": "1", "turn": "I2", "speaker": "assistant",
     "text": "How many hives do you have?", "timestamp": "2024-05-02"},
    {"user": "ivy", "session": "1", "turn": "I3", "speaker": "Ivy",
     "text": "Two hives; the honey goes to my sister's cafe.", "timestamp": "2024-05-02"},
]


def test_bad_records_quarantined_others_published(flow_env, tmp_path):
    from flows.encode import encode_users
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.read import verify_version
    from inferscale.ingest.logs import sample_conversations

    logs = tmp_path / "logs.jsonl"
    lines = sample_conversations().read_text().splitlines()
    lines[5:5] = BAD_LINES[:3]  # bad records among good ones (after maya's S1:1)
    lines += [json.dumps(r) for r in IVY] + BAD_LINES[3:]
    logs.write_text("\n".join(lines) + "\n")
    root = tmp_path / "artifacts"

    state = encode_users(logs=[str(logs)], artifact_root=str(root), fact_mode="raw",
                         return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    assert sorted(report["users"]) == ["ivy", "maya", "tomas"]  # ghost had no valid turn
    store = StoreConfig(str(root))
    for user, out in report["users"].items():
        assert out["status"] in ("published", "unchanged"), out
        assert verify_version(store, user, report["model_fingerprint"]).version == out["version"]
    assert report["users"]["ivy"]["turns"] == 3
    ingest = report["ingest"]
    assert ingest["quarantined"] == len(BAD_LINES)
    assert ingest["reasons"] == {"bad_timestamp": 1, "bad_user": 1, "duplicate_turn_id": 1,
                                 "empty_text": 1, "invalid_json": 1, "invalid_unicode": 1,
                                 "missing_field": 1, "not_an_object": 1, "wrong_type": 1}
    # written next to the artifacts, one JSON record per bad line, with its reason
    qpath = report["quarantine_uri"]
    assert qpath.startswith(str(root / "quarantine"))
    records = [json.loads(x) for x in open(qpath, "rb").read().decode("utf-8").splitlines()]
    assert sorted(r["reason"] for r in records) == sorted(ingest["reasons"])
    assert {r["location"] for r in records} >= {"line 6", "line 7", "line 8"}
    # and reported in the run's summary
    (summary,) = [a for a in artifacts_of_run(state.state_details.flow_run_id)
                  if a.key == "inferscale-encode-summary"]
    assert f"{len(BAD_LINES)} quarantined" in summary.data
    assert "## Quarantined records" in summary.data and "duplicate_turn_id" in summary.data
    assert qpath in summary.data
