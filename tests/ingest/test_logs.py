"""Log ingestion: the project's sample, malformed records, LoCoMo format, content hash."""

from __future__ import annotations

import json
from collections import Counter

import fsspec
import pytest

from inferscale.ingest.logs import LogError, read_logs, sample_conversations, turns_hash
from inferscale.ingest.records import LogLimits
from storage_schemas import turns as turns_schema


def _line(**fields) -> bytes:
    return (json.dumps(fields, ensure_ascii=False) + "\n").encode()


def _good(user: str, turn: str | int, text: str = "I have a cat named Pixel.", **kw) -> dict:
    rec = {"user": user, "session": "1", "turn": turn, "speaker": "Ana", "text": text,
           "timestamp": "2024-05-02T21:15:00"}
    rec.update(kw)
    return rec


def test_sample_conversation_is_valid_and_complete():
    res = read_logs(str(sample_conversations()))
    assert res.counts == {"sources": 1, "records_read": 70, "turns_kept": 70,
                          "quarantined": 0, "users": 2, "reasons": {}}
    assert set(res.turns) == {"maya", "tomas"}
    assert res.turns["maya"].num_rows == 36 and res.turns["tomas"].num_rows == 34
    for user, table in res.turns.items():
        assert table.schema == turns_schema.SCHEMA
        assert table.schema.metadata == turns_schema.SCHEMA.metadata
        assert table["turn_index"].to_pylist() == list(range(table.num_rows))
        assert set(table["user"].to_pylist()) == {user}
        assert len(set(table["turn_id"].to_pylist())) == table.num_rows
        assert all(ts and ts.startswith("2024-") for ts in table["timestamp"].to_pylist())
        assert len(set(table["session"].to_pylist())) == 3
    texts = " ".join(res.turns["maya"]["text"].to_pylist() + res.turns["tomas"]["text"].to_pylist())
    assert "last week" in texts and "yesterday" in texts


def test_malformed_records_are_quarantined_and_good_ones_kept(tmp_path):
    limits = LogLimits(max_text_chars=200)
    good = [_good("ana", "t1"), _good("ana", 2, "My sister Lola lives in Cádiz."),
            _good("bo", "t1", "I drive a red Fiat 500.", timestamp=None),
            _good("bo", "t2", "Back from Oslo.", timestamp="2024-06-01")]
    bad_lines = [
        (b"\xff\xfe not utf-8 at all\n", "undecodable_bytes"),
        (b'{"user": "ana", "session": "1", \n', "invalid_json"),
        (b"[1, 2, 3]\n", "not_an_object"),
        (_line(**{k: v for k, v in _good("ana", "t9").items() if k != "text"}), "missing_field"),
        (_line(**{k: v for k, v in _good("ana", "t8").items() if k != "timestamp"}),
         "missing_field"),
        (_line(**_good("ana", "t3", text=42)), "wrong_type"),
        (_line(**_good("ana", True)), "wrong_type"),
        (_line(**_good("ana", "t4", text="   ")), "empty_text"),
        (_line(**_good("ana", "t5", text="x" * 201)), "oversized_text"),
        (_line(**_good("ana", "t6", timestamp="last tuesday")), "bad_timestamp"),
        (_line(**_good("../etc", "t7")), "bad_user"),
        (_line(**_good("ana", "t1", text="a retried duplicate")), "duplicate_turn_id"),
    ]
    data = _line(**good[0]) + _line(**good[1]) + b"\n"  # a blank line is not a record
    for line, _ in bad_lines[:6]:
        data += line
    data += _line(**good[2])
    for line, _ in bad_lines[6:]:
        data += line
    data += _line(**good[3])
    log = tmp_path / "log.jsonl"
    log.write_bytes(data)
    quarantine = tmp_path / "quarantine.jsonl"

    res = read_logs(str(log), quarantine_uri=str(quarantine), limits=limits)

    assert res.records_read == len(good) + len(bad_lines)
    assert res.turns_kept == len(good)
    assert len(res.quarantined) == len(bad_lines)
    assert res.reasons == Counter(reason for _, reason in bad_lines)
    assert res.turns["ana"]["turn_id"].to_pylist() == ["t1", "2"]
    assert res.turns["ana"]["text"].to_pylist()[0] == "I have a cat named Pixel."
    assert res.turns["bo"]["timestamp"].to_pylist() == [None, "2024-06-01"]

    lines = [json.loads(x) for x in quarantine.read_text(encoding="utf-8").splitlines()]
    assert [q["reason"] for q in lines] == [reason for _, reason in bad_lines]
    assert all(q["source"].endswith("log.jsonl") and q["location"].startswith("line ")
               and q["detail"] for q in lines)
    assert lines[0]["raw"].startswith("\\xff\\xfe")  # undecodable bytes kept, escaped
    assert lines[1]["raw"].startswith('{"user": "ana"')  # unparseable line kept as text
    assert lines[-1]["raw"]["text"] == "a retried duplicate"  # parsed record kept as is


