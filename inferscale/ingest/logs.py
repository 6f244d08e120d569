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

Every record is validated; a bad one (undecodable bytes, invalid JSON, JSON nested too
deep or with integers past Python's digit limit, missing field, wrong type, empty or
oversized text, bad timestamp, duplicate turn id, a LoCoMo file whose parts have the
wrong shape, anything else a record can get wrong) goes to the quarantine JSONL file as
``{"source", "location", "reason", "detail", "raw"}`` and reading goes on: one bad
record never stops the others. JSONL is read in bounded chunks: a line over
``max_line_bytes`` is skipped to its newline without being held in memory (its first
200 bytes are kept for the quarantine record); a LoCoMo file over ``max_document_bytes``
is refused the same way. :func:`read_logs` returns one Arrow table per user
(``storage_schemas.turns.SCHEMA``), the quarantined records and the counts.

:func:`turns_hash` is the content hash of one user's validated turns (canonical JSON of
every row, in order): it identifies the log's version in artifact lineage.

Validation is :mod:`inferscale.ingest.records`, the two readers :mod:`inferscale.ingest.formats`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

import pyarrow as pa

from inferscale.ingest.formats import guess_format, read_jsonl, read_locomo
from inferscale.ingest.records import Accumulator, LogLimits, Quarantined, Turn
from storage_schemas import turns as turns_schema

Format = Literal["auto", "jsonl", "locomo"]


class LogError(ValueError):
    """A log that cannot be read at all (missing file, unknown format)."""


@dataclass
class IngestResult:
    """What :func:`read_logs` produced."""

    turns: dict[str, pa.Table]  # user -> turns table, rows in conversation order
    quarantined: list[Quarantined]
    records_read: int
    sources: list[str]
    quarantine_uri: str | None = None
    reasons: Counter = field(default_factory=Counter)
    # when reading began: the inputs' time, which publish compares (``inputs_at``)
    read_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

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


# ------------------------------------------------------------------------------ public API


def sample_conversations() -> Path:
    """The project's own sample conversation (native JSONL, 2 users)."""
    return Path(str(resources.files("inferscale") / "samples" / "conversations.jsonl"))


# (user, question) pairs the sample conversation answers (the demo asks them)
SAMPLE_QUESTIONS = [
    ("maya", "What is my dog's name?"),
    ("maya", "Who did I go to Lisbon with?"),
    ("maya", "Where do I work?"),
    ("tomas", "Which marathon am I training for?"),
    ("tomas", "What is my cat called?"),
]


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

    read_at = datetime.now(timezone.utc)  # before the first byte: the inputs' time
    opts = storage_options or {}
    files = []
    for uri in [uris] if isinstance(uris, str) else list(uris):
        matched = fsspec.open_files(uri, "rb", **opts)
        if not matched:
            raise LogError(f"no log matches {uri!r}")
        files.extend(matched)
    acc = Accumulator(limits)
    sources: list[str] = []
    for of in files:
        source = of.full_name if hasattr(of, "full_name") else of.path
        sources.append(source)
        kind = fmt if fmt != "auto" else guess_format(of.path)
        try:
            with of as f:
                if kind == "locomo":
                    read_locomo(f, source, user, acc)
                else:
                    read_jsonl(f, source, acc)
        except (FileNotFoundError, PermissionError, IsADirectoryError) as exc:
            raise LogError(f"cannot read {source}: {exc}") from exc

    result = IngestResult(
        turns={u: _to_table(ts) for u, ts in acc.turns.items()},
        quarantined=acc.quarantined,
        records_read=acc.records_read,
        sources=sources,
        quarantine_uri=quarantine_uri,
        reasons=Counter(q.reason for q in acc.quarantined),
        read_at=read_at,
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


def _to_table(turns: list[Turn]) -> pa.Table:
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
