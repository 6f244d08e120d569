"""The two log formats: native JSONL (one turn per line) and LoCoMo JSON.

Each reader validates every record through an :class:`~inferscale.ingest.records.Accumulator`
(see :mod:`inferscale.ingest.logs` for the formats' fields); a record that cannot be read
or validated (hostile ones included: nesting past the recursion limit, integers past
Python's digit limit, LoCoMo parts of the wrong shape) is quarantined there and reading
goes on. JSONL is read in 64 KiB chunks, so a line over ``max_line_bytes`` is refused
without ever being held whole; a LoCoMo file is read up to ``max_document_bytes``.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any, Iterator

from inferscale.ingest.records import Accumulator, LogLimits, Reject, Turn, iso_timestamp, make_turn

NATIVE_FIELDS = ("user", "session", "turn", "speaker", "text", "timestamp")
_LOCOMO_SESSION_RE = re.compile(r"^session_(\d{1,9})$")
_LOCOMO_DATE_FORMATS = ("%I:%M %p on %d %B, %Y", "%I:%M %p on %d %b, %Y", "%d %B, %Y")


def guess_format(path: str) -> str:
    return "locomo" if PurePosixPath(path).suffix.lower() == ".json" else "jsonl"


def bounded_lines(f, max_bytes: int, chunk: int = 1 << 16) -> Iterator[tuple[bytes, int]]:
    """Lines of a binary file as ``(line, length)``, read ``chunk`` bytes at a time; a
    line longer than ``max_bytes`` comes back as its first 200 bytes with its full length
    (the rest is skipped to the next newline, never buffered)."""
    buf = bytearray()
    skipping = 0  # > 0: inside an oversized line, bytes seen so far
    head = b""
    while True:
        data = f.read(chunk)
        if not data:
            break
        start = 0
        while start < len(data):
            nl = data.find(b"\n", start)
            end = len(data) if nl < 0 else nl + 1
            piece = data[start:end]
            start = end
            if skipping:
                skipping += len(piece)
            elif len(buf) + len(piece) > max_bytes:
                head = bytes((buf + piece)[:200])
                skipping = len(buf) + len(piece)
                buf.clear()
            else:
                buf += piece
            if nl >= 0:
                if skipping:
                    yield head, skipping
                    skipping = 0
                else:
                    yield bytes(buf), len(buf)
                    buf.clear()
    if skipping:
        yield head, skipping
    elif buf:
        yield bytes(buf), len(buf)


def read_jsonl(f, source: str, acc: Accumulator) -> None:
    """Read a binary JSONL file in bounded chunks (:func:`bounded_lines`)."""
    limit = acc.limits.max_line_bytes
    for lineno, (line, length) in enumerate(bounded_lines(f, limit), start=1):
        location = f"line {lineno}"
        if length > limit:
            acc.records_read += 1
            acc.reject(source, location, "oversized_line", f"{length} bytes > {limit}",
                       line[:200].decode("utf-8", "backslashreplace") + "...")
            continue
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            acc.records_read += 1
            acc.reject(source, location, "undecodable_bytes", str(exc),
                       line.decode("utf-8", "backslashreplace").rstrip("\r\n"))
            continue
        try:
            record = _parse_json(text)
        except Reject as rej:
            acc.records_read += 1
            acc.reject(source, location, rej.reason, rej.detail, text.rstrip("\r\n"))
            continue
        acc.add(source, location, record, lambda r: _native_turn(r, acc.limits))


def _parse_json(text: str) -> Any:
    """``json.loads``, every way it can fail a :class:`Reject`: syntax, nesting deeper
    than the interpreter's recursion limit, integers past Python's digit limit."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise Reject("invalid_json", str(exc)) from None
    except RecursionError:
        raise Reject("invalid_json", "nested too deeply") from None
    except ValueError as exc:  # e.g. "Exceeds the limit (4300 digits) for integer string"
        raise Reject("invalid_json", str(exc)) from None


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


def read_locomo(f, source: str, user: str | None, acc: Accumulator) -> None:
    """Read one LoCoMo file (a binary file object), refused whole over
    ``max_document_bytes`` without reading past the limit."""
    limit = acc.limits.max_document_bytes
    data = f.read(limit + 1)
    if len(data) > limit:
        acc.records_read += 1
        acc.reject(source, "file", "oversized_document", f"more than {limit} bytes",
                   data[:200].decode("utf-8", "backslashreplace") + "...")
        return
    try:
        doc = _parse_json(data.decode("utf-8"))
    except (UnicodeDecodeError, Reject) as exc:
        acc.records_read += 1
        reason = exc.reason if isinstance(exc, Reject) else "undecodable_bytes"
        acc.reject(source, "file", reason, getattr(exc, "detail", str(exc)),
                   data[:200].decode("utf-8", "backslashreplace"))
        return
    samples = doc if isinstance(doc, list) else [doc]
    stem = PurePosixPath(source).stem
    for i, sample in enumerate(samples):
        where = f"sample {i}"
        if not isinstance(sample, dict):
            acc.records_read += 1
            acc.reject(source, where, "not_an_object", "LoCoMo sample is not an object", sample)
            continue
        conv = sample.get("conversation", sample)
        who = sample.get("sample_id") or user or (stem if len(samples) == 1 else f"{stem}-{i}")
        if not isinstance(conv, dict) or not isinstance(who, (str, int)) or isinstance(who, bool):
            acc.records_read += 1
            what = (f"'conversation' must be an object, got {type(conv).__name__}"
                    if not isinstance(conv, dict) else
                    f"'sample_id' must be a string, got {type(who).__name__}")
            acc.reject(source, where, "wrong_type", what,
                       {k: v for k, v in sample.items() if k != "qa"})
            continue
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