def test_fsspec_uris_globs_and_errors(tmp_path):
    fs = fsspec.filesystem("memory")
    fs.pipe("/logs/a.jsonl", _line(**_good("ana", "t1")))
    fs.pipe("/logs/b.jsonl", _line(**_good("ana", "t2")) + b"oops\n")
    res = read_logs("memory://logs/*.jsonl", quarantine_uri="memory://q/quarantine.jsonl")
    assert res.turns["ana"]["turn_id"].to_pylist() == ["t1", "t2"]
    assert len(res.sources) == 2 and res.counts["quarantined"] == 1
    assert json.loads(fs.cat("/q/quarantine.jsonl"))["reason"] == "invalid_json"
    with pytest.raises(LogError):
        read_logs(str(tmp_path / "missing.jsonl"))
    with pytest.raises(LogError):
        read_logs(str(tmp_path / "*.jsonl"))


def _locomo_doc() -> dict:
    """A tiny conversation in LoCoMo's format (project-made content)."""
    return {
        "speaker_a": "Ines", "speaker_b": "Karl",
        "session_1_date_time": "1:56 pm on 8 May, 2023",
        "session_1": [
            {"speaker": "Ines", "dia_id": "D1:1", "text": "I adopted a tabby cat called Miso."},
            {"speaker": "Karl", "dia_id": "D1:2", "text": "Look at my garden!",
             "img_url": ["http://example.invalid/x.jpg"], "blip_caption": "a photo of tomatoes"},
            {"speaker": "Ines", "dia_id": "D1:3"},
        ],
        "session_2_date_time": "9:00 am on 15 May, 2023",
        "session_2": [{"speaker": "Karl", "dia_id": "D2:1", "text": "We went hiking last week."}],
        "session_3_date_time": "9:00 am on 1 June, 2023",  # a date without turns
        "qa": [{"question": "q", "answer": "a", "evidence": ["D1:1"], "category": 4}],
    }


def test_locomo_format(tmp_path):
    path = tmp_path / "conv-x.json"
    path.write_text(json.dumps(_locomo_doc()))
    res = read_logs(str(path))
    assert set(res.turns) == {"conv-x"}
    t = res.turns["conv-x"]
    assert t["turn_id"].to_pylist() == ["D1:1", "D1:2", "D2:1"]
    assert t["session"].to_pylist() == ["1", "1", "2"]
    assert t["timestamp"].to_pylist() == ["2023-05-08T13:56:00", "2023-05-08T13:56:00",
                                          "2023-05-15T09:00:00"]
    assert t["text"].to_pylist()[1] == "Look at my garden! [shared a photo: a photo of tomatoes]"
    assert [(q.location, q.reason) for q in res.quarantined] == [("session_1[2]", "missing_field")]
    # the original release's layout: a list of samples with sample_id
    listed = tmp_path / "all.json"
    listed.write_text(json.dumps([{"sample_id": "s1", "conversation": _locomo_doc()}]))
    assert set(read_logs(str(listed)).turns) == {"s1"}
    assert set(read_logs(str(path), user="ines").turns) == {"ines"}


