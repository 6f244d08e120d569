"""Versioned, content-addressed memory artifacts per (user, model): publish, read, gc.

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
-> ``LATEST`` (compare-and-swap: it names the publish of the newest inputs, see
:func:`publish`) -> optional gc. A version without a manifest is unfinished and
invisible; re-running the publish completes it under the same id.

Fact embeddings also go into a LanceDB table per (user, model) beside the versions
(:mod:`inferscale.fact_table`), tagged with each version id, so ``open_fact_table`` sees
exactly the facts of a version. lancedb is imported only when used.

Callers: the encode flow/task (``publish``, ``gc``), the CLI and flows (listing,
lineage), ``inferscale.hydrate`` (``read_manifest``, ``data_path``) and the retrieval
side (``read_facts``, ``open_fact_table``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
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
    "resolve_version", "set_latest", "verify_version", "version_id",
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
    created: bool  # False: the version existed and verified (nothing written but LATEST)
    manifest: Manifest
    removed: tuple[str, ...] = ()  # versions garbage-collected afterwards
    latest: str = ""  # what LATEST names afterwards (another version when newer inputs won)


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
    return _parse_latest(loc, data)[0]


def _parse_latest(loc: Location, data: bytes) -> tuple[str, datetime | None]:
    """``LATEST`` is the version id on its first line, then (since manifest schema 2)
    ``{"inputs_at": ISO-8601}``: when the inputs of the publish that set it were taken."""
    first, _, rest = data.decode("ascii", "replace").partition("\n")
    version = first.strip()
    if not VERSION_RE.fullmatch(version):
        raise CorruptArtifact(f"{loc.latest} holds {data[:80]!r}, not a version id")
    try:
        at = datetime.fromisoformat(json.loads(rest)["inputs_at"])
    except (ValueError, KeyError, TypeError):
        return version, None  # a LATEST written by an older InferScale (or a person)
    return version, at if at.tzinfo is not None else None


def _latest_bytes(version: str, inputs_at: datetime) -> bytes:
    return (version + "\n" + json.dumps({"inputs_at": inputs_at.isoformat(
        timespec="microseconds")}) + "\n").encode()


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
    m = manifest_at(loc, resolve_version(store, user, model_fp, version))
    _verify_files(loc, m)
    return m


def read_facts(store: StoreConfig, user: str, model_fp: str, version: str = "latest") -> pa.Table:
    """The facts table of a version, checksum-verified."""
    loc = Location(store, user, model_fp)
    version = resolve_version(store, user, model_fp, version)
    m = manifest_at(loc, version)
    check_size(loc, m, FACTS_FILE)
    path = data_path(loc, m, FACTS_FILE)
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


def data_path(loc: Location, m: Manifest, name: str) -> str:
    """Where file ``name`` (``kv.arrow``, ``facts.arrow``) of version ``m`` is stored."""
    return loc.file(m.version, m.files[name].stored_name(name))


def check_size(loc: Location, m: Manifest, name: str) -> None:
    """:class:`TruncatedArtifact` unless file ``name`` exists with the manifest's size."""
    path = data_path(loc, m, name)
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
        raise ChecksumError(f"{data_path(loc, m, name)}: xxh3-128 {digest} differs from the "
                            f"manifest's {want} (the file is damaged)")


# ------------------------------------------------------------------------------- publish


