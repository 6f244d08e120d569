"""Artifact manifest: the JSON record of one published version, and its lineage.

One ``manifest.json`` per version, written last (after every data file is written and
verified), so its presence means the version is complete. It records the schema
version, the user, the model fingerprint, the encoder config, the version hash and its
parents (log and facts content hashes), byte sizes and xxh3-128 checksums of every file,
the name each file is stored under, the KV layout, counts and the creation time. The
manifest checksums itself: the ``checksum`` field is the xxh3-128 of the canonical JSON
of every other field, so a damaged manifest is reported as damaged instead of
misleading a reader.

Written by ``inferscale.artifacts.publish.publish``; read by every reader (listing, hydration,
the Prefect artifact that shows lineage).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import xxhash

from storage_schemas.common import SchemaVersionError

NAME = "manifest"
VERSION = 2  # 2: files carry ``stored_as`` (publish-unique data file names)

# The logical names of a version's data files: the only keys ``files`` may have (schema-1
# manifests store the files under these names, so a key is a path: nothing else is read).
DATA_FILES = ("facts.arrow", "kv.arrow")

_STORED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class ManifestError(ValueError):
    """A manifest that cannot be parsed or misses fields."""


class ManifestChecksumError(ManifestError):
    """A manifest whose self-checksum does not match its content."""


@dataclass(frozen=True)
class FileEntry:
    """Size, checksum and stored name of one file of a version.

    ``stored_as`` is the object's name inside the version folder (``kv.<nonce>.arrow``:
    every publish attempt writes its own names, so racing publishers never overwrite
    each other's files); ``None`` in schema-1 manifests, whose files are stored under
    their logical names (``kv.arrow``)."""

    bytes: int
    xxh3_128: str  # hex digest
    stored_as: str | None = None

    def stored_name(self, logical: str) -> str:
        return self.stored_as or logical


@dataclass(frozen=True)
class Manifest:
    """One published version. ``files`` maps file name -> :class:`FileEntry`."""

    user: str
    model_fingerprint: str
    version: str
    encoder_config: dict[str, Any]
    parents: dict[str, str]  # {"log": log content hash, "facts": facts content hash}
    files: dict[str, FileEntry]
    counts: dict[str, int]  # {"facts", "chunks", "tokens"}
    kv: dict[str, Any]  # dtype, layers, kv_heads, head_dim, layout, slab_offset, slab_bytes
    created: str  # ISO-8601 UTC, microseconds
    producer: str = ""
    schema_version: int = field(default=VERSION)

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        for entry in body["files"].values():
            if entry["stored_as"] is None:
                del entry["stored_as"]
        body["schema"] = NAME
        body["checksum"] = _checksum(body)
        return body

    def to_json(self) -> bytes:
        return (json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> "Manifest":
        """Parse a manifest; :class:`SchemaVersionError` for an unknown or newer schema,
        :class:`ManifestChecksumError` when damaged, :class:`ManifestError` when malformed
        (a field missing, unexpected or not of its type: :func:`_check_types`)."""
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, 5,000-digit
            # integers, nesting deeper than the parser's stack
            raise ManifestError(f"not valid JSON: {type(exc).__name__}: {exc}"[:300]) from exc
        if not isinstance(body, dict):
            raise ManifestError("manifest is not a JSON object")
        if body.get("schema") != NAME:
            raise SchemaVersionError(f"expected a {NAME!r} document, found {body.get('schema')!r}")
        version = body.get("schema_version")
        if not isinstance(version, int) or version < 1:
            raise SchemaVersionError(f"{NAME}: invalid schema version {version!r}")
        if version > VERSION:
            raise SchemaVersionError(
                f"{NAME} schema version {version} is newer than this InferScale supports "
                f"({VERSION}); upgrade InferScale to read it"
            )
        stored = body.pop("checksum", None)
        if stored != _checksum({**body}):
            raise ManifestChecksumError("manifest checksum does not match its content")
        body.pop("schema")
        _check_types(body)
        try:
            files = {name: FileEntry(**entry) for name, entry in body.pop("files").items()}
            if sorted(files) != sorted(DATA_FILES):
                names = ", ".join(repr(n)[:80] for n in sorted(files)[:5])
                raise ManifestError(f"files must be exactly {list(DATA_FILES)}, not [{names}]")
            manifest = cls(files=files, **body)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"manifest fields missing or unexpected: {exc}") from exc
        for name, entry in manifest.files.items():
            if not isinstance(entry.bytes, int) or entry.bytes < 0 or not isinstance(entry.xxh3_128, str):
                raise ManifestError(f"bad file entry for {name!r}: {entry}")
            stored = entry.stored_as
            if stored is not None and (not isinstance(stored, str) or ".." in stored
                                       or not _STORED_NAME.fullmatch(stored)):
                raise ManifestError(f"file {name!r} is stored as {stored!r}, not a plain file "
                                    "name inside the version folder")
        return manifest


# What each field of a manifest is: a reader may rely on these once it is parsed.
_STRINGS = ("user", "model_fingerprint", "version", "created", "producer")
_OBJECTS = ("encoder_config", "parents", "files", "counts", "kv")
# ``kv``: the keys every version has (since schema 1) and those some have
_KV_DIMS = ("layers", "kv_heads", "head_dim")  # >= 1
_KV_SIZES = ("slab_offset", "slab_bytes")  # >= 0
_KV_STRINGS = ("dtype",)
_KV_OPTIONAL_STRINGS = ("layout", "scales", "index_xxh3")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {repr(value)[:40]}"


def _check_types(body: dict[str, Any]) -> None:
    """:class:`ManifestError` unless every field has its JSON type (a missing field is
    left to the constructor): strings, objects, ``parents`` an object of strings,
    ``counts`` one of non-negative integers, ``kv`` with its dimensions, sizes and dtype.
    A damaged or forged manifest is refused here, once, instead of breaking whichever
    reader meets the field first (planning, listing, gc, hydration)."""
    for name in _STRINGS:
        if name in body and not isinstance(body[name], str):
            raise ManifestError(f"{name} must be a string, not {_shown(body[name])}")
    for name in _OBJECTS:
        if name in body and not isinstance(body[name], dict):
            raise ManifestError(f"{name} must be an object, not {_shown(body[name])}")
    for name in ("user", "model_fingerprint", "version"):
        if name in body and not body[name]:
            raise ManifestError(f"{name} must not be empty")
    for key, value in body.get("parents", {}).items():
        if not isinstance(value, str):
            raise ManifestError(f"parent {key!r:.40} must be a string, not {_shown(value)}")
    for key, value in body.get("counts", {}).items():
        if not _is_int(value) or value < 0:
            raise ManifestError(f"count {key!r:.40} must be a non-negative integer, not "
                                f"{_shown(value)}")
    for key, entry in body.get("files", {}).items():
        if not isinstance(entry, dict):
            raise ManifestError(f"file entry {key!r:.40} must be an object, not {_shown(entry)}")
    if "kv" in body:
        kv = body["kv"]
        for key in _KV_DIMS + _KV_SIZES + _KV_STRINGS:
            if key not in kv:
                raise ManifestError(f"kv has no {key!r}")
        for key in _KV_DIMS + _KV_SIZES:
            low = 1 if key in _KV_DIMS else 0
            if not _is_int(kv[key]) or kv[key] < low:
                raise ManifestError(f"kv {key} must be an integer >= {low}, not "
                                    f"{_shown(kv[key])}")
        for key in _KV_STRINGS + _KV_OPTIONAL_STRINGS:
            if key in kv and not isinstance(kv[key], str):
                raise ManifestError(f"kv {key} must be a string, not {_shown(kv[key])}")
        if "key_calibration" in kv and not isinstance(kv["key_calibration"], dict):
            raise ManifestError(f"kv key_calibration must be an object, not "
                                f"{_shown(kv['key_calibration'])}")


def _checksum(body: dict[str, Any]) -> str:
    body = {k: v for k, v in body.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return xxhash.xxh3_128_hexdigest(canonical.encode())