def test_turns_hash_is_canonical(tmp_path):
    doc = _locomo_doc()
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    from_locomo = read_logs(str(path), user="u").turns["u"]
    # the same turns written as native JSONL hash the same
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_bytes(b"".join(_line(**{
        "user": r["user"], "session": r["session"], "turn": r["turn_id"], "speaker": r["speaker"],
        "text": r["text"], "timestamp": r["timestamp"]}) for r in from_locomo.to_pylist()))
    from_jsonl = read_logs(str(jsonl)).turns["u"]
    assert turns_hash(from_locomo) == turns_hash(from_jsonl)
    assert turns_hash(from_jsonl) == read_logs(str(jsonl)).turns_hashes()["u"]
    doc["session_2"][0]["text"] = "We went hiking two weeks ago."
    path.write_text(json.dumps(doc))
    assert turns_hash(read_logs(str(path), user="u").turns["u"]) != turns_hash(from_locomo)


def _hostile_lines() -> list[tuple[bytes, str, str]]:
    """(line, reason, words of the detail) for lines that crashed ingestion before."""
    good = _good("ana", "t1")
    big_int = json.dumps(good).replace('"t1"', "9" * 5000).encode() + b"\n"
    return [
        (b"[" * 200_000 + b"]" * 200_000 + b"\n", "invalid_json", "nested too deeply"),
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"\n", "invalid_json", "nested too deeply"),
        (big_int, "invalid_json", "digits"),
        (_line(**_good("ana", "t2", speaker={"nested": [[["x"]]]})), "wrong_type", "speaker"),
        (_line(**_good("ana", "t3", text=[[[[["deep"]]]]])), "wrong_type", "text"),
        (b'"just a string"\n', "not_an_object", "str"),
        (b"null\n", "not_an_object", "NoneType"),
    ]


def test_hostile_lines_are_quarantined_and_reading_goes_on(tmp_path):
    hostile = _hostile_lines()
    data = _line(**_good("ana", "t0"))
    for line, _, _ in hostile:
        data += line + _line(**_good("bo", f"after-{len(data)}"))
    log = tmp_path / "hostile.jsonl"
    log.write_bytes(data)
    quarantine = tmp_path / "q.jsonl"
    res = read_logs(str(log), quarantine_uri=str(quarantine))
    assert res.turns["ana"].num_rows == 1 and res.turns["bo"].num_rows == len(hostile)
    records = [json.loads(x) for x in quarantine.read_text(encoding="utf-8").splitlines()]
    assert [(r["reason"], r["location"]) for r in records] == [
        (reason, f"line {2 + 2 * i}") for i, (_, reason, _) in enumerate(hostile)]
    for r, (_, _, words) in zip(records, hostile):
        assert words in r["detail"], r["detail"]


