"""Publishing versioned, content-addressed memory artifacts per (user, model).

A version holds a facts table and a KV file (the KV slab and its offsets table, layout
in :mod:`storage_schemas.kv`) and ``manifest.json`` (lineage, sizes, checksums, stored
names; :mod:`storage_schemas.manifest`). Its id is a content hash of everything that
decides its bytes: user, log hash, facts hash, model fingerprint, encoder config (which
the encoder extends with the dtype and device kind it computed in) and the storage
format versions. Publishing unchanged inputs writes nothing and returns the existing
version, once its files verified.

Publish order, so that a crash or a race at any point leaves ``LATEST`` on a complete,
verified version: data files under names no other publish uses (``kv.<nonce>.arrow``,
each atomic) -> re-read and verify sizes and checksums -> fact embeddings into LanceDB
(tagged with the version id) -> manifest (created exclusively: when publishers race on
one version exactly one manifest wins, and the others adopt it only after verifying its
files; a manifest whose files do not verify is replaced by the next publish: a repair)
-> ``LATEST`` (compare-and-swap: it names the publish of the newest inputs,
:mod:`inferscale.artifacts.latest`) -> optional gc. A version without a manifest is
unfinished and invisible; re-running the publish completes it under the same id.

Fact embeddings also go into a LanceDB table per (user, model) beside the versions
(:mod:`inferscale.artifacts.fact_table`), tagged with each version id, so
:func:`~inferscale.artifacts.read.open_fact_table` sees exactly the facts of a version.
lancedb is imported only when used. :class:`Lineage` (a version's parent hashes) is not
:mod:`inferscale.artifacts.lineage_view` (how a version is shown to people).

:func:`publish_linked` publishes a version sharing another user's kv file (a hard link on a
local store): many users of one memory store one slab.

Reading is :mod:`inferscale.artifacts.read`, garbage collection
:mod:`inferscale.artifacts.gc`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from inferscale import __version__
from inferscale.artifacts import fact_table
from inferscale.artifacts.blobs import Location
from inferscale.artifacts.gc import gc
from inferscale.artifacts.kv_file import EncodedMemoryLike, build_kv_batch
from inferscale.artifacts.latest import inputs_time, point_latest, readable
from inferscale.artifacts.layout import (
    FACTS_FILE, KV_FILE, MANIFEST_FILE, ArtifactError, ArtifactNotFound, ArtifactSchemaError,
    ChecksumError, CorruptArtifact, InvalidArtifactInput, MissingManifest, StoreConfig,
    TruncatedArtifact,
)
from inferscale.artifacts.read import check_size, manifest_at, verify_files
from inferscale.types import PREFIX_ID, KVGeometry
from storage_schemas import facts as facts_schema
from storage_schemas import kv as kv_schema
from storage_schemas import manifest as manifest_schema
from storage_schemas.common import SchemaVersionError, check_schema
from storage_schemas.manifest import FileEntry, Manifest

log = logging.getLogger(__name__)


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
    created: bool  # False: the version existed and verified (nothing written but LATEST)
    manifest: Manifest
    removed: tuple[str, ...] = ()  # versions garbage-collected afterwards
    latest: str = ""  # what LATEST names afterwards (another version when newer inputs won)


def version_id(user: str, lineage: Lineage, model_fp: str, encoder_config: Mapping[str, Any]) -> str:
    """Content hash of a publish's inputs: 32 hex digits. The kv format version hashed is
    the one the encoder config's stored ``dtype`` is written in (an fp8 version differs
    from a bf16 one through its dtype anyway; unquantized ids stay what they were)."""
    blob = json.dumps({
        "formats": {"kv": kv_schema.written_version(str(encoder_config.get("dtype", ""))),
                    "manifest": manifest_schema.VERSION,
                    "facts": facts_schema.VERSION},
        "user": user, "log": lineage.log_hash, "facts": lineage.facts_hash,
        "model": model_fp, "encoder": _jsonable(encoder_config),
    }, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def publish(store: StoreConfig, user: str, encoded: EncodedMemoryLike, facts: pa.Table,
            lineage: Lineage, *, geometry: KVGeometry | None = None, keep: int | None = None,
            embeddings: bool = True, inputs_at: datetime | None = None) -> PublishResult:
    """Publish one (user, model) version from the encoder's output and the facts table.

    ``facts`` has :func:`storage_schemas.facts.schema` for its embedding size, rows of
    ``user`` only; ``encoded.chunks`` are ``"prefix"`` then exactly one chunk per fact.
    ``geometry``: the KV geometry of the model ``encoded.model_fingerprint`` names (the
    caller's record of it; the pipeline reads it from the checkpoint it fingerprinted);
    ``encoded.geometry``, the encoder's record of the model it ran, is checked too. Every
    chunk must have it (same bytes per token regrouped, ``[L, 2H, D/2]``, is another
    geometry) and at least one of the two must be known: publish never guesses.
    ``keep``: afterwards keep only the newest ``keep`` versions (plus LATEST's).
    ``embeddings``: also write the LanceDB fact table (needs lancedb).
    ``inputs_at``: when the inputs were taken (the flows pass the time the logs were
    read; default: now). ``LATEST`` names the publish with the newest ``inputs_at``
    (ties: the larger version id): a publish of older inputs that finishes after a
    newer one still creates its version but leaves ``LATEST`` alone (``result.latest``
    says what it names). Publishing old inputs again with a newer ``inputs_at`` (a
    log reverted, a rollback) moves ``LATEST`` back to their version.
    Raises :class:`InvalidArtifactInput` (and :class:`InvalidUserId`) for bad inputs.

    The version id hashes the inputs, not the KV: when the version exists and its files
    verify, the chunks are not even laid out again. An encoder change must therefore
    show in the model fingerprint or the encoder config (it does: dtype, window,
    instruction, compute dtype and device live there).
    """
    model_fp = encoded.model_fingerprint
    loc = Location(store, user, model_fp)
    encoder_config = _jsonable(encoded.encoder_config)
    inputs_at = inputs_time(inputs_at)
    facts = _check_facts(facts, user)
    _check_chunks_match_facts([c.chunk_id for c in encoded.chunks], facts)
    _check_geometry(encoded, geometry)
    if embeddings:
        fact_table.require_lancedb()  # fail before writing anything
    version = version_id(user, lineage, model_fp, encoder_config)

    existing, damage = _existing(loc, version)
    if existing is not None:  # same inputs, verified: the KV is not even laid out again
        if embeddings:
            fact_table.ensure_tag(store, loc, version, facts)
        latest = point_latest(loc, version, inputs_at)
        if readable(loc, version):
            return PublishResult(version, False, existing,
                                 _maybe_gc(store, user, model_fp, keep), latest)
        # a concurrent gc is removing it (an old version): LATEST did not move to it
        log.warning("%s is being removed by a gc; writing it again", loc.describe(version))
    if damage is not None:
        log.warning("%s does not verify; publishing it again: %s", loc.describe(version), damage)

    manifest = _write_files(loc, version, encoded, facts, lineage, encoder_config)
    if embeddings:
        fact_table.index_embeddings(store, user, model_fp, version, facts)
    manifest, created = _commit_manifest(loc, manifest, replace=damage is not None)
    latest = point_latest(loc, version, inputs_at)
    return PublishResult(version, created, manifest, _maybe_gc(store, user, model_fp, keep),
                         latest)


def publish_linked(store: StoreConfig, user: str, source: Manifest, facts: pa.Table,
                   lineage: Lineage, *, inputs_at: datetime | None = None) -> PublishResult:
    """Publish ``user``'s version holding the KV of ``source``, a version another user
    published on the same local store: its own facts table (the source's facts, rows of
    ``user``) and manifest, its kv file a hard link to the source's, then ``LATEST``.
    Many users of one memory thus store one slab (the load benchmark's memory groups).
    The version id is :func:`publish`'s for the same inputs; the source's kv file is not
    re-read (it verified when published), and hydration verifies it as any version's
    (sizes, checksums, fingerprint). An existing version that verifies is kept."""
    if not store.is_local:
        raise InvalidArtifactInput("publish_linked needs a local artifact store (hard links)")
    model_fp = source.model_fingerprint
    src, loc = Location(store, source.user, model_fp), Location(store, user, model_fp)
    facts = _check_facts(facts, user)
    if facts.num_rows != source.counts["facts"]:
        raise InvalidArtifactInput(f"{facts.num_rows} facts for {source.counts['facts']} of "
                                   f"{src.describe(source.version)}")
    version = version_id(user, lineage, model_fp, source.encoder_config)
    existing, damage = _existing(loc, version)
    if existing is not None:
        return PublishResult(version, False, existing, (),
                             point_latest(loc, version, inputs_time(inputs_at)))
    nonce = uuid.uuid4().hex[:16]

    def write_facts(w: Any) -> None:
        with pa.ipc.new_file(w, facts.schema) as writer:
            writer.write_table(facts)

    out = loc.blobs.write_stream(loc.file(version, f"facts.{nonce}.arrow"), write_facts)
    kv = source.files[KV_FILE]
    os.link(src.file(source.version, kv.stored_name(KV_FILE)),
            loc.file(version, kv.stored_name(KV_FILE)))
    manifest = Manifest(
        user=user, model_fingerprint=model_fp, version=version,
        encoder_config=source.encoder_config,
        parents={"log": lineage.log_hash, "facts": lineage.facts_hash},
        files={FACTS_FILE: FileEntry(out.nbytes, out.xxh3_128, f"facts.{nonce}.arrow"),
               KV_FILE: kv},
        counts=dict(source.counts), kv=dict(source.kv),
        created=datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        producer=f"{source.producer} (KV file linked from {source.user})")
    manifest, created = _commit_manifest(loc, manifest, replace=damage is not None)
    return PublishResult(version, created, manifest, (),
                         point_latest(loc, version, inputs_time(inputs_at)))


def _write_files(loc: Location, version: str, encoded: EncodedMemoryLike, facts: pa.Table,
                 lineage: Lineage, encoder_config: dict[str, Any]) -> Manifest:
    """Write the data files under names of this attempt only, re-read and verify them;
    returns the manifest that describes them (not yet stored)."""
    layout, batch, slab_buffer = build_kv_batch(encoded, loc.model_fp)
    calibration = getattr(encoded, "calibration", None)
    nonce = uuid.uuid4().hex[:16]  # racing publishers never write each other's files

    def write_facts(w: Any) -> None:
        with pa.ipc.new_file(w, facts.schema) as writer:
            writer.write_table(facts)

    def write_kv(w: Any) -> None:
        with pa.ipc.new_file(w, batch.schema) as writer:
            writer.write_batch(batch)

    files: dict[str, FileEntry] = {}
    slab_offset = None
    for name, fill, watch in ((FACTS_FILE, write_facts, None),
                              (KV_FILE, write_kv, slab_buffer.address)):
        stem, _, ext = name.partition(".")
        stored = f"{stem}.{nonce}.{ext}"
        out = loc.blobs.write_stream(loc.file(version, stored), fill, watch=watch)
        files[name] = FileEntry(out.nbytes, out.xxh3_128, stored)
        if watch is not None:
            slab_offset = out.watched_at
    if slab_offset is None:
        if layout.slab_bytes:
            raise ArtifactError("could not locate the slab inside kv.arrow while writing it "
                                "(pyarrow wrote it in pieces?)")
        slab_offset = 0

    manifest = Manifest(
        user=loc.user, model_fingerprint=loc.model_fp, version=version,
        encoder_config=encoder_config,
        parents={"log": lineage.log_hash, "facts": lineage.facts_hash}, files=files,
        counts={"facts": facts.num_rows, "chunks": batch.num_rows, "tokens": layout.tokens},
        kv={"layout": kv_schema.LAYOUT, "dtype": layout.dtype, "layers": layout.layers,
            "kv_heads": layout.kv_heads, "head_dim": layout.head_dim,
            "slab_offset": slab_offset, "slab_bytes": layout.slab_bytes,
            **({"scales": kv_schema.SCALES[layout.dtype]} if layout.quantized else {}),
            "index_xxh3": kv_schema.index_digest(*(
                batch.column(c).to_pylist() for c in kv_schema.index_columns(layout))),
            # the temperatures the stored fact keys are divided by (calibrated encodings)
            **({"key_calibration": _jsonable(calibration)} if calibration else {})},
        created=datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        producer=f"inferscale {__version__}",
    )
    verify_files(loc, manifest)  # what is stored, not what we meant to store
    return manifest


def _commit_manifest(loc: Location, manifest: Manifest, replace: bool) -> tuple[Manifest, bool]:
    """Store ``manifest`` (files written and verified) unless a racing publisher's
    verified manifest got there first; returns (the version's manifest, whether ours).

    ``replace``: the stored manifest or its files failed verification: ours replaces it.
    A lost race adopts the winner's manifest only when its files verify (then our files,
    which nothing references, are removed); otherwise ours replaces it.
    """
    path = loc.file(manifest.version, MANIFEST_FILE)
    for _ in range(3):
        if replace:
            loc.blobs.replace(path, manifest.to_json())
        elif not loc.blobs.create_exclusive(path, manifest.to_json()):
            winner, damage = _existing(loc, manifest.version)
            if winner is not None:
                for entry in manifest.files.values():
                    loc.blobs.remove_file(loc.file(manifest.version, entry.stored_as))
                return winner, False
            replace = damage is not None
            if damage is not None:
                log.warning("the racing publisher's %s does not verify: %s",
                            loc.describe(manifest.version), damage)
            continue  # repair it, or (removed meanwhile) create it again
        # our files are still there (a gc of files it took for stale can race a publish
        # that stalled for an hour): else fail before LATEST, the next publish repairs
        for name in manifest.files:
            check_size(loc, manifest, name)
        return manifest, True
    raise ArtifactError(f"{loc.describe(manifest.version)}: could not store the manifest "
                        "(concurrent publishers and removals)")


def _existing(loc: Location, version: str) -> tuple[Manifest | None, ArtifactError | None]:
    """(manifest, None) for a complete version whose files verify (sizes and checksums);
    (None, None) when it is not there or unfinished; (None, the error) when its manifest
    or files are damaged: the publish then writes it again (a repair). A manifest of a
    newer schema or another model is left alone (raised)."""
    try:
        m = manifest_at(loc, version)
        verify_files(loc, m)
    except (ArtifactNotFound, MissingManifest):
        return None, None
    except (TruncatedArtifact, ChecksumError, CorruptArtifact) as exc:
        return None, exc
    return m, None


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


def _check_geometry(encoded: EncodedMemoryLike, geometry: KVGeometry | None) -> None:
    """:class:`InvalidArtifactInput` unless every chunk's rows ``[T, 2, L, H, D]`` have
    the model's geometry: ``geometry`` and the encoder's ``encoded.geometry``, whichever
    are known (at least one must be)."""
    known = [KVGeometry(*g) for g in (geometry, getattr(encoded, "geometry", None))
             if g is not None]
    if not known:
        raise InvalidArtifactInput(
            f"the KV geometry of model {encoded.model_fingerprint} is not known: pass the "
            "model's (layers, kv_heads, head_dim) as geometry, or publish the encoder's "
            "output (which records it)")
    for want in known:
        for c in encoded.chunks:
            got = tuple(getattr(c.kv, "shape", ()))
            if len(got) != 5 or got[1:] != (2, *want):
                raise InvalidArtifactInput(
                    f"chunk {c.chunk_id!r:.40}: rows {list(got)} do not match [T, 2, L, H, D] "
                    f"of model {encoded.model_fingerprint}'s geometry {want.describe()}")


def _check_chunks_match_facts(chunk_ids: list[str], facts: pa.Table) -> None:
    chunk_ids = set(chunk_ids) - {PREFIX_ID}
    fact_ids = set(facts.column("fact_id").to_pylist())
    if chunk_ids != fact_ids:
        missing, extra = sorted(fact_ids - chunk_ids)[:5], sorted(chunk_ids - fact_ids)[:5]
        raise InvalidArtifactInput(f"KV chunks and facts disagree: facts without KV {missing}, "
                                   f"KV chunks without a fact {extra}")
