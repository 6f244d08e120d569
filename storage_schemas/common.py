"""Schema identity: name and version in Arrow metadata, and the reader's check."""

from __future__ import annotations

import pyarrow as pa

NAME_KEY = b"inferscale.schema"
VERSION_KEY = b"inferscale.schema_version"


class SchemaVersionError(ValueError):
    """Data written under a schema this code does not know (unknown name or newer version)."""


def schema_meta(name: str, version: int, extra: dict[str, str] | None = None) -> dict[bytes, bytes]:
    meta = {NAME_KEY: name.encode(), VERSION_KEY: str(version).encode()}
    for k, v in (extra or {}).items():
        meta[k.encode()] = v.encode()
    return meta


def check_schema(schema: pa.Schema, name: str, supported_version: int) -> int:
    """Return the stored version of ``schema`` or raise :class:`SchemaVersionError`."""
    meta = schema.metadata or {}
    got_name = meta.get(NAME_KEY, b"").decode()
    if got_name != name:
        raise SchemaVersionError(f"expected a {name!r} table, found schema {got_name or 'unnamed'!r}")
    try:
        version = int(meta.get(VERSION_KEY, b""))
    except ValueError as exc:
        raise SchemaVersionError(f"{name}: unreadable schema version") from exc
    if version > supported_version:
        raise SchemaVersionError(
            f"{name} schema version {version} is newer than this InferScale supports "
            f"({supported_version}); upgrade InferScale to read it"
        )
    if version < 1:
        raise SchemaVersionError(f"{name}: invalid schema version {version}")
    return version