def test_hostile_locomo_files_are_quarantined(tmp_path):
    good = {"sample_id": "ok", "conversation": _locomo_doc()}
    cases = {
        "conv-list.json": ([{"sample_id": "a", "conversation": [1, 2]}, good], "wrong_type"),
        "conv-number.json": ([{"sample_id": "b", "conversation": 7}, good], "wrong_type"),
        "conv-string.json": ([{"sample_id": "c", "conversation": "hi"}, good], "wrong_type"),
        "id-object.json": ([{"sample_id": {"x": 1}, "conversation": _locomo_doc()}, good],
                           "wrong_type"),
        "session-digits.json": ([{"sample_id": "d", "conversation": {
            "session_" + "9" * 5000: [{"speaker": "A", "dia_id": "D1:1", "text": "hi"}]}},
            good], None),
    }
    for name, (doc, reason) in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(doc))
        res = read_logs(str(path))
        assert set(res.turns) == {"ok"}, name  # the good sample is read all the same
        assert [q.reason for q in res.quarantined] == (
            ["missing_field"] if reason is None else [reason, "missing_field"]), name
    for name, body, reason in [("deep.json", b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
                               ("int.json", b'{"x": ' + b"1" * 5000 + b"}", "invalid_json"),
                               ("number.json", b"42", "not_an_object")]:
        path = tmp_path / name
        path.write_bytes(body)
        res = read_logs(str(path), quarantine_uri=str(tmp_path / f"{name}.q"))
        assert not res.turns and [q.reason for q in res.quarantined] == [reason], name


def test_oversized_line_is_skipped_without_being_read_whole(tmp_path):
    """A 64 MiB line against a 64 KiB limit: refused while reading, in bounded memory
    (the Python heap's peak stays far below the line), and the next line is read."""
    import tracemalloc

    log = tmp_path / "huge.jsonl"
    with open(log, "wb") as f:
        f.write(_line(**_good("ana", "t1")))
        f.write(b'{"user": "ana", "text": "')
        block = b"x" * (1 << 20)
        for _ in range(64):
            f.write(block)
        f.write(b'"}\n')
        f.write(_line(**_good("ana", "t2")))
    limits = LogLimits(max_line_bytes=64 << 10)
    tracemalloc.start()
    try:
        res = read_logs(str(log), limits=limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert res.turns["ana"]["turn_id"].to_pylist() == ["t1", "t2"]
    (q,) = res.quarantined
    assert (q.reason, q.location) == ("oversized_line", "line 2")
    assert q.detail == f"{(64 << 20) + 28} bytes > {64 << 10}"  # the whole line, counted
    assert q.raw.startswith('{"user": "ana", "text": "xxx') and len(q.raw) < 300
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB while reading a 64 MiB line"


def test_oversized_locomo_document_is_refused(tmp_path):
    path = tmp_path / "big.json"
    doc = _locomo_doc()
    doc["session_1"][0]["text"] = "y" * (2 << 20)
    path.write_text(json.dumps(doc))
    res = read_logs(str(path), limits=LogLimits(max_document_bytes=1 << 20))
    assert not res.turns and [q.reason for q in res.quarantined] == ["oversized_document"]


@pytest.mark.parametrize("user", ["bob\n", "\u202ebob", "bo\u200bb", "bob\u2028", " bob"])
def test_user_ids_with_control_or_invisible_characters_are_quarantined(tmp_path, user):
    """The one user-id rule (``inferscale.types``): a trailing newline, bidi overrides,
    zero-width characters and line separators are refused, not stored as another user."""
    log = tmp_path / "log.jsonl"
    log.write_bytes(_line(**_good("bob", "t1")) + _line(**_good(user, "t2")))
    res = read_logs(str(log), quarantine_uri=str(tmp_path / "q.jsonl"))
    assert list(res.turns) == ["bob"] and res.turns["bob"].num_rows == 1
    assert res.reasons == Counter({"bad_user": 1})


@pytest.mark.parametrize("field", ["text", "speaker", "session", "turn"])
def test_a_lone_surrogate_is_quarantined_and_the_others_read(tmp_path, field):
    """``"\\ud800"`` (valid JSON, not encodable as UTF-8) in any text field: that record is
    quarantined, every other one is read, and the quarantine file stays valid UTF-8 with
    the record's characters escaped (it reads back as the same record)."""
    bad = {**_good("ana", "t2"), field: "x\ud800y" if field != "text" else "I \udfff it"}
    log = tmp_path / "log.jsonl"
    log.write_bytes(_line(**_good("ana", "t1")) + (json.dumps(bad) + "\n").encode()
                    + _line(**_good("ana", "t3")))
    quarantine = tmp_path / "q.jsonl"
    res = read_logs(str(log), quarantine_uri=str(quarantine))
    assert res.turns["ana"]["turn_id"].to_pylist() == ["t1", "t3"]
    assert res.reasons == Counter({"invalid_unicode": 1})
    assert repr(bad[field][:3])[1:-1] in res.quarantined[0].detail  # where, and which
    (line,) = quarantine.read_bytes().decode("utf-8").splitlines()
    assert json.loads(line)["raw"] == bad and json.loads(line)["location"] == "line 2"

    doc = _locomo_doc()
    doc["session_1"][0]["speaker"] = "In\ud800es"
    doc["session_2"][0]["text"] = "\udc00"
    (tmp_path / "conv.json").write_text(json.dumps(doc))
    res = read_logs(str(tmp_path / "conv.json"), quarantine_uri=str(quarantine))
    assert res.turns["conv"]["turn_id"].to_pylist() == ["D1:2"]
    assert [(q.location, q.reason) for q in res.quarantined] == [
        ("session_1[0]", "invalid_unicode"), ("session_1[2]", "missing_field"),
        ("session_2[0]", "invalid_unicode")]
    lines = quarantine.read_bytes().decode("utf-8").splitlines()
    assert [json.loads(x)["raw"] for x in lines] == [doc["session_1"][0], doc["session_1"][2],
                                                      doc["session_2"][0]]
