"""``inferscale encode`` (the library's chain without Prefect) on the real embedded model
and real Mem0 (raw facts): one user's bad id or failure never costs another user their
version; a rerun on unchanged inputs encodes and writes nothing (the LATEST check); each
version's lineage is recorded in the run's log."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

ANN = [{"user": "ann smith", "session": "1", "turn": f"A{i}", "speaker": "Ann",
        "text": text, "timestamp": "2024-05-02"}
       for i, text in enumerate(["I keep bees on the roof of my flat.", "Two hives, so far."])]


@pytest.fixture
def home(own_home, monkeypatch):
    """An InferScale home of its own (Mem0 scratch), sharing the converted model."""
    monkeypatch.setenv("INFERSCALE_WINDOW", "2")
    return own_home


def logs_with_ann(tmp_path) -> str:
    """The first turns of maya and tomas, and two turns of user ``ann smith``."""
    from inferscale.ingest.logs import sample_conversations

    rows = [json.loads(x) for x in sample_conversations().read_text().splitlines()]
    keep = [r for u in ("maya", "tomas") for r in [r for r in rows if r["user"] == u][:4]]
    path = tmp_path / "logs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in keep[:4] + ANN + keep[4:]))
    return str(path)


def encode(capsys, *argv: str) -> tuple[int, dict, str]:
    """``inferscale encode``: its exit status, the report (stdout), the run's log (stderr)."""
    from inferscale.cli import main

    status = main(["encode", "--fact-mode", "raw", *argv])
    out, err = capsys.readouterr()
    return status, json.loads(out[out.index("{"):]), err


def lineage(log: str, user: str, version: str, fp: str) -> str:
    """The line of the run's log that records ``user``'s ``version`` (exactly one)."""
    (line,) = [x for x in log.splitlines()
               if f"user {user}: version {version} of model {fp[:12]}, parents log " in x]
    return line


def test_one_users_failure_costs_the_others_nothing(home, tmp_path, capsys):
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.read import verify_version

    logs = logs_with_ann(tmp_path)
    root = tmp_path / "artifacts"
    store = StoreConfig(str(root))

    # a user id Mem0 refuses (inner space) is quarantined at ingestion: the others publish
    status, report, log = encode(capsys, "--logs", logs, "--artifact-root", str(root))
    assert status == 0
    users = report["users"]
    assert sorted(users) == ["maya", "tomas"]
    assert report["ingest"]["reasons"] == {"bad_user": 2}
    fp = report["model_fingerprint"]
    for user in ("maya", "tomas"):
        assert users[user]["status"] == "published" and users[user]["facts"] == 4
        assert verify_version(store, user, fp).version == users[user]["version"]

    # each published version's lineage is in the command's output (its log, on stderr)
    for user in ("maya", "tomas"):
        line = lineage(log, user, users[user]["version"], fp)
        assert ", previous (none), from " in line and line.endswith(logs)

    # unchanged inputs: LATEST already names each version, nothing is encoded or written
    status, again, log = encode(capsys, "--logs", logs, "--artifact-root", str(root))
    assert status == 0
    for user in ("maya", "tomas"):
        out = again["users"][user]
        assert out["status"] == "unchanged" and out["version"] == users[user]["version"]
        assert out["encoded"] is None and out["kv_bytes"] is None
        assert f"user {user}: LATEST already names version {out['version']}" in log
        assert lineage(log, user, out["version"], fp)

    # another window: new versions, each naming its parents and the previous version
    status, wider, log = encode(capsys, "--logs", logs, "--artifact-root", str(root),
                                "--window", "3")
    assert status == 0
    for user in ("maya", "tomas"):
        new = wider["users"][user]
        assert new["status"] == "published" and new["version"] != users[user]["version"]
        line = lineage(log, user, new["version"], fp)
        assert f", previous {users[user]['version']}, from " in line
        m = verify_version(store, user, fp)
        assert f"parents log {m.parents['log'][:12]} facts {m.parents['facts'][:12]}," in line

    # a user whose chain fails (a damaged store: a file where maya's folder should be)
    # fails alone, after the others were published
    other = tmp_path / "other"
    (other / "users").mkdir(parents=True)
    (other / "users" / "maya").write_text("not a folder")
    status, broken, _ = encode(capsys, "--logs", logs, "--artifact-root", str(other))
    assert status == 1
    assert broken["users"]["maya"]["status"] == "failed"
    assert "NotADirectoryError" in broken["users"]["maya"]["error"]
    assert broken["users"]["tomas"]["status"] == "published"
    assert broken["users"]["tomas"]["version"] == users["tomas"]["version"]
    assert verify_version(StoreConfig(str(other)), "tomas", fp).version == \
        users["tomas"]["version"]
