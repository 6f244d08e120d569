"""LanceDB table of fact embeddings beside the artifacts, one per (user, model).

``{root}/users/{user}/{model_fp}/lance`` holds the table ``facts`` (the facts table's
columns, embeddings as fixed-size float32 vectors). Each publish overwrites it and tags
the Lance version it committed with the artifact version id, so a reader that checks
out that tag sees exactly that version's facts; gc deletes the tags of removed versions
(Lance keeps its old data files until an operator runs ``optimize``: Lance refuses to
clean versions older than a tagged one). On S3 the table lives on the same bucket,
reached with :meth:`StoreConfig.lance_storage_options`.

lancedb is imported only here and only when called (the GPU machine lacks it).
"""

from __future__ import annotations

import logging
import random
import time
import warnings
from typing import Any

import pyarrow as pa

from inferscale.artifacts.blobs import Location
from inferscale.artifacts.layout import ArtifactError, StoreConfig

log = logging.getLogger(__name__)

TABLE = "facts"


def require_lancedb() -> Any:
    """The lancedb module, or an :class:`ArtifactError` saying how to do without it."""
    try:
        import lancedb
    except ImportError as exc:
        raise ArtifactError("fact embeddings need lancedb (pip install lancedb), or publish "
                            "with embeddings=False") from exc
    return lancedb


def connect(store: StoreConfig, loc: Location) -> Any:
    """The LanceDB database of (user, model) ``loc`` on the store's root."""
    opts = store.lance_storage_options()
    return require_lancedb().connect(loc.lance_uri, storage_options=opts or None)


def index_embeddings(store: StoreConfig, user: str, model_fp: str, version: str,
                     facts: pa.Table) -> int:
    """Overwrite the (user, model) LanceDB table ``facts`` with ``facts`` and tag that
    Lance version with ``version``; returns the Lance version number. Idempotent: an
    existing tag is kept (it names the same facts: versions are content hashes)."""
    loc = Location(store, user, model_fp)
    table = _overwrite_table(connect(store, loc), facts, loc)
    try:
        table.tags.create(version, table.version)
    except RuntimeError as exc:
        if "already exists" not in str(exc):
            raise
    return table.version


def _overwrite_table(db: Any, facts: pa.Table, loc: Location) -> Any:
    """Replace the fact table's content; returns the table at the version it committed.

    Races between publishers are expected: the first creation is ``mode="create"`` (the
    loser gets "already exists" or a commit conflict and overwrites instead; lancedb 0.40 can panic when two
    ``create_table(mode="overwrite")`` calls race on a new table), later writes are
    ``add(mode="overwrite")`` retried on commit conflicts.
    """
    last: Exception | None = None
    for _ in range(8):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                table = db.open_table(TABLE)
            except (ValueError, FileNotFoundError):
                try:
                    return db.create_table(TABLE, facts, mode="create")
                except (ValueError, RuntimeError, OSError) as exc:
                    # lost the creation: "already exists", or a commit conflict when the
                    # racers' first commits collide (then open it and overwrite)
                    if "already exists" not in str(exc) and "conflict" not in str(exc).lower():
                        raise
                    last = exc
                    continue
            try:
                table.add(facts, mode="overwrite")
                return table
            except (RuntimeError, OSError, ValueError) as exc:
                if "conflict" not in str(exc).lower():
                    raise
                last = exc
        time.sleep(random.uniform(0.02, 0.2))
    raise ArtifactError(f"{loc.describe()}: could not write the fact table at {loc.lance_uri} "
                        f"(concurrent writers): {last}")


def ensure_tag(store: StoreConfig, loc: Location, version: str, facts: pa.Table) -> None:
    """Write ``facts`` under tag ``version`` unless the tag exists (republish repair)."""
    db = connect(store, loc)
    try:
        table = db.open_table(TABLE)
        if version in table.tags.list():
            return
    except (ValueError, FileNotFoundError, RuntimeError):
        pass
    index_embeddings(store, loc.user, loc.model_fp, version, facts)


def drop_tags(store: StoreConfig, loc: Location, versions: list[str]) -> None:
    """Delete the tags of garbage-collected versions (best effort: gc never fails here)."""
    try:
        table = connect(store, loc).open_table(TABLE)
        tags = table.tags.list()
    except (ArtifactError, ValueError, FileNotFoundError, RuntimeError) as exc:
        log.warning("gc could not open the fact table of %s: %s", loc.describe(), exc)
        return
    for v in versions:
        if v in tags:
            table.tags.delete(v)
