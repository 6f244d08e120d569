"""Garbage collection of old and unfinished versions of one (user, model).

gc never removes a version that ``LATEST`` names, whatever publish or rollback runs at
the same time. Its decision is committed by a compare-and-swap of ``LATEST`` itself
(:func:`_fence`): inside it, gc reads which version ``LATEST`` names, removes the
manifests of the versions it is about to delete (so they stop being readable) and
re-stamps ``LATEST`` (same version, same ``inputs_at``, a new ``gc`` nonce), a write
that succeeds only if nobody moved ``LATEST`` since it was read. Moving ``LATEST``
(:func:`inferscale.artifacts.latest.point_latest`) is a compare-and-swap too, and it
refuses a version whose manifest does not read. So either the move lands first, and gc
sees it and keeps that version, or gc's stamp lands first, and the move finds the
manifest gone (a publish then writes the version again under new file names, a
rollback by hand is refused). A fence that loses the race puts the manifests back and
decides again. Only then are files deleted, and only by name: the files the removed
manifest listed and files older than ``stale_after_s``, never a whole folder, so a
publish writing the same version again at that moment keeps its own (young) files.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from inferscale.artifacts import fact_table
from inferscale.artifacts.blobs import Location
from inferscale.artifacts.layout import (
    LANCE_DIR, MANIFEST_FILE, VERSION_RE, ArtifactError, CorruptArtifact, MissingManifest,
    StoreConfig, parse_latest,
)
from inferscale.artifacts.read import latest_version, manifest_at
from storage_schemas.manifest import Manifest

log = logging.getLogger(__name__)


def gc(store: StoreConfig, user: str, model_fp: str, keep: int, *,
       stale_after_s: float = 3600.0) -> list[str]:
    """Keep the newest ``keep`` complete versions (by creation time) and the one LATEST
    names; remove the rest. Returns the removed version ids.

    Unfinished uploads are removed only once untouched for ``stale_after_s``: a version
    folder without a manifest whose newest file (temporary names included) and, on S3,
    newest multipart upload in progress (started or last given a part) are older than
    that; and, inside kept versions, files the manifest does not reference (a racing
    publisher's or a repaired version's files, temporary names) older than that. Younger
    ones may be a publish in progress. Damaged versions are left for a person to look at.
    With no readable ``LATEST`` nothing is removed (there is nothing to fence with).

    Publishing runs it too (``keep``), so gc races publishes and rollbacks: see the
    module docstring for why ``LATEST`` never names a version it removed.
    """
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    loc = Location(store, user, model_fp)
    try:
        latest = latest_version(store, user, model_fp)  # a first guess: the fence decides
    except CorruptArtifact:
        latest = None
    complete: list[Manifest] = []
    unfinished: list[str] = []
    for name in loc.blobs.listdir(loc.dir):
        if not VERSION_RE.fullmatch(name):
            continue
        try:
            complete.append(manifest_at(loc, name))
        except MissingManifest:
            unfinished.append(name)
        except ArtifactError as exc:
            log.warning("gc leaves damaged version alone: %s", exc)
    complete.sort(key=lambda m: (m.created, m.version))
    newest = {m.version for m in complete[-keep:]}
    old = {m.version: m for m in complete if m.version not in newest and m.version != latest}
    before = time.time() - stale_after_s
    stale = [name for name in unfinished if name != latest
             and (touched := loc.blobs.mtime(loc.version_dir(name))) is not None
             and touched < before]
    doomed = _fence(loc, old, stale)
    for m in complete:
        if m.version not in doomed:
            _remove_stray_files(loc, m, before)
    for name in doomed:
        _remove_files(loc, name, old.get(name), before)
    gone = [name for name in doomed if loc.blobs.size(loc.file(name, MANIFEST_FILE)) is None]
    if gone and LANCE_DIR in loc.blobs.listdir(loc.dir):
        fact_table.drop_tags(store, loc, gone)
    return doomed


def _fence(loc: Location, old: dict[str, Manifest], stale: list[str]) -> list[str]:
    """Commit the removal of ``old`` complete versions and ``stale`` unfinished ones by a
    compare-and-swap of ``LATEST`` (module docstring); returns those gc may now delete:
    all but the one LATEST names when the stamp landed, none without a readable LATEST.

    A complete version's manifest is removed inside the swap, before its stamp is
    written; a swap that is retried (LATEST moved) puts back the manifests of versions
    it no longer removes, and a failed one puts them all back."""
    if not old and not stale:
        return []
    unpublished: dict[str, Manifest] = {}  # manifests removed so far
    chosen: list[str] = []
    stamp: list[bytes] = []

    def decide(current: bytes | None) -> bytes | None:
        chosen.clear()
        named = _named(loc, current)
        for version, m in old.items():
            if named is None or version == named:
                if version in unpublished:
                    _restore(loc, unpublished.pop(version))
                continue
            if version not in unpublished:
                _unpublish(loc, m)
                unpublished[version] = m
            chosen.append(version)
        if named is not None:
            chosen.extend(name for name in stale if name != named
                          and loc.blobs.size(loc.file(name, MANIFEST_FILE)) is None)
        if not chosen:
            return None
        stamp[:] = [_restamp(current)]
        return stamp[0]

    try:
        final = loc.blobs.swap(loc.latest, decide)
    except BaseException:
        for m in unpublished.values():
            _restore(loc, m)
        raise
    if not chosen or not stamp or final != stamp[0]:
        for m in unpublished.values():
            _restore(loc, m)
        return []
    return list(chosen)


def _named(loc: Location, current: bytes | None) -> str | None:
    """The version ``LATEST``'s bytes name; None when absent or unreadable."""
    if current is None:
        return None
    try:
        return parse_latest(loc.latest, current)[0]
    except CorruptArtifact:
        return None


