"""The two log formats: native JSONL (one turn per line) and LoCoMo JSON.

Each reader validates every record through an :class:`~inferscale.ingest.records.Accumulator`
(see :mod:`inferscale.ingest.logs` for the formats' fields); a record that cannot be read
or validated is quarantined there and reading goes on.

Callers: :func:`inferscale.ingest.logs.read_logs`.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any

from inferscale.ingest.records import Accumulator, LogLimits, Reject, Turn, iso_timestamp, make_turn

NATIVE_FIELDS = ("user", "session", "turn", "speaker", "text", "timestamp")
_LOCOMO_SESSION_RE = re.compile(r"^session_(\d+)$")
_LOCOMO_DATE_FORMATS = ("%I:%M %p on %d %B, %Y", "%I:%M %p on %d %b, %Y", "%d %B, %Y")


def guess_format(path: str) -> str:
    return "locomo" if PurePosixPath(path).suffix.lower() == ".json" else "jsonl"


def read_jsonl(f, source: str, acc: Accumulator) -> None:
    for lineno, line in enumerate(f, start=1):
        location = f"line {lineno}"
        if not line.strip():
            continue
        if len(line) > acc.limits.max_line_bytes:
            acc.records_read += 1
            acc.reject(source, location, "oversized_line",
                       f"{len(line)} bytes > {acc.limits.max_line_bytes}",
                       line[:200].decode("utf-8", "backslashreplace") + "...")
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            acc.records_read += 1
            acc.reject(source, location, "undecodable_bytes", str(exc),
                       line.decode("utf-8", "backslashreplace").rstrip("\r\n"))
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            acc.records_read += 1
            acc.reject(source, location, "invalid_json", str(exc), text.rstrip("\r\n"))
            continue
        acc.add(source, location, record, lambda r: _native_turn(r, acc.limits))


def _native_turn(record: Any, limits: LogLimits) -> Turn:
    if not isinstance(record, dict):
        raise Reject("not_an_object", f"expected a JSON object, got {type(record).__name__}")
    for name in NATIVE_FIELDS:
        if name not in record:
            raise Reject("missing_field", f"field {name!r} is missing")
    turn = record["turn"]
    if isinstance(turn, int) and not isinstance(turn, bool):
        turn = str(turn)
    return make_turn(record["user"], record["session"], turn, record["speaker"],
                      record["text"], iso_timestamp(record["timestamp"]), limits)


def _locomo_timestamp(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise Reject("wrong_type", "session date_time must be a string")
    for fmt in _LOCOMO_DATE_FORMATS:
        try:
            return datetime.strptime(value.strip(), fmt).isoformat()
        except ValueError:
            continue
    raise Reject("bad_timestamp", f"unrecognized LoCoMo date {value!r}")


def read_locomo(data: bytes, source: str, user: str | None, acc: Accumulator) -> None:
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        acc.records_read += 1
        acc.reject(source, "file", "invalid_json", str(exc),
                   data[:200].decode("utf-8", "backslashreplace"))
        return
    samples = doc if isinstance(doc, list) else [doc]
    stem = PurePosixPath(source).stem
    for i, sample in enumerate(samples):
        if not isinstance(sample, dict):
            acc.records_read += 1
            acc.reject(source, f"sample {i}", "not_an_object", "LoCoMo sample is not an object",
                       sample)
            continue
        conv = sample.get("conversation", sample)
        who = sample.get("sample_id") or user or (stem if len(samples) == 1 else f"{stem}-{i}")
        _read_locomo_conversation(conv, str(who), source, acc)


def _read_locomo_conversation(conv: dict, user: str, source: str, acc: Accumulator) -> None:
    sessions = sorted(
        (int(m.group(1)), key) for key in conv if (m := _LOCOMO_SESSION_RE.match(key))
    )
    for n, key in sessions:
        turns = conv[key]
        if not isinstance(turns, list):
            acc.records_read += 1
            acc.reject(source, key, "wrong_type", f"{key} must be a list of turns", turns)
            continue
        try:
            ts = _locomo_timestamp(conv.get(f"{key}_date_time"))
            ts_error = None
        except Reject as rej:
            ts, ts_error = None, rej
        for j, raw in enumerate(turns):
            def build(r, n=n, ts=ts, ts_error=ts_error):
                if ts_error is not None:
                    raise ts_error
                if not isinstance(r, dict):
                    raise Reject("not_an_object", "LoCoMo turn is not an object")
                for name in ("speaker", "dia_id", "text"):
                    if name not in r:
                        raise Reject("missing_field", f"field {name!r} is missing")
                text = r["text"]
                caption = r.get("blip_caption")
                if isinstance(text, str) and isinstance(caption, str) and caption.strip():
                    text = f"{text} [shared a photo: {caption.strip()}]"
                return make_turn(user, str(n), r["dia_id"], r["speaker"], text, ts, acc.limits)

            acc.add(source, f"{key}[{j}]", raw, build)
