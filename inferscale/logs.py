"""Conversation logs -> validated turn tables, with bad records quarantined.

Two input formats, read from any fsspec URI (local path, ``file://``, ``s3://`` ...; globs
expand):

- **native JSONL** (``.jsonl`` / ``.ndjson``): one turn per line, an object with
  ``user``, ``session``, ``turn`` (the turn id, unique within the user; string or
  integer), ``speaker``, ``text`` and ``timestamp`` (ISO-8601 date or date-time of the
  session, or null). A user's lines appear in conversation order; that order is the
  ``turn_index``. See ``docs/facts.md``.
- **LoCoMo JSON** (``.json``): the LoCoMo authors' format, ``speaker_a``/``speaker_b``,
  ``session_N`` lists of ``{speaker, dia_id, text}`` and ``session_N_date_time``; either one
  conversation per file or the original release's list of ``{sample_id, conversation}``.
  The user is ``sample_id``, else the ``user`` argument, else the file's stem. A shared
  photo's ``blip_caption`` is appended to the turn's text.

Every record is validated; a bad one (undecodable bytes, invalid JSON, missing field,
wrong type, empty or oversized text, bad timestamp, duplicate turn id) goes to the
quarantine JSONL file as ``{"source", "location", "reason", "detail", "raw"}`` and
reading goes on. :func:`read_logs` returns one Arrow table per user
(``storage_schemas.turns.SCHEMA``), the quarantined records and the counts.

:func:`turns_hash` is the content hash of one user's validated turns (canonical JSON of
every row, in order): it identifies the log's version in artifact lineage.

Callers: the ingestion task of the encode flow, the CLI, benchmarks (LoCoMo), tests.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import date, datetime
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Iterator, Literal, Sequence

import pyarrow as pa

from inferscale.user_ids import user_id_problem
from storage_schemas import turns as turns_schema

NATIVE_FIELDS = ("user", "session", "turn", "speaker", "text", "timestamp")
_LOCOMO_SESSION_RE = re.compile(r"^session_(\d+)$")
_LOCOMO_DATE_FORMATS = ("%I:%M %p on %d %B, %Y", "%I:%M %p on %d %b, %Y", "%d %B, %Y")

Format = Literal["auto", "jsonl", "locomo"]


class LogError(ValueError):
    """A log that cannot be read at all (missing file, unknown format)."""


@dataclass(frozen=True)
class LogLimits:
    """Validation limits; frozen, checked at construction."""

    max_text_chars: int = 8000
    max_line_bytes: int = 1 << 20
    max_id_chars: int = 128

    def __post_init__(self) -> None:
        if min(self.max_text_chars, self.max_line_bytes, self.max_id_chars) < 1:
            raise ValueError(f"LogLimits must be positive: {self}")


@dataclass(frozen=True)
class Quarantined:
    """One rejected record: where it was, why, and the record or line itself."""

    source: str
    location: str
    reason: str  # a short code: missing_field, wrong_type, empty_text, ...
    detail: str
    raw: Any  # the parsed record, or the raw line as text when it did not parse

    def to_json(self) -> str:
        return json.dumps(
            {"source": self.source, "location": self.location, "reason": self.reason,
             "detail": self.detail, "raw": self.raw},
            ensure_ascii=False, default=str,
        )


@dataclass
class IngestResult:
    """What :func:`read_logs` produced."""

    turns: dict[str, pa.Table]  # user -> turns table, rows in conversation order
    quarantined: list[Quarantined]
    records_read: int
    sources: list[str]
    quarantine_uri: str | None = None
    reasons: Counter = field(default_factory=Counter)

    @property
    def turns_kept(self) -> int:
        return sum(t.num_rows for t in self.turns.values())

    @property
    def counts(self) -> dict[str, Any]:
        return {
            "sources": len(self.sources),
            "records_read": self.records_read,
            "turns_kept": self.turns_kept,
            "quarantined": len(self.quarantined),
            "users": len(self.turns),
            "reasons": dict(sorted(self.reasons.items())),
        }

    def turns_hashes(self) -> dict[str, str]:
        return {user: turns_hash(t) for user, t in self.turns.items()}


class _Reject(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class _Turn:
    user: str
    session: str
    turn_id: str
    speaker: str
    text: str
    timestamp: str | None


# ------------------------------------------------------------------------------ public API


def sample_conversations() -> Path:
    """The project's own sample conversation (native JSONL, 2 users)."""
    return Path(str(resources.files("inferscale") / "samples" / "conversations.jsonl"))


