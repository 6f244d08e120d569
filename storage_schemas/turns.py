"""Conversation turns: one row per validated turn of one user's conversation log."""

import pyarrow as pa

from storage_schemas.common import schema_meta

NAME = "turns"
VERSION = 1

SCHEMA = pa.schema(
    [
        pa.field("user", pa.string(), nullable=False),
        pa.field("session", pa.string(), nullable=False),
        pa.field("turn_id", pa.string(), nullable=False),  # unique within a user, e.g. "D3:7"
        pa.field("turn_index", pa.int32(), nullable=False),  # 0-based order in the conversation
        pa.field("speaker", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("timestamp", pa.string(), nullable=True),  # ISO-8601 session date/time
    ],
    metadata=schema_meta(NAME, VERSION),
)
