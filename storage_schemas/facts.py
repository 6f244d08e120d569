"""Memory facts: one row per fact, with its source turn, fixed token ids and embedding."""

import pyarrow as pa

from storage_schemas.common import schema_meta

NAME = "facts"
VERSION = 1


def schema(embedding_dim: int) -> pa.Schema:
    """Facts schema for embeddings of ``embedding_dim`` floats."""
    return pa.schema(
        [
            pa.field("fact_id", pa.string(), nullable=False),  # content-derived, stable
            pa.field("user", pa.string(), nullable=False),
            pa.field("source_turn_id", pa.string(), nullable=False),
            pa.field("source_index", pa.int32(), nullable=False),  # turn_index of the source
            pa.field("text", pa.string(), nullable=False),
            pa.field("token_ids", pa.list_(pa.int32()), nullable=False),  # tokenized alone
            pa.field("embedding", pa.list_(pa.float32(), embedding_dim), nullable=False),
        ],
        metadata=schema_meta(NAME, VERSION, {"inferscale.embedding_dim": str(embedding_dim)}),
    )