def read_logs(
    uris: str | Sequence[str],
    *,
    quarantine_uri: str | None = None,
    storage_options: dict | None = None,
    fmt: Format = "auto",
    user: str | None = None,
    limits: LogLimits = LogLimits(),
) -> IngestResult:
    """Read, validate and split conversation logs by user.

    ``uris``: one or more fsspec URIs or globs, read in the given order (a glob's matches
    in sorted order); each must match at least one file. ``fmt``: ``"auto"`` picks by extension (``.json`` = LoCoMo, else
    JSONL). ``user``: the user of LoCoMo files that carry no ``sample_id``.
    ``quarantine_uri``: where rejected records are written (JSONL); none = kept only in
    the result. Raises :class:`LogError` when a source cannot be opened or no source
    matches.
    """
    import fsspec

    opts = storage_options or {}
    files = []
    for uri in [uris] if isinstance(uris, str) else list(uris):
        matched = fsspec.open_files(uri, "rb", **opts)
        if not matched:
            raise LogError(f"no log matches {uri!r}")
        files.extend(matched)
    acc = _Accumulator(limits)
    sources: list[str] = []
    for of in files:
        source = of.full_name if hasattr(of, "full_name") else of.path
        sources.append(source)
        kind = fmt if fmt != "auto" else _guess_format(of.path)
        try:
            with of as f:
                if kind == "locomo":
                    _read_locomo(f.read(), source, user, acc)
                else:
                    _read_jsonl(f, source, acc)
        except (FileNotFoundError, PermissionError, IsADirectoryError) as exc:
            raise LogError(f"cannot read {source}: {exc}") from exc

    result = IngestResult(
        turns={u: _to_table(ts) for u, ts in acc.turns.items()},
        quarantined=acc.quarantined,
        records_read=acc.records_read,
        sources=sources,
        quarantine_uri=quarantine_uri,
        reasons=Counter(q.reason for q in acc.quarantined),
    )
    if quarantine_uri is not None:
        write_quarantine(acc.quarantined, quarantine_uri, storage_options=opts)
    return result


def write_quarantine(records: Iterable[Quarantined], uri: str, *,
                     storage_options: dict | None = None) -> None:
    """Write quarantined records as JSONL to ``uri`` (replaced; empty file when none)."""
    import fsspec

    with fsspec.open(uri, "w", encoding="utf-8", **(storage_options or {})) as f:
        for q in records:
            f.write(q.to_json() + "\n")