def _restamp(current: bytes) -> bytes:
    """``LATEST``'s bytes naming the same version with the same ``inputs_at``, and a new
    ``gc`` nonce: other bytes, so the conditional write of a mover that read the old ones
    fails (an S3 ETag is the content's hash: rewriting equal bytes would not change it)."""
    first, _, rest = current.partition(b"\n")
    try:
        meta = json.loads(rest)
    except ValueError:
        meta = None
    meta = meta if isinstance(meta, dict) else {}
    meta["gc"] = uuid.uuid4().hex
    return first.strip() + b"\n" + json.dumps(meta, sort_keys=True).encode() + b"\n"


def _unpublish(loc: Location, m: Manifest) -> None:
    """Make version ``m`` unreadable (its manifest goes; its files stay for now)."""
    loc.blobs.remove_file(loc.file(m.version, MANIFEST_FILE))


def _restore(loc: Location, m: Manifest) -> None:
    """Put back the manifest :func:`_unpublish` removed (unless a publish made a new one)."""
    loc.blobs.create_exclusive(loc.file(m.version, MANIFEST_FILE), m.to_json())


def _remove_files(loc: Location, version: str, m: Manifest | None, before: float) -> None:
    """Remove the files of a removed version: those its manifest listed, and any other
    file last modified before ``before`` (a time.time()); then its folder if empty."""
    listed = {e.stored_name(n) for n, e in m.files.items()} if m is not None else set()
    vdir = loc.version_dir(version)
    for name, mtime in loc.blobs.files(vdir).items():
        if name in listed or mtime < before:
            loc.blobs.remove_file(loc.file(version, name))
    loc.blobs.remove_empty_dir(vdir)


def _remove_stray_files(loc: Location, m: Manifest, before: float) -> None:
    """Remove files of a complete version that its manifest does not reference and that
    were last modified before ``before`` (a time.time())."""
    wanted = {MANIFEST_FILE} | {e.stored_name(n) for n, e in m.files.items()}
    for name, mtime in loc.blobs.files(loc.version_dir(m.version)).items():
        if name not in wanted and mtime < before:
            log.info("gc removes %s of %s (referenced by no manifest)", name,
                     loc.describe(m.version))
            loc.blobs.remove_file(loc.file(m.version, name))
