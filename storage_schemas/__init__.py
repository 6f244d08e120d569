"""Arrow schemas of everything InferScale stores, each with its own schema version.

Every schema carries ``inferscale.schema`` (name) and ``inferscale.schema_version`` in its
metadata. Readers call :func:`check_schema`, which refuses unknown names and newer
versions with :class:`SchemaVersionError` instead of misreading them.
"""

from storage_schemas.common import SchemaVersionError, check_schema, schema_meta

__all__ = ["SchemaVersionError", "check_schema", "schema_meta"]
