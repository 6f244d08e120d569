"""Artifact store: where artifact files live, their names, the store config and errors.

Layout under one root (a local directory, or ``s3://bucket/prefix`` through s3fs, or
any fsspec URL whose filesystem is installed)::

    {root}/users/{user}/{model_fp}/{version}/facts.<nonce>.arrow  kv.<nonce>.arrow  manifest.json
    {root}/users/{user}/{model_fp}/LATEST     the published version's id (+ its inputs' time)
    {root}/users/{user}/{model_fp}/lance/     LanceDB database of fact embeddings

``facts.arrow`` and ``kv.arrow`` (``FACTS_FILE``, ``KV_FILE``) are the logical names of a
version's data files; each publish stores them under names of its own, which the manifest
records (:func:`inferscale.artifacts.read.data_path`). ``LATEST`` holds the version id on
its first line and ``{"inputs_at": ISO-8601}`` on the second (:func:`parse_latest`,
:func:`latest_bytes`; the rule that moves it is :mod:`inferscale.artifacts.latest`).

User ids follow the one rule of :func:`inferscale.types.check_user_id` (anything else is
:class:`InvalidUserId`) and become one safe path component each (:func:`user_dirname`):
ids made of ``[a-z0-9._-]`` (starting with a letter or digit, at most 100 characters)
are used as they are; any other id (upper case, unicode...) becomes ``_`` + lowercase
base32 of its UTF-8 bytes, or ``__`` + sha256 hex when that would exceed 200 characters.
The three forms cannot collide, are safe on case-insensitive filesystems, and never
contain ``/`` or start with ``.``. The manifest keeps the real id.

Every error of the store derives from :class:`ArtifactError` and names the file and the
user/model/version it is about. File operations are in :mod:`inferscale.artifacts.blobs`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import fsspec

from inferscale.types import VERSION_RE, InvalidUserIdError, check_user_id
from storage_schemas.common import SchemaVersionError
from storage_schemas.manifest import DATA_FILES

FACTS_FILE, KV_FILE = DATA_FILES
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "LATEST"
LANCE_DIR = "lance"

_PLAIN_USER = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")
_B32_MAX_BYTES = 120  # base32 of 120 bytes = 192 characters
_MODEL_FP = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


# ---------------------------------------------------------------------------------- errors


class ArtifactError(Exception):
    """Base of every artifact store error."""


class InvalidStoreConfig(ArtifactError, ValueError):
    """A store root or option that cannot be used."""


class InvalidUserId(ArtifactError, InvalidUserIdError):
    """A user id that breaks the rule of :func:`inferscale.types.check_user_id`."""


class InvalidArtifactInput(ArtifactError, ValueError):
    """Publish inputs that do not fit together (shapes, chunk ids vs facts, ...)."""


class ArtifactNotFound(ArtifactError, FileNotFoundError):
    """No such user, model, version, or no published version (no LATEST)."""


class MissingManifest(ArtifactNotFound):
    """A version folder without manifest.json: an unfinished publish or a damaged store."""


class TruncatedArtifact(ArtifactError):
    """A file of a version is missing or its size differs from the manifest's."""


class ChecksumError(ArtifactError):
    """A file's xxh3-128 differs from the manifest's (or the manifest's own checksum)."""


class FingerprintMismatch(ArtifactError):
    """An artifact made for another model than the one asking for it."""


class GeometryMismatch(ArtifactError):
    """KV whose (layers, kv_heads, head_dim) are not the serving model's: refused before
    any of it is read, whatever fingerprint it names (the same bytes per token in another
    geometry would be written through the cache's strides into other requests' blocks)."""


class CorruptArtifact(ArtifactError):
    """A file whose checksum matches but whose content breaks the format, or a bad LATEST."""


class ArtifactSchemaError(ArtifactError, SchemaVersionError):
    """A file written under a schema this code does not know (unknown name, newer version)."""


# ------------------------------------------------------------------------------- naming


def user_dirname(user: str) -> str:
    """The folder name of ``user`` (see the module docstring for the encoding)."""
    try:
        check_user_id(user)
    except InvalidUserIdError as exc:
        raise InvalidUserId(str(exc)) from None
    if _PLAIN_USER.fullmatch(user):
        return user
    raw = user.encode("utf-8")
    if len(raw) <= _B32_MAX_BYTES:
        return "_" + base64.b32encode(raw).decode().rstrip("=").lower()
    return "__" + hashlib.sha256(raw).hexdigest()


def check_model_fp(model_fp: str) -> str:
    if not isinstance(model_fp, str) or not _MODEL_FP.fullmatch(model_fp):
        raise InvalidArtifactInput(
            f"model fingerprint {model_fp!r} cannot name a folder: expected 1-128 characters "
            "of [A-Za-z0-9._-] starting with a letter or digit")
    return model_fp


def check_version(version: str) -> str:
    if not isinstance(version, str) or not VERSION_RE.fullmatch(version):
        raise ArtifactNotFound(f"{version!r} is not a version id (32 lowercase hex digits)")
    return version


