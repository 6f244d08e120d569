"""Property-based tests of log ingestion: arbitrary JSON values, arbitrary Unicode (lone
surrogates, bidi controls, NUL, 1 MB strings), arbitrary nesting, arbitrary bytes.
Ingestion never raises; every input record is either a turn or a quarantined record; the
kept turns are exactly the records that were not quarantined, in order; the quarantine
file is valid UTF-8, one JSON object per quarantined record."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from inferscale.ingest.formats import _LOCOMO_SESSION_RE
from inferscale.ingest.logs import read_logs

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])

HOSTILE = ["\ud800", "\udbff", "\udc00", "\udfff", "\x00", "\u202e", "\u2066", "\u200b",
           "\ufeff", "\u2028", "\n", "\r", "\\", '"', "*", "<|im_start|>", " ", "a", "é",
           "\U0001f642"]
# any code point (surrogates included: the default leaves them out), text made of the
# hostile ones, and long runs of one of them: 1 MiB and around the limits
TEXT = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=30),
    st.lists(st.sampled_from(HOSTILE), max_size=12).map("".join),
    st.builds(lambda ch, n: ch * n, st.sampled_from(HOSTILE),
              st.sampled_from([8000, 8001, 1 << 20, (1 << 20) // 6])),
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4),
    max_leaves=20)


def mostly(likely, rest=JSON):
    """``likely`` three times in four, else anything: near-valid records reach every
    check, not only the first."""
    return st.sampled_from([True, True, True, False]).flatmap(
        lambda yes: likely if yes else rest)


USERS = st.sampled_from(["ann", "bob", "*", "ann smith", "\ud800", "a/b", "x" * 129, ""])
IDS = st.sampled_from(["1", "2", "t1", "t2", "S1:1"]) | TEXT
STAMPS = st.sampled_from([None, "2024-05-02", "2024-05-02T21:15:00Z", "yesterday"]) | TEXT
NATIVE = st.fixed_dictionaries(
    {}, optional={"user": mostly(USERS), "session": mostly(IDS),
                  "turn": mostly(IDS | st.integers()), "speaker": mostly(TEXT),
                  "text": mostly(TEXT), "timestamp": mostly(STAMPS)})
NATIVE_FULL = st.fixed_dictionaries(
    {"user": mostly(USERS), "session": mostly(IDS), "turn": mostly(IDS | st.integers()),
     "speaker": mostly(TEXT), "text": mostly(TEXT), "timestamp": mostly(STAMPS)},
    optional={"extra": JSON})


def _nested(n: int, kind: str) -> bytes:
    return (b"[" * n + b"]" * n) if kind == "list" else (b'{"a":' * n + b"1" + b"}" * n)


LINE = st.one_of(
    NATIVE_FULL.map(lambda r: json.dumps(r).encode()),  # surrogates as \ud800 escapes
    NATIVE_FULL.map(lambda r: json.dumps(r, ensure_ascii=False)  # raw: invalid UTF-8
                    .encode("utf-8", "surrogatepass")),
    NATIVE.map(lambda r: json.dumps(r).encode()),
    JSON.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64).map(lambda b: b.replace(b"\n", b"")),
    st.builds(_nested, st.sampled_from([1, 50, 5000, 200_000]), st.sampled_from(["list", "dict"])),
    st.sampled_from([b"", b"   ", b"\t\r", b"1" * 5000, b"NaN", b'{"user": "ann"']),
)


def _read(path: Path, qpath: Path):
    res = read_logs(str(path), quarantine_uri=str(qpath))
    # strict UTF-8, and one record a line for any line reader (str.splitlines too)
    lines = qpath.read_bytes().decode("utf-8").splitlines()
    written = [json.loads(x) for x in lines]
    assert len(written) == len(res.quarantined)
    assert [(w["location"], w["reason"]) for w in written] \
        == [(q.location, q.reason) for q in res.quarantined]
    assert res.records_read == res.turns_kept + len(res.quarantined)
    assert res.reasons == Counter(q.reason for q in res.quarantined)
    res.turns_hashes()  # every kept turn is storable and hashable
    event("a turn kept" if res.turns_kept else "no turn kept")
    for reason in res.reasons:
        event(f"quarantined: {reason}")
    return res


@SETTINGS
@given(lines=st.lists(LINE, max_size=8), newline_at_end=st.booleans())
@example(lines=[json.dumps({"user": "ann", "session": "1", "turn": "t1", "speaker": "Ann",
                            "text": "I \ud800 bees", "timestamp": None}).encode(),
                json.dumps({"user": "ann", "session": "1", "turn": "t2", "speaker": "\udfff",
                            "text": "hi", "timestamp": None}).encode(),
                json.dumps({"user": "ann", "session": "1", "turn": "t3", "speaker": "Ann",
                            "text": "kept", "timestamp": None}).encode()],
         newline_at_end=True)
def test_jsonl_every_record_is_a_turn_or_quarantined(lines, newline_at_end):
    with tempfile.TemporaryDirectory() as tmp:
        path, qpath = Path(tmp) / "log.jsonl", Path(tmp) / "q.jsonl"
        path.write_bytes(b"\n".join(lines) + (b"\n" if newline_at_end and lines else b""))
        res = _read(path, qpath)

    records = [n for n, line in enumerate(lines, start=1) if line.strip()]  # blank: none
    assert res.records_read == len(records)
    where = [q.location for q in res.quarantined]
    assert len(set(where)) == len(where) and set(where) <= {f"line {n}" for n in records}
    # the kept turns are the other records, in order, field for field
    expected: dict[str, list[tuple]] = {}
    for n in records:
        if f"line {n}" not in where:
            r = json.loads(lines[n - 1])
            expected.setdefault(r["user"], []).append(
                (r["session"], str(r["turn"]), r["speaker"], r["text"]))
    got = {u: list(zip(*(t[c].to_pylist() for c in ("session", "turn_id", "speaker", "text"))))
           for u, t in res.turns.items()}
    assert got == expected


LOCOMO_TURN = st.one_of(
    st.fixed_dictionaries({"speaker": mostly(TEXT), "dia_id": mostly(IDS), "text": mostly(TEXT)},
                          optional={"blip_caption": mostly(TEXT)}),
    JSON)
SESSIONS = st.dictionaries(
    st.sampled_from(["session_1", "session_2", "session_10", "session_x", "session_" + "9" * 12,
                     "session_1_date_time", "session_2_date_time", "qa", "speaker_a"]) | TEXT,
    mostly(st.lists(LOCOMO_TURN, max_size=4),
           st.sampled_from(["1:56 pm on 8 May, 2023", "8 May, 2023", "soon"]) | JSON),
    max_size=5)
SAMPLE = mostly(st.fixed_dictionaries({"conversation": mostly(SESSIONS)},
                                      optional={"sample_id": mostly(USERS | st.integers()),
                                                "qa": JSON}) | SESSIONS)
DOC = st.one_of(SAMPLE, st.lists(SAMPLE, max_size=3))


def _locomo_records(doc) -> int:
    """How many records a LoCoMo document holds: a sample that is not an object, or whose
    conversation or id has the wrong type, is one; otherwise each turn of each session
    list is one, and a session that is not a list is one."""
    samples = doc if isinstance(doc, list) else [doc]
    n = 0
    for sample in samples:
        conv = sample.get("conversation", sample) if isinstance(sample, dict) else None
        who = sample.get("sample_id") or "stem" if isinstance(sample, dict) else None
        if not isinstance(conv, dict) or not isinstance(who, (str, int)) or isinstance(who, bool):
            n += 1
            continue
        for key, value in conv.items():
            if _LOCOMO_SESSION_RE.match(key):
                n += len(value) if isinstance(value, list) else 1
    return n


@SETTINGS
@given(doc=DOC)
def test_locomo_every_record_is_a_turn_or_quarantined(doc):
    with tempfile.TemporaryDirectory() as tmp:
        path, qpath = Path(tmp) / "conv.json", Path(tmp) / "q.jsonl"
        path.write_text(json.dumps(doc), encoding="ascii")  # surrogates as \ud800 escapes
        res = _read(path, qpath)
    assert res.records_read == _locomo_records(doc)
    given_turns = {(t.get("dia_id"), t.get("speaker"))
                   for s in (doc if isinstance(doc, list) else [doc]) if isinstance(s, dict)
                   for v in (s.get("conversation", s) if isinstance(s.get("conversation", s), dict)
                             else {}).values() if isinstance(v, list)
                   for t in v if isinstance(t, dict) and isinstance(t.get("speaker"), str)
                   and isinstance(t.get("dia_id"), str)}
    for table in res.turns.values():
        for tid, speaker in zip(table["turn_id"].to_pylist(), table["speaker"].to_pylist()):
            assert (tid, speaker) in given_turns