def publish(store: StoreConfig, user: str, encoded: EncodedMemoryLike, facts: pa.Table,
            lineage: Lineage, *, keep: int | None = None, embeddings: bool = True,
            inputs_at: datetime | None = None) -> PublishResult:
    """Publish one (user, model) version from the encoder's output and the facts table.

    ``facts`` has :func:`storage_schemas.facts.schema` for its embedding size, rows of
    ``user`` only; ``encoded.chunks`` are ``"prefix"`` then exactly one chunk per fact.
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
    inputs_at = _utc(inputs_at)
    facts = _check_facts(facts, user)
    _check_chunks_match_facts([c.chunk_id for c in encoded.chunks], facts)
    if embeddings:
        fact_table.require_lancedb()  # fail before writing anything
    version = version_id(user, lineage, model_fp, encoder_config)

    existing, damage = _existing(loc, version)
    if existing is not None:  # same inputs, verified: the KV is not even laid out again
        if embeddings:
            fact_table.ensure_tag(store, loc, version, facts)
        latest = _point_latest(loc, version, inputs_at)
        if latest != version or _readable(loc, version):
            return PublishResult(version, False, existing,
                                 _maybe_gc(store, user, model_fp, keep), latest)
        # a concurrent gc removed it (an old version) while LATEST moved back to it
        log.warning("%s was removed while LATEST moved to it; writing it again",
                    loc.describe(version))
    if damage is not None:
        log.warning("%s does not verify; publishing it again: %s", loc.describe(version), damage)

    manifest = _write_files(loc, version, encoded, facts, lineage, encoder_config)
    if embeddings:
        fact_table.index_embeddings(store, user, model_fp, version, facts)
    manifest, created = _commit_manifest(loc, manifest, replace=damage is not None)
    latest = _point_latest(loc, version, inputs_at)
    return PublishResult(version, created, manifest, _maybe_gc(store, user, model_fp, keep),
                         latest)


def set_latest(store: StoreConfig, user: str, model_fp: str, version: str,
               inputs_at: datetime | None = None) -> str:
    """Point ``LATEST`` at a complete, verified ``version`` (a rollback: with the default
    ``inputs_at`` of now it wins over every earlier publish). Returns what LATEST names."""
    loc = Location(store, user, model_fp)
    verify_version(store, user, model_fp, version)
    return _point_latest(loc, version, _utc(inputs_at))


def _write_files(loc: Location, version: str, encoded: EncodedMemoryLike, facts: pa.Table,
                 lineage: Lineage, encoder_config: dict[str, Any]) -> Manifest:
    """Write the data files under names of this attempt only, re-read and verify them;
    returns the manifest that describes them (not yet stored)."""
    layout, batch, slab_buffer = build_kv_batch(encoded, loc.model_fp)
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
            "slab_offset": slab_offset, "slab_bytes": layout.slab_bytes},
        created=datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        producer=f"inferscale {__version__}",
    )
    _verify_files(loc, manifest)  # what is stored, not what we meant to store
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


def _verify_files(loc: Location, m: Manifest) -> None:
    """Sizes, then full xxh3-128 checksums of every data file of ``m``."""
    for name in m.files:
        check_size(loc, m, name)
    for name, entry in m.files.items():
        check_digest(loc, m, name, loc.blobs.hash_file(data_path(loc, m, name), entry.bytes))


def _existing(loc: Location, version: str) -> tuple[Manifest | None, ArtifactError | None]:
    """(manifest, None) for a complete version whose files verify (sizes and checksums);
    (None, None) when it is not there or unfinished; (None, the error) when its manifest
    or files are damaged: the publish then writes it again (a repair). A manifest of a
    newer schema or another model is left alone (raised)."""
    try:
        m = manifest_at(loc, version)
        _verify_files(loc, m)
    except (ArtifactNotFound, MissingManifest):
        return None, None
    except (TruncatedArtifact, ChecksumError, CorruptArtifact) as exc:
        return None, exc
    return m, None


def _point_latest(loc: Location, version: str, inputs_at: datetime) -> str:
    """Compare-and-swap ``LATEST`` to ``version`` unless it names ``version`` already or
    the publish of newer inputs (a later ``inputs_at``; equal times: the larger version
    id) that is still readable. Returns the version LATEST names afterwards."""
    def decide(current: bytes | None) -> bytes | None:
        if current is not None:
            try:
                cur, cur_at = _parse_latest(loc, current)
            except CorruptArtifact:
                cur, cur_at = None, None  # a damaged LATEST is replaced
            if cur == version:
                return None  # already named: an unchanged publish writes nothing
            if cur is not None and cur_at is not None and (cur_at, cur) > (inputs_at, version):
                if _readable(loc, cur):
                    return None
        return _latest_bytes(version, inputs_at)

    final = loc.blobs.swap(loc.latest, decide)
    return _parse_latest(loc, final)[0] if final is not None else version


def _readable(loc: Location, version: str) -> bool:
    """Whether ``version``'s manifest reads (a LATEST naming a removed or damaged version
    gives way to any complete one)."""
    try:
        manifest_at(loc, version)
    except ArtifactSchemaError:
        return True  # written by a newer InferScale: valid, not ours to displace
    except ArtifactError:
        return False
    return True


def _utc(when: datetime | None) -> datetime:
    if when is None:
        return datetime.now(timezone.utc)
    if not isinstance(when, datetime) or when.tzinfo is None:
        raise InvalidArtifactInput(f"inputs_at must be a timezone-aware datetime, got {when!r}")
    return when.astimezone(timezone.utc)


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
    chunk_ids = set(chunk_ids) - {kv_schema.PREFIX}
    fact_ids = set(facts.column("fact_id").to_pylist())
    if chunk_ids != fact_ids:
        missing, extra = sorted(fact_ids - chunk_ids)[:5], sorted(chunk_ids - fact_ids)[:5]
        raise InvalidArtifactInput(f"KV chunks and facts disagree: facts without KV {missing}, "
                                   f"KV chunks without a fact {extra}")


# ------------------------------------------------------------------------------------ gc


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
