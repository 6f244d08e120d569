"""Reading published versions: LATEST, manifests, version lists, verification, the facts,
and a version's KV rows by content key (what its next version reuses).

Every reader checks what it reads against the version's manifest (schema, its own
checksum, owner, model fingerprint, file sizes; full xxh3-128 checksums where a whole
file is read) and raises an :class:`~inferscale.artifacts.layout.ArtifactError` subclass
naming the file and the user/model/version.

A version's data files are stored under names of the publish that wrote them
(``kv.<nonce>.arrow``); :func:`data_path` maps a logical name (``kv.arrow``) to the stored
one through the manifest (schema-1 manifests: the logical name itself).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import pyarrow as pa

from inferscale.artifacts import fact_table
from inferscale.artifacts.blobs import Location
from inferscale.artifacts.layout import (
    DATA_FILES, FACTS_FILE, KV_FILE, MANIFEST_FILE, VERSION_RE, ArtifactError,
    ArtifactNotFound, ArtifactSchemaError, ChecksumError, CorruptArtifact, FingerprintMismatch,
    MissingManifest, StoreConfig, TruncatedArtifact, parse_latest,
)
from inferscale.artifacts.mapped_file import map_and_hash
from inferscale.types import ChunkKV
from storage_schemas import facts as facts_schema
from storage_schemas import kv as kv_schema
from storage_schemas.common import SchemaVersionError, check_schema
from storage_schemas.manifest import Manifest, ManifestChecksumError, ManifestError

log = logging.getLogger(__name__)
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def latest_version(store: StoreConfig, user: str, model_fp: str) -> str | None:
    """The version ``LATEST`` names, or ``None`` when nothing was published."""
    loc = Location(store, user, model_fp)
    try:
        data = loc.blobs.read_bytes(loc.latest)
    except FileNotFoundError:
        return None
    return parse_latest(loc.latest, data)[0]


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


def verify_version(store: StoreConfig, user: str, model_fp: str, version: str = "latest") -> Manifest:
    """Check every file of a version against the manifest (sizes, then full checksums)."""
    loc = Location(store, user, model_fp)
    m = manifest_at(loc, resolve_version(store, user, model_fp, version))
    verify_files(loc, m)
    return m


def verify_files(loc: Location, m: Manifest) -> None:
    """Sizes, then full xxh3-128 checksums of every data file of ``m`` (the known logical
    names only, each stored inside the version folder: :func:`data_path`)."""
    for name in DATA_FILES:
        check_size(loc, m, name)
    for name in DATA_FILES:
        check_digest(loc, m, name,
                     loc.blobs.hash_file(data_path(loc, m, name), m.files[name].bytes))


def read_facts(store: StoreConfig, user: str, model_fp: str, version: str = "latest",
               manifest: Manifest | None = None) -> pa.Table:
    """The facts table of a version, checksum-verified; ``manifest``: the version's, when
    the caller has just read it (:func:`read_manifest`: not read again, the server's
    first load of a user read it twice)."""
    loc = Location(store, user, model_fp)
    version = resolve_version(store, user, model_fp, version)
    if manifest is not None and (manifest.user, manifest.version, manifest.model_fingerprint) \
            != (loc.user, version, loc.model_fp):
        raise ValueError(f"the manifest given is user {manifest.user!r}'s version "
                         f"{manifest.version} of model {manifest.model_fingerprint}, not "
                         f"{loc.describe(version)}")
    m = manifest if manifest is not None else manifest_at(loc, version)
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


def check_kv_format(manifest: Manifest) -> None:
    """:class:`ArtifactSchemaError` when the version's KV dtype or scale rule is not one
    this InferScale reads (a newer one wrote it)."""
    try:
        kv_schema.check_format(manifest.kv)
    except kv_schema.UnknownKVFormat as exc:
        raise ArtifactSchemaError(f"user {manifest.user} version {manifest.version}: "
                                  f"{exc}") from exc


def read_kv_rows(store: StoreConfig, user: str, model_fp: str,
                 version: str = "latest") -> dict[str, ChunkKV]:
    """``content key -> ChunkKV`` (rows ``[t, 2, L, H, D]`` as stored, fp8 scales) of
    every chunk of a version stored with a key: what encoding the user's next version
    reuses (:func:`inferscale.encode.encoder.encode_facts`). The kv file is read whole
    and checksum-verified before it is parsed: memory-mapped on a local store (unless it
    reads with direct I/O), read into memory from an object store; the rows are views of
    it. Raises :class:`ArtifactError` subclasses as every reader here does."""
    import torch

    from inferscale.artifacts.kv_file import parse_kv_file  # torch: only for KV

    loc = Location(store, user, model_fp)
    m = manifest_at(loc, resolve_version(store, user, model_fp, version))
    check_kv_format(m)
    check_size(loc, m, KV_FILE)
    path, size = data_path(loc, m, KV_FILE), m.files[KV_FILE].bytes
    try:
        if store.is_local and not store.direct_io:
            buf, digest = map_and_hash(path, size)
        else:
            buf = np.empty(size, dtype=np.uint8)
            digest = loc.blobs.read_into(path, size, buf, workers=4 if store.is_local else 8)
    except FileNotFoundError as exc:  # removed between the size check and the read (gc?)
        raise TruncatedArtifact(f"{path} disappeared while being read "
                                f"({loc.describe(m.version)})") from exc
    check_digest(loc, m, KV_FILE, digest)
    kv_file = parse_kv_file(buf, path, m, model_fp)
    return kv_file.rows_by_content_key(kv_file.slab(torch.from_numpy(buf)))


def data_path(loc: Location, m: Manifest, name: str) -> str:
    """Where file ``name`` (``kv.arrow``, ``facts.arrow``) of version ``m`` is stored: a
    plain file name inside the version folder, whatever the manifest says (its keys and
    stored names are checked when it is parsed; checked again here)."""
    stored = m.files[name].stored_name(name) if name in DATA_FILES else ""
    if not _PLAIN_NAME.fullmatch(stored) or ".." in stored:
        raise CorruptArtifact(f"{loc.describe(m.version)}: the manifest stores {name!r:.80} "
                              f"as {stored!r:.80}, not a file of the version folder")
    return loc.file(m.version, stored)


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
