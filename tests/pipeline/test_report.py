"""Run reports: counts, failures first in the table, markdown links to lineage keys."""

from inferscale.pipeline.report import RunReport, UserOutcome


def test_report():
    outs = [UserOutcome("maya", "published", "a" * 32, "log-changed", facts=3, reused=2,
                        encoded=1, seconds=1.5, artifact_key="mem-maya-fp"),
            UserOutcome("tomas", "failed", reason="log-changed", error="OSError: x | y"),
            UserOutcome("ivy", "up-to-date", "b" * 32, "up-to-date", artifact_key="mem-ivy-fp")]
    r = RunReport("Nightly", "fp" * 16, outs, {"records_read": 9, "turns_kept": 7,
                                               "quarantined": 2, "reasons": {"empty_text": 2}},
                  "s3://b/q.jsonl", 3.0)
    assert r.counts() == {"published": 1, "failed": 1, "up-to-date": 1}
    assert [o.user for o in r.failed] == ["tomas"]
    assert r.table()[0]["user"] == "tomas" and r.table()[0]["error"] == "OSError: x | y"
    md = r.markdown()
    assert "[mem-maya-fp](/artifacts/key/mem-maya-fp)" in md
    assert "2 quarantined (empty_text: 2)" in md and "s3://b/q.jsonl" in md
    assert "OSError: x \\| y" in md  # the pipe does not break the table
    assert "facts: 2 reused, 1 encoded" in md
    assert "| maya | published | log-changed | aaaaaaaaaaaa | 3 | 2 | 1 | 1.5 |" in md
    assert "| ivy | up-to-date | up-to-date | bbbbbbbbbbbb |  |  |  |  |" in md
    assert r.table()[1]["reused"] == "" and r.table()[2]["encoded"] == 1
    d = r.to_dict()
    assert d["users"]["maya"]["version"] == "a" * 32 and d["counts"]["failed"] == 1
    assert d["facts"] == {"reused": 2, "encoded": 1} and d["users"]["maya"]["reused"] == 2
