"""Garbage collection of old and unfinished versions of one (user, model).

Callers: :func:`inferscale.artifacts.publish.publish` (``keep=``) and operators.
"""

from __future__ import annotations

import logging
import time

from inferscale.artifacts import fact_table
from inferscale.artifacts.blobs import Location
from inferscale.artifacts.layout import (
    LANCE_DIR, MANIFEST_FILE, VERSION_RE, ArtifactError, MissingManifest, StoreConfig,
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

    Publishing runs it too (``keep``), so gc races publishes: a publish that moves LATEST
    back to an old version that a gc removes meanwhile notices it and writes the version
    again; a publish whose files a gc removed (stalled over ``stale_after_s``) fails
    before moving LATEST.
    """
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    loc = Location(store, user, model_fp)
    latest = latest_version(store, user, model_fp)
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
    keep_set = {m.version for m in complete[-keep:]} | {latest}
    doomed = [m.version for m in complete if m.version not in keep_set]
    now = time.time()
    for name in unfinished:
        touched = loc.blobs.mtime(loc.version_dir(name))
        if touched is not None and now - touched > stale_after_s and name != latest:
            doomed.append(name)
    for m in complete:
        if m.version in keep_set:
            _remove_stray_files(loc, m, now - stale_after_s)
    for name in doomed:
        # the manifest goes first: a half-removed version then reads as unfinished
        loc.blobs.remove_file(loc.file(name, MANIFEST_FILE))
        loc.blobs.remove_tree(loc.version_dir(name))
    if doomed and LANCE_DIR in loc.blobs.listdir(loc.dir):
        fact_table.drop_tags(store, loc, doomed)
    return doomed


def _remove_stray_files(loc: Location, m: Manifest, before: float) -> None:
    """Remove files of a complete version that its manifest does not reference and that
    were last modified before ``before`` (a time.time())."""
    wanted = {MANIFEST_FILE} | {e.stored_name(n) for n, e in m.files.items()}
    for name, mtime in loc.blobs.files(loc.version_dir(m.version)).items():
        if name not in wanted and mtime < before:
            log.info("gc removes %s of %s (referenced by no manifest)", name,
                     loc.describe(m.version))
            loc.blobs.remove_file(loc.file(m.version, name))
