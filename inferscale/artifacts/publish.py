"""Publishing versioned, content-addressed memory artifacts per (user, model).

A version holds ``facts.arrow`` (the facts table), ``kv.arrow`` (the KV slab and its
offsets table, layout in :mod:`storage_schemas.kv`) and ``manifest.json`` (lineage,
sizes, checksums; :mod:`storage_schemas.manifest`). Its id is a content hash of the
inputs (user, log hash, facts hash, model fingerprint, encoder config, storage format
versions): publishing unchanged inputs writes nothing and returns the existing version.

Publish order, so that a crash at any point leaves ``LATEST`` on a complete, verified
version: data files (each atomic) -> re-read and verify sizes and checksums -> fact
embeddings into LanceDB (tagged with the version id) -> manifest (created exclusively:
when publishers race on one version exactly one creates it) -> ``LATEST`` (atomically
replaced) -> optional gc. A version without a manifest is unfinished and invisible;
re-running the publish completes it under the same id.

Fact embeddings also go into a LanceDB table per (user, model) beside the versions
(:mod:`inferscale.artifacts.fact_table`), tagged with each version id, so
:func:`~inferscale.artifacts.read.open_fact_table` sees exactly the facts of a version.
lancedb is imported only when used. :class:`Lineage` (a version's parent hashes) is not
:mod:`inferscale.artifacts.lineage_view` (how a version is shown to people).

Reading is :mod:`inferscale.artifacts.read`, garbage collection
:mod:`inferscale.artifacts.gc`.

Callers: the pipeline's publish step (the encode flow's task), benchmarks, tests.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from inferscale import __version__
from inferscale.artifacts import fact_table
from inferscale.artifacts.blobs import Location
from inferscale.artifacts.gc import gc
from inferscale.artifacts.kv_slab import EncodedMemoryLike, build_kv_batch
from inferscale.artifacts.layout import (
    FACTS_FILE, KV_FILE, MANIFEST_FILE, ArtifactError, ArtifactNotFound, ArtifactSchemaError,
    CorruptArtifact, InvalidArtifactInput, MissingManifest, StoreConfig,
)
from inferscale.artifacts.read import check_digest, check_size, latest_version, manifest_at
from inferscale.types import PREFIX_ID
from storage_schemas import facts as facts_schema
from storage_schemas import kv as kv_schema
from storage_schemas import manifest as manifest_schema
from storage_schemas.common import SchemaVersionError, check_schema
from storage_schemas.manifest import FileEntry, Manifest


@dataclass(frozen=True)
class Lineage:
    """Parents of a version: content hashes of the conversation log and of the facts."""

    log_hash: str
    facts_hash: str

    def __post_init__(self) -> None:
        for name in ("log_hash", "facts_hash"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise InvalidArtifactInput(f"lineage {name} must be a non-empty string, got {v!r}")


@dataclass(frozen=True)
class PublishResult:
    version: str
    created: bool  # False: the version existed (nothing written but, maybe, LATEST)
    manifest: Manifest
    removed: tuple[str, ...] = ()  # versions garbage-collected afterwards


def version_id(user: str, lineage: Lineage, model_fp: str, encoder_config: Mapping[str, Any]) -> str:
    """Content hash of a publish's inputs: 32 hex digits."""
    blob = json.dumps({
        "formats": {"kv": kv_schema.VERSION, "manifest": manifest_schema.VERSION,
                    "facts": facts_schema.VERSION},
        "user": user, "log": lineage.log_hash, "facts": lineage.facts_hash,
        "model": model_fp, "encoder": _jsonable(encoder_config),
    }, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def publish(store: StoreConfig, user: str, encoded: EncodedMemoryLike, facts: pa.Table,
            lineage: Lineage, *, keep: int | None = None, embeddings: bool = True) -> PublishResult:
    """Publish one (user, model) version from the encoder's output and the facts table.

    ``facts`` has :func:`storage_schemas.facts.schema` for its embedding size, rows of
    ``user`` only; ``encoded.chunks`` are ``"prefix"`` then exactly one chunk per fact.
    ``keep``: afterwards keep only the newest ``keep`` versions (plus LATEST's).
    ``embeddings``: also write the LanceDB fact table (needs lancedb).
    Raises :class:`InvalidArtifactInput` (and :class:`InvalidUserId`) for bad inputs.

    The version id hashes the inputs, not the KV: when the version exists, the chunks
    are not even laid out again. An encoder change must therefore show in the model
    fingerprint or the encoder config (it does: dtype, window, instruction... live there).
    """
    model_fp = encoded.model_fingerprint
    loc = Location(store, user, model_fp)
    encoder_config = _jsonable(encoded.encoder_config)
    facts = _check_facts(facts, user)
    _check_chunks_match_facts([c.chunk_id for c in encoded.chunks], facts)
    if embeddings:
        fact_table.require_lancedb()  # fail before writing anything
    version = version_id(user, lineage, model_fp, encoder_config)

    existing = _existing(loc, version)
    if existing is not None:  # same inputs: the KV is not even laid out again
        if embeddings:
            fact_table.ensure_tag(store, loc, version, facts)
        _point_latest(loc, version)
        return PublishResult(version, False, existing, _maybe_gc(store, user, model_fp, keep))

    layout, batch, slab_buffer = build_kv_batch(encoded, model_fp)

    files: dict[str, FileEntry] = {}

    def write_facts(w: Any) -> None:
        with pa.ipc.new_file(w, facts.schema) as writer:
            writer.write_table(facts)

    def write_kv(w: Any) -> None:
        with pa.ipc.new_file(w, batch.schema) as writer:
            writer.write_batch(batch)

    out = loc.blobs.write_stream(loc.file(version, FACTS_FILE), write_facts)
    files[FACTS_FILE] = FileEntry(out.nbytes, out.xxh3_128)
    out = loc.blobs.write_stream(loc.file(version, KV_FILE), write_kv, watch=slab_buffer.address)
    files[KV_FILE] = FileEntry(out.nbytes, out.xxh3_128)
    slab_offset = out.watched_at
    if slab_offset is None:
        if layout.slab_bytes:
            raise ArtifactError("could not locate the slab inside kv.arrow while writing it "
                                "(pyarrow wrote it in pieces?)")
        slab_offset = 0

    manifest = Manifest(
        user=user, model_fingerprint=model_fp, version=version, encoder_config=encoder_config,
        parents={"log": lineage.log_hash, "facts": lineage.facts_hash}, files=files,
        counts={"facts": facts.num_rows, "chunks": batch.num_rows, "tokens": layout.tokens},
        kv={"layout": kv_schema.LAYOUT, "dtype": layout.dtype, "layers": layout.layers,
            "kv_heads": layout.kv_heads, "head_dim": layout.head_dim,
            "slab_offset": slab_offset, "slab_bytes": layout.slab_bytes},
        created=datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        producer=f"inferscale {__version__}",
    )
    for name in files:  # verify what is stored, not what we meant to store
        check_size(loc, manifest, name)
        digest = loc.blobs.hash_file(loc.file(version, name), files[name].bytes)
        check_digest(loc, manifest, name, digest)
    if embeddings:
        fact_table.index_embeddings(store, user, model_fp, version, facts)
    created = loc.blobs.create_exclusive(loc.file(version, MANIFEST_FILE), manifest.to_json())
    if not created:  # a concurrent publisher of the same inputs won: use its manifest
        manifest = manifest_at(loc, version)
    _point_latest(loc, version)
    return PublishResult(version, created, manifest, _maybe_gc(store, user, model_fp, keep))


def _existing(loc: Location, version: str) -> Manifest | None:
    """The complete version's manifest (sizes checked), or None if not (fully) there."""
    try:
        m = manifest_at(loc, version)
    except (ArtifactNotFound, MissingManifest):
        return None
    for name in m.files:
        check_size(loc, m, name)  # damaged complete versions are errors, not republished
    return m


def _point_latest(loc: Location, version: str) -> None:
    try:
        current = latest_version(loc.config, loc.user, loc.model_fp)
    except CorruptArtifact:
        current = None
    if current != version:
        loc.blobs.replace(loc.latest, (version + "\n").encode())


def _maybe_gc(store: StoreConfig, user: str, model_fp: str, keep: int | None) -> tuple[str, ...]:
    return tuple(gc(store, user, model_fp, keep)) if keep is not None else ()


def _jsonable(config: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(config, Mapping):
        raise InvalidArtifactInput(f"encoder_config must be a mapping, got {type(config).__name__}")
    try:
        return json.loads(json.dumps(dict(config), sort_keys=True, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidArtifactInput(f"encoder_config is not JSON-able: {exc}") from exc


def _check_facts(facts: pa.Table, user: str) -> pa.Table:
    if not isinstance(facts, pa.Table):
        raise InvalidArtifactInput(f"facts must be a pyarrow Table, got {type(facts).__name__}")
    try:
        check_schema(facts.schema, facts_schema.NAME, facts_schema.VERSION)
    except SchemaVersionError as exc:
        raise ArtifactSchemaError(f"facts table: {exc}") from exc
    try:
        dim = facts.schema.field("embedding").type.list_size
        expected = facts_schema.schema(dim)
        if [(f.name, f.type) for f in facts.schema] != [(f.name, f.type) for f in expected]:
            raise ValueError(f"columns {facts.schema.names} do not match {expected.names}")
        facts = facts.cast(expected)
    except (KeyError, AttributeError, ValueError, pa.ArrowException) as exc:
        raise InvalidArtifactInput(f"facts table does not have the facts schema: {exc}") from exc
    if facts.num_rows and not pc.all(pc.equal(facts["user"], user)).as_py():
        raise InvalidArtifactInput(f"facts table holds rows of users other than {user!r}")
    if pc.count_distinct(facts["fact_id"]).as_py() != facts.num_rows:
        raise InvalidArtifactInput("facts table has duplicate fact_id values")
    return facts.combine_chunks()


def _check_chunks_match_facts(chunk_ids: list[str], facts: pa.Table) -> None:
    chunk_ids = set(chunk_ids) - {PREFIX_ID}
    fact_ids = set(facts.column("fact_id").to_pylist())
    if chunk_ids != fact_ids:
        missing, extra = sorted(fact_ids - chunk_ids)[:5], sorted(chunk_ids - fact_ids)[:5]
        raise InvalidArtifactInput(f"KV chunks and facts disagree: facts without KV {missing}, "
                                   f"KV chunks without a fact {extra}")
