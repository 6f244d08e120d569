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
    names; remove the rest, and unfinished versions untouched for ``stale_after_s``
    (an unfinished version younger than that may be a publish in progress). Damaged
    versions are left for a person to look at. Returns the removed version ids.

    Run it from one place per (user, model) (the publish flow): a gc racing with a
    publish that moves LATEST back to an old version could remove that version.
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
    for name in doomed:
        # the manifest goes first: a half-removed version then reads as unfinished
        loc.blobs.remove_file(loc.file(name, MANIFEST_FILE))
        loc.blobs.remove_tree(loc.version_dir(name))
    if doomed and LANCE_DIR in loc.blobs.listdir(loc.dir):
        fact_table.drop_tags(store, loc, doomed)
    return doomed
