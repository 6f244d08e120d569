"""Moving ``LATEST``: it names the publish of the newest inputs, by compare-and-swap.

Every publish carries ``inputs_at``, when its inputs were taken (the flows and
``inferscale encode`` pass the time the logs were read, ``IngestResult.read_at``; the
default is the time of the call). ``LATEST`` holds the version id and that time
(:func:`inferscale.artifacts.layout.parse_latest`) and is changed only by
compare-and-swap (:meth:`inferscale.artifacts.blobs.Blobs.swap`: a lock file locally,
``If-Match`` on the ETag on S3), so concurrent publishers cannot undo each other's
checks. A publish moves it unless it names a readable version published from later
inputs (equal times: the larger version id wins): when publishers of different inputs
race, ``LATEST`` ends on the newest inputs whatever finishes last. A ``LATEST`` naming a
version that no longer reads, or written without a time, gives way to any publish.
Readers need no lock: ``LATEST`` is replaced atomically. A rollback is a publish of the
older inputs read again (a later ``inputs_at``).
"""

from __future__ import annotations

from datetime import datetime, timezone

from inferscale.artifacts.blobs import Location
from inferscale.artifacts.layout import (
    ArtifactError, ArtifactSchemaError, CorruptArtifact, InvalidArtifactInput, latest_bytes,
    parse_latest,
)
from inferscale.artifacts.read import manifest_at


def point_latest(loc: Location, version: str, inputs_at: datetime) -> str:
    """Compare-and-swap ``LATEST`` to ``version`` unless it names ``version`` already or
    the publish of newer inputs (a later ``inputs_at``; equal times: the larger version
    id) that is still readable, or ``version``'s own manifest no longer reads (a gc
    removing it: :mod:`inferscale.artifacts.gc`, checked inside the swap). Returns the
    version LATEST names afterwards."""
    def decide(current: bytes | None) -> bytes | None:
        if current is not None:
            try:
                cur, cur_at = parse_latest(loc.latest, current)
            except CorruptArtifact:
                cur, cur_at = None, None  # a damaged LATEST is replaced
            if cur == version:
                return None  # already named: an unchanged publish writes nothing
            if cur is not None and cur_at is not None and (cur_at, cur) > (inputs_at, version):
                if readable(loc, cur):
                    return None
        if not readable(loc, version):
            return None  # being removed by a gc: the caller writes it again or gives up
        return latest_bytes(version, inputs_at)

    final = loc.blobs.swap(loc.latest, decide)
    return parse_latest(loc.latest, final)[0] if final is not None else version


def readable(loc: Location, version: str) -> bool:
    """Whether ``version``'s manifest reads (a LATEST naming a removed or damaged version
    gives way to any complete one)."""
    try:
        manifest_at(loc, version)
    except ArtifactSchemaError:
        return True  # written by a newer InferScale: valid, not ours to displace
    except ArtifactError:
        return False
    return True


def inputs_time(when: datetime | None) -> datetime:
    """``inputs_at`` checked and in UTC (``None``: now)."""
    if when is None:
        return datetime.now(timezone.utc)
    if not isinstance(when, datetime) or when.tzinfo is None:
        raise InvalidArtifactInput(f"inputs_at must be a timezone-aware datetime, got {when!r}")
    return when.astimezone(timezone.utc)
