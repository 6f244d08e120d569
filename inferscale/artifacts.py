"""Versioned, content-addressed memory artifacts per (user, model): publish, read, gc.

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
(:mod:`inferscale.fact_table`), tagged with each version id, so ``open_fact_table`` sees
exactly the facts of a version. lancedb is imported only when used.

Callers: the encode flow/task (``publish``, ``gc``), the CLI and flows (listing,
lineage), ``inferscale.hydrate`` (``read_manifest``) and the retrieval side
(``read_facts``, ``open_fact_table``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from inferscale import __version__
from inferscale import fact_table
from inferscale.blobs import Location, open_blobs
from inferscale.fact_table import index_embeddings  # re-exported
from inferscale.kv_slab import EncodedMemoryLike, build_kv_batch
from inferscale.store import (
    DATA_FILES, FACTS_FILE, KV_FILE, LANCE_DIR, MANIFEST_FILE, VERSION_RE, ArtifactError,
    ArtifactNotFound, ArtifactSchemaError, ChecksumError, CorruptArtifact,
    FingerprintMismatch, InvalidArtifactInput, InvalidStoreConfig, InvalidUserId,
    MissingManifest, StoreConfig, TruncatedArtifact, user_dirname, user_from_dirname,
)
from inferscale.types import PREFIX_ID
from storage_schemas import facts as facts_schema
from storage_schemas import kv as kv_schema
from storage_schemas import manifest as manifest_schema
from storage_schemas.common import SchemaVersionError, check_schema
from storage_schemas.manifest import FileEntry, Manifest, ManifestChecksumError, ManifestError

__all__ = [
    "ArtifactError", "ArtifactNotFound", "ArtifactSchemaError", "ChecksumError",
    "CorruptArtifact", "FingerprintMismatch", "InvalidArtifactInput", "InvalidStoreConfig",
    "InvalidUserId", "Lineage", "Manifest", "MissingManifest", "PublishResult", "StoreConfig",
    "TruncatedArtifact", "gc", "latest_version", "list_models", "list_users", "list_versions",
    "open_fact_table", "index_embeddings", "publish", "read_facts", "read_manifest",
    "resolve_version", "verify_version", "version_id",
]

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
    created: bool  # False: the version existed (nothing written but, maybe, LATEST)
    manifest: Manifest
    removed: tuple[str, ...] = ()  # versions garbage-collected afterwards


# ------------------------------------------------------------------------------ versions


def version_id(user: str, lineage: Lineage, model_fp: str, encoder_config: Mapping[str, Any]) -> str:
    """Content hash of a publish's inputs: 32 hex digits."""
    blob = json.dumps({
        "formats": {"kv": kv_schema.VERSION, "manifest": manifest_schema.VERSION,
                    "facts": facts_schema.VERSION},
        "user": user, "log": lineage.log_hash, "facts": lineage.facts_hash,
        "model": model_fp, "encoder": _jsonable(encoder_config),
    }, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def latest_version(store: StoreConfig, user: str, model_fp: str) -> str | None:
    """The version ``LATEST`` names, or ``None`` when nothing was published."""
    loc = Location(store, user, model_fp)
    try:
        data = loc.blobs.read_bytes(loc.latest)
    except FileNotFoundError:
        return None
    version = data.decode("ascii", "replace").strip()
    if not VERSION_RE.fullmatch(version):
        raise CorruptArtifact(f"{loc.latest} holds {data[:80]!r}, not a version id")
    return version


def resolve_version(store: StoreConfig, user: str, model_fp: str, version: str = "latest") -> str:
    if version != "latest":
        return version
    found = latest_version(store, user, model_fp)
    if found is None:
        raise ArtifactNotFound(f"nothing published for user {user!r}, model {model_fp} "
                               f"under {store.root} (no LATEST)")
    return found


def read_manifest(store: StoreConfig, user: str, model_fp: str, version: str = "latest") -> Manifest:
    """Read and check one version's manifest (schema, self-checksum, owner, files)."""
    loc = Location(store, user, model_fp)
    version = resolve_version(store, user, model_fp, version)
    return manifest_at(loc, version)


def manifest_at(loc: Location, version: str) -> Manifest:
    """:func:`read_manifest` for a resolved version at a :class:`Location` (hydrate uses it)."""
    path = loc.file(version, MANIFEST_FILE)
    try:
        data = loc.blobs.read_bytes(path)
    except FileNotFoundError:
        if version in loc.blobs.listdir(loc.dir):
            raise MissingManifest(f"{loc.describe(version)}: {path} is missing (an unfinished "
                                  "publish or a damaged store)") from None
        raise ArtifactNotFound(f"{loc.describe(version)}: no such version under "
                               f"{loc.config.root}") from None
    try:
        m = Manifest.from_json(data)
    except SchemaVersionError as exc:
        raise ArtifactSchemaError(f"{path}: {exc}") from exc
    except ManifestChecksumError as exc:
        raise ChecksumError(f"{path}: {exc} (the manifest is damaged)") from exc
    except ManifestError as exc:
        raise CorruptArtifact(f"{path}: {exc}") from exc
    if m.model_fingerprint != loc.model_fp:
        raise FingerprintMismatch(f"{path} was written for model {m.model_fingerprint}, "
                                  f"found under model {loc.model_fp}")
    if m.version != version or m.user != loc.user:
        raise CorruptArtifact(f"{path} describes user {m.user!r} version {m.version}, "
                              f"not {loc.describe(version)}")
    missing = [f for f in DATA_FILES if f not in m.files]
    if missing:
        raise CorruptArtifact(f"{path} lists no {missing}")
    return m


def list_versions(store: StoreConfig, user: str, model_fp: str) -> list[Manifest]:
    """Complete versions of (user, model), oldest first (by creation time)."""
    loc = Location(store, user, model_fp)
    found = []
    for name in loc.blobs.listdir(loc.dir):
        if not VERSION_RE.fullmatch(name):
            continue
        try:
            found.append(manifest_at(loc, name))
        except MissingManifest:
            continue  # unfinished
        except ArtifactError as exc:
            log.warning("skipping damaged version: %s", exc)
    return sorted(found, key=lambda m: (m.created, m.version))


def list_users(store: StoreConfig) -> list[str]:
    """User ids with a folder under the store (long hashed ids are read from a manifest)."""
    blobs = open_blobs(store)
    users = []
    for name in blobs.listdir(blobs.join("users")):
        try:
            user = user_from_dirname(name)
        except ValueError:  # not a name this store made
            continue
        if user is None:
            user = _user_from_manifests(store, blobs, name)
        if user is not None and user_dirname(user) == name:
            users.append(user)
    return sorted(users)


def _user_from_manifests(store: StoreConfig, blobs: Any, name: str) -> str | None:
    for fp in blobs.listdir(blobs.join("users", name)):
        for v in blobs.listdir(blobs.join("users", name, fp)):
            try:
                return Manifest.from_json(blobs.read_bytes(
                    blobs.join("users", name, fp, v, MANIFEST_FILE))).user
            except (FileNotFoundError, ValueError):
                continue
    return None


def list_models(store: StoreConfig, user: str) -> list[str]:
    """Model fingerprints that have a folder for ``user``."""
    blobs = open_blobs(store)
    return blobs.listdir(blobs.join("users", user_dirname(user)))


def verify_version(store: StoreConfig, user: str, model_fp: str, version: str = "latest") -> Manifest:
    """Check every file of a version against the manifest (sizes, then full checksums)."""
    loc = Location(store, user, model_fp)
    version = resolve_version(store, user, model_fp, version)
    m = manifest_at(loc, version)
    for name in m.files:
        check_size(loc, m, name)
    for name, entry in m.files.items():
        check_digest(loc, m, name, loc.blobs.hash_file(loc.file(version, name), entry.bytes))
    return m


def read_facts(store: StoreConfig, user: str, model_fp: str, version: str = "latest") -> pa.Table:
    """The facts table of a version, checksum-verified."""
    loc = Location(store, user, model_fp)
    version = resolve_version(store, user, model_fp, version)
    m = manifest_at(loc, version)
    check_size(loc, m, FACTS_FILE)
    path = loc.file(version, FACTS_FILE)
    try:
        data = loc.blobs.read_bytes(path)
    except FileNotFoundError:
        raise TruncatedArtifact(f"{path} is missing ({loc.describe(version)})") from None
    import xxhash

    check_digest(loc, m, FACTS_FILE, xxhash.xxh3_128_hexdigest(data))
    try:
        table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
    except pa.ArrowException as exc:
        raise CorruptArtifact(f"{path}: not a readable Arrow file: {exc}") from exc
    try:
        check_schema(table.schema, facts_schema.NAME, facts_schema.VERSION)
    except SchemaVersionError as exc:
        raise ArtifactSchemaError(f"{path}: {exc}") from exc
    return table


def check_size(loc: Location, m: Manifest, name: str) -> None:
    """:class:`TruncatedArtifact` unless file ``name`` exists with the manifest's size."""
    path = loc.file(m.version, name)
    size = loc.blobs.size(path)
    want = m.files[name].bytes
    if size is None:
        raise TruncatedArtifact(f"{path} is missing ({loc.describe(m.version)})")
    if size != want:
        raise TruncatedArtifact(f"{path} is {size} bytes; the manifest says {want} "
                                "(truncated or overwritten)")


def check_digest(loc: Location, m: Manifest, name: str, digest: str) -> None:
    """:class:`ChecksumError` unless ``digest`` is the manifest's xxh3-128 of ``name``."""
    want = m.files[name].xxh3_128
    if digest != want:
        raise ChecksumError(f"{loc.file(m.version, name)}: xxh3-128 {digest} differs from the "
                            f"manifest's {want} (the file is damaged)")


# ------------------------------------------------------------------------------- publish


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


# ------------------------------------------------------------------------------------ gc


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


def open_fact_table(store: StoreConfig, user: str, model_fp: str, version: str = "latest") -> Any:
    """The LanceDB fact table of a version (checked out at its tag: read-only)."""
    loc = Location(store, user, model_fp)
    version = resolve_version(store, user, model_fp, version)
    try:
        table = fact_table.connect(store, loc).open_table(fact_table.TABLE)
        table.checkout(version)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        raise ArtifactNotFound(f"{loc.describe(version)}: no fact embeddings in "
                               f"{loc.lance_uri} ({exc})") from exc
    return table
