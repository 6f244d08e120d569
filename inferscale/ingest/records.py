"""One log record -> a validated turn, or a quarantined record with the reason.

:class:`Accumulator` collects a source's validated turns per user (rejecting duplicate
turn ids) and its :class:`Quarantined` records; the format readers
(:mod:`inferscale.ingest.formats`) feed it one record at a time through
:meth:`Accumulator.add`, whose ``build`` raises :class:`Reject` for a bad record. User ids
follow the one rule of :func:`inferscale.types.check_user_id`; the other ids (session,
turn, speaker) are any non-blank text up to the same length. Every text field must be
encodable as UTF-8: JSON can carry a lone surrogate (``"\\ud800"``), which no Arrow
table or UTF-8 file can hold, so such a record is quarantined (``invalid_unicode``)
rather than stopping the table it would have joined. A quarantined record is written as
valid UTF-8 whatever it holds, one line per record: lone surrogates (and U+0085,
U+2028, U+2029, which some line readers split on) become JSON ``\\uXXXX`` escapes, which
read back as the same record.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

from inferscale.types import MAX_ID_CHARS, user_id_problem


@dataclass(frozen=True)
class LogLimits:
    """Validation limits; frozen, checked at construction."""

    max_text_chars: int = 8000
    max_line_bytes: int = 1 << 20  # a JSONL line
    max_document_bytes: int = 256 << 20  # a LoCoMo file (one JSON document)

    def __post_init__(self) -> None:
        if min(self.max_text_chars, self.max_line_bytes, self.max_document_bytes) < 1:
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
        """One JSON line, always valid UTF-8 and one line (see the module docstring)."""
        body = {"source": self.source, "location": self.location, "reason": self.reason,
                "detail": self.detail, "raw": self.raw}
        try:
            line = json.dumps(body, ensure_ascii=False, default=str)
        except (ValueError, TypeError, RecursionError):  # a raw record JSON cannot hold
            body["raw"] = _preview(self.raw)
            line = json.dumps(body, ensure_ascii=False)
        # outside strings JSON is ASCII, so these are inside one: escape them there
        return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", line)


_SURROGATE = re.compile("[\ud800-\udfff]")
# lone surrogates (not UTF-8), and the line breaks JSON leaves raw that some line readers
# (Python's str.splitlines) split on: one record stays one line
_UNSAFE = re.compile("[\ud800-\udfff\x85\u2028\u2029]")


def _preview(raw: Any, limit: int = 2000) -> str:
    """A record that JSON cannot hold again (nested too deeply...), as bounded text."""
    if not isinstance(raw, str):
        try:
            raw = repr(raw)
        except (RecursionError, ValueError):
            raw = f"<a {type(raw).__name__} too deep or too large to show>"
    return raw if len(raw) <= limit else raw[:limit] + "..."


class Reject(Exception):
    """Why one record is refused: a short ``reason`` code and a ``detail``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class Turn:
    """A validated turn, before it becomes a row of the turns table."""

    user: str
    session: str
    turn_id: str
    speaker: str
    text: str
    timestamp: str | None


class Accumulator:
    """Validated turns per user (with duplicate detection) and quarantined records."""

    def __init__(self, limits: LogLimits):
        self.limits = limits
        self.turns: dict[str, list[Turn]] = {}
        self.seen: dict[str, set[str]] = {}
        self.quarantined: list[Quarantined] = []
        self.records_read = 0

    def reject(self, source: str, location: str, reason: str, detail: str, raw: Any) -> None:
        self.quarantined.append(Quarantined(source, location, reason, detail, raw))

    def add(self, source: str, location: str, raw: Any, build) -> None:
        """Validate one record with ``build(raw) -> Turn``; keep it or quarantine it
        (whatever ``build`` raises: a malformed record never stops the others)."""
        self.records_read += 1
        try:
            turn = build(raw)
            if turn.turn_id in self.seen.setdefault(turn.user, set()):
                raise Reject("duplicate_turn_id",
                              f"turn id {turn.turn_id!r} already seen for user {turn.user!r}")
        except Reject as rej:
            self.reject(source, location, rej.reason, rej.detail, raw)
            return
        except Exception as exc:  # noqa: BLE001 - any malformed shape, RecursionError too
            self.reject(source, location, "malformed_record", f"{type(exc).__name__}: {exc}",
                        raw)
            return
        self.seen[turn.user].add(turn.turn_id)
        self.turns.setdefault(turn.user, []).append(turn)


def make_turn(user: Any, session: Any, turn_id: Any, speaker: Any, text: Any,
               timestamp: str | None, limits: LogLimits) -> Turn:
    for name, value in (("user", user), ("session", session), ("turn", turn_id),
                        ("speaker", speaker), ("text", text)):
        if not isinstance(value, str):
            raise Reject("wrong_type", f"field {name!r} must be a string, got "
                                        f"{type(value).__name__}")
    for name, value in (("session", session), ("turn", turn_id), ("speaker", speaker)):
        if not value.strip() or len(value) > MAX_ID_CHARS:
            raise Reject("bad_id", f"field {name!r} must be 1..{MAX_ID_CHARS} characters, "
                                    "not blank")
    problem = user_id_problem(user)
    if problem is not None:
        raise Reject("bad_user", f"user {user[:40]!r} {problem}")
    if not text.strip():
        raise Reject("empty_text", "text is empty or blank")
    if len(text) > limits.max_text_chars:
        raise Reject("oversized_text", f"{len(text)} characters > {limits.max_text_chars}")
    for name, value in (("session", session), ("turn", turn_id), ("speaker", speaker),
                        ("text", text)):
        bad = _SURROGATE.search(value)
        if bad is not None:
            raise Reject("invalid_unicode", f"field {name!r} holds a lone surrogate "
                         f"(U+{ord(bad.group()):04X}) at character {bad.start()}, which UTF-8 "
                         f"cannot encode: {value[:40]!r}")
    return Turn(user, session, turn_id, speaker, text, timestamp)


def iso_timestamp(value: Any) -> str | None:
    """ISO-8601 date or date-time (or null) -> normalized ISO string."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise Reject("wrong_type", f"field 'timestamp' must be an ISO-8601 string or null, "
                                    f"got {type(value).__name__}")
    try:
        if len(value) == 10:
            return date.fromisoformat(value).isoformat()
        return datetime.fromisoformat(value.replace("Z", "+00:00")).isoformat()
    except ValueError as exc:
        raise Reject("bad_timestamp", f"{value!r} is not ISO-8601: {exc}") from None