def turns_hash(table: pa.Table) -> str:
    """Content hash of a turns table: sha256 of its rows as canonical JSON, in row order.

    Only the data counts (not the Arrow layout or metadata), so the same validated turns
    read from JSONL, LoCoMo or a stored table hash the same.
    """
    h = hashlib.sha256(b"inferscale.turns.v1\n")
    names = [f.name for f in turns_schema.SCHEMA]
    for row in table.select(names).to_pylist():
        h.update(json.dumps([row[n] for n in names], ensure_ascii=False,
                            separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


# ------------------------------------------------------------------------------- internals


class _Accumulator:
    """Validated turns per user (with duplicate detection) and quarantined records."""

    def __init__(self, limits: LogLimits):
        self.limits = limits
        self.turns: dict[str, list[_Turn]] = {}
        self.seen: dict[str, set[str]] = {}
        self.quarantined: list[Quarantined] = []
        self.records_read = 0

    def reject(self, source: str, location: str, reason: str, detail: str, raw: Any) -> None:
        self.quarantined.append(Quarantined(source, location, reason, detail, raw))

    def add(self, source: str, location: str, raw: Any, build) -> None:
        """Validate one record with ``build(raw) -> _Turn``; keep it or quarantine it."""
        self.records_read += 1
        try:
            turn = build(raw)
            if turn.turn_id in self.seen.setdefault(turn.user, set()):
                raise _Reject("duplicate_turn_id",
                              f"turn id {turn.turn_id!r} already seen for user {turn.user!r}")
        except _Reject as rej:
            self.reject(source, location, rej.reason, rej.detail, raw)
            return
        self.seen[turn.user].add(turn.turn_id)
        self.turns.setdefault(turn.user, []).append(turn)


def _guess_format(path: str) -> str:
    return "locomo" if PurePosixPath(path).suffix.lower() == ".json" else "jsonl"


def _read_jsonl(f, source: str, acc: _Accumulator) -> None:
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


def _native_turn(record: Any, limits: LogLimits) -> _Turn:
    if not isinstance(record, dict):
        raise _Reject("not_an_object", f"expected a JSON object, got {type(record).__name__}")
    for name in NATIVE_FIELDS:
        if name not in record:
            raise _Reject("missing_field", f"field {name!r} is missing")
    turn = record["turn"]
    if isinstance(turn, int) and not isinstance(turn, bool):
        turn = str(turn)
    return _make_turn(record["user"], record["session"], turn, record["speaker"],
                      record["text"], _timestamp(record["timestamp"]), limits)


def _make_turn(user: Any, session: Any, turn_id: Any, speaker: Any, text: Any,
               timestamp: str | None, limits: LogLimits) -> _Turn:
    for name, value in (("user", user), ("session", session), ("turn", turn_id),
                        ("speaker", speaker), ("text", text)):
        if not isinstance(value, str):
            raise _Reject("wrong_type", f"field {name!r} must be a string, got "
                                        f"{type(value).__name__}")
    for name, value in (("session", session), ("turn", turn_id), ("speaker", speaker)):
        if not value.strip() or len(value) > limits.max_id_chars:
            raise _Reject("bad_id", f"field {name!r} must be 1..{limits.max_id_chars} "
                                    f"characters, not blank")
    problem = user_id_problem(user)
    if problem is not None:
        raise _Reject("bad_user", f"user {user[:40]!r} {problem}")
    if not text.strip():
        raise _Reject("empty_text", "text is empty or blank")
    if len(text) > limits.max_text_chars:
        raise _Reject("oversized_text", f"{len(text)} characters > {limits.max_text_chars}")
    return _Turn(user, session, turn_id, speaker, text, timestamp)


def _timestamp(value: Any) -> str | None:
    """ISO-8601 date or date-time (or null) -> normalized ISO string."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise _Reject("wrong_type", f"field 'timestamp' must be an ISO-8601 string or null, "
                                    f"got {type(value).__name__}")
    try:
        if len(value) == 10:
            return date.fromisoformat(value).isoformat()
        return datetime.fromisoformat(value.replace("Z", "+00:00")).isoformat()
    except ValueError as exc:
        raise _Reject("bad_timestamp", f"{value!r} is not ISO-8601: {exc}") from None


def _locomo_timestamp(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _Reject("wrong_type", "session date_time must be a string")
    for fmt in _LOCOMO_DATE_FORMATS:
        try:
            return datetime.strptime(value.strip(), fmt).isoformat()
        except ValueError:
            continue
    raise _Reject("bad_timestamp", f"unrecognized LoCoMo date {value!r}")


def _read_locomo(data: bytes, source: str, user: str | None, acc: _Accumulator) -> None:
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


def _read_locomo_conversation(conv: dict, user: str, source: str, acc: _Accumulator) -> None:
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
        except _Reject as rej:
            ts, ts_error = None, rej
        for j, raw in enumerate(turns):
            def build(r, n=n, ts=ts, ts_error=ts_error):
                if ts_error is not None:
                    raise ts_error
                if not isinstance(r, dict):
                    raise _Reject("not_an_object", "LoCoMo turn is not an object")
                for name in ("speaker", "dia_id", "text"):
                    if name not in r:
                        raise _Reject("missing_field", f"field {name!r} is missing")
                text = r["text"]
                caption = r.get("blip_caption")
                if isinstance(text, str) and isinstance(caption, str) and caption.strip():
                    text = f"{text} [shared a photo: {caption.strip()}]"
                return _make_turn(user, str(n), r["dia_id"], r["speaker"], text, ts, acc.limits)

            acc.add(source, f"{key}[{j}]", raw, build)


def _to_table(turns: list[_Turn]) -> pa.Table:
    cols: dict[str, list] = {f.name: [] for f in turns_schema.SCHEMA}
    for i, t in enumerate(turns):
        cols["user"].append(t.user)
        cols["session"].append(t.session)
        cols["turn_id"].append(t.turn_id)
        cols["turn_index"].append(i)
        cols["speaker"].append(t.speaker)
        cols["text"].append(t.text)
        cols["timestamp"].append(t.timestamp)
    return pa.table(cols, schema=turns_schema.SCHEMA)


def iter_turns(table: pa.Table) -> Iterator[dict]:
    """Rows of a turns table as dicts, in conversation order."""
    yield from table.sort_by("turn_index").to_pylist()