def parse_latest(path: str, data: bytes) -> tuple[str, datetime | None]:
    """The content of ``LATEST`` (read from ``path``) -> (version id, ``inputs_at``):
    when the inputs of the publish that set it were taken; ``None`` for a LATEST written
    without a time (by an older InferScale, or a person). :class:`CorruptArtifact` when
    the first line is not a version id."""
    first, _, rest = data.decode("ascii", "replace").partition("\n")
    version = first.strip()
    if not VERSION_RE.fullmatch(version):
        raise CorruptArtifact(f"{path} holds {data[:80]!r}, not a version id")
    try:
        at = datetime.fromisoformat(json.loads(rest)["inputs_at"])
    except (ValueError, KeyError, TypeError):
        return version, None
    return version, at if at.tzinfo is not None else None


def latest_bytes(version: str, inputs_at: datetime) -> bytes:
    """What ``LATEST`` holds when it names ``version`` published from inputs taken at
    ``inputs_at`` (inverse of :func:`parse_latest`)."""
    return (version + "\n" + json.dumps({"inputs_at": inputs_at.isoformat(
        timespec="microseconds")}) + "\n").encode()


# ------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class StoreConfig:
    """Where artifacts live: ``root`` (local directory, ``s3://bucket/prefix`` or any
    fsspec URL) and the fsspec ``storage_options`` for it (s3fs: ``key``, ``secret``,
    ``client_kwargs={"endpoint_url": ..., "region_name": ...}``).

    ``direct_io``: a local store's reads bypass the page cache (``O_DIRECT``,
    :mod:`inferscale.artifacts.direct_io`; where the filesystem refuses it, buffered reads
    whose pages are dropped after, reported as not bypassed). Off by default: on a small
    deployment the page cache is right (users read again come from RAM at several GB/s,
    and ``O_DIRECT`` costs a copy through an aligned buffer); on when users far outnumber
    RAM, or to measure storage honestly (the load benchmark). Object stores are read by
    ranged GETs either way (no page cache there).

    Built by callers from :class:`inferscale.settings.Settings` with :meth:`from_settings`
    (``INFERSCALE_ARTIFACT_ROOT``, ``INFERSCALE_S3_*``, ``INFERSCALE_STORAGE_DIRECT_IO``),
    or directly in tests.
    """

    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    direct_io: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.root, str) or not self.root.strip():
            raise InvalidStoreConfig(f"store root must be a non-empty string, got {self.root!r}")
        if not isinstance(self.direct_io, bool):
            raise InvalidStoreConfig(f"direct_io must be true or false, got {self.direct_io!r}")
        protocol, path = fsspec.core.split_protocol(self.root.strip())
        if protocol in (None, "file", "local"):
            root = os.path.abspath(os.path.expanduser(path))
        else:
            try:
                fsspec.get_filesystem_class(protocol)
            except (ValueError, ImportError) as exc:
                raise InvalidStoreConfig(f"store root {self.root!r}: {exc}") from exc
            path = path.strip("/")
            if not path:
                raise InvalidStoreConfig(f"store root {self.root!r} names no bucket or folder")
            root = f"{protocol}://{path}"
        object.__setattr__(self, "root", root)
        object.__setattr__(self, "storage_options", dict(self.storage_options or {}))

    @classmethod
    def from_settings(cls, settings: Any) -> "StoreConfig":
        """From an :class:`inferscale.settings.Settings` (duck-typed: no pydantic import)."""
        return cls(settings.resolved_artifact_root(), settings.storage_options(),
                   direct_io=settings.storage_direct_io)

    @property
    def protocol(self) -> str:
        return fsspec.core.split_protocol(self.root)[0] or "file"

    @property
    def is_local(self) -> bool:
        return self.protocol == "file"

    def filesystem(self) -> fsspec.AbstractFileSystem:
        if self.is_local:
            return fsspec.filesystem("file")
        opts = dict(self.storage_options)
        if self.protocol in ("s3", "s3a"):
            opts.setdefault("use_listings_cache", False)  # other processes publish too
        return fsspec.filesystem(self.protocol, **opts)

    def lance_storage_options(self) -> dict[str, str]:
        """LanceDB (object_store) options equivalent to the s3fs ``storage_options``."""
        if self.protocol not in ("s3", "s3a"):
            return {}
        so = self.storage_options
        ck = so.get("client_kwargs") or {}
        out: dict[str, str] = {}
        endpoint = ck.get("endpoint_url") or so.get("endpoint_url")
        if endpoint:
            out["endpoint"] = endpoint
            if endpoint.startswith("http://"):
                out["allow_http"] = "true"
        region = ck.get("region_name") or so.get("region_name")
        if region:
            out["region"] = region
        if so.get("key"):
            out["aws_access_key_id"] = so["key"]
        if so.get("secret"):
            out["aws_secret_access_key"] = so["secret"]
        if so.get("token"):
            out["aws_session_token"] = so["token"]
        return out
