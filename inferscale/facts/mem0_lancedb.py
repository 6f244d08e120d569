"""LanceDB as a Mem0 vector store, registered under the provider name ``lancedb``.

Mem0 2.2.1 has no registration API for vector stores: :func:`register` adds the provider
to ``VectorStoreFactory.provider_to_class`` and to ``VectorStoreConfig``'s provider
configs, and makes this module importable as ``mem0.configs.vector_stores.lancedb`` (the
path ``VectorStoreConfig`` imports the config class from). It is idempotent; importing
this module calls it.

One :class:`LanceDBStore` is one collection = one LanceDB table in the database at
``uri`` (a local directory or ``s3://bucket/prefix`` with ``storage_options``); Mem0 opens
several (``<name>``, ``<name>_entities``), each its own table in the same database.
Rows: ``id`` (string, marked as the unenforced primary key so concurrent ``merge_insert``
on new keys cannot duplicate rows), ``vector`` (fixed-size float32), ``payload`` (the
Mem0 payload as JSON) and the scope columns ``user_id``, ``agent_id``, ``run_id``, copied
from the payload so that scope filters run as SQL prefilters.

Search is exact (no vector index is ever built: brute force over the filtered rows) with
the collection's metric; scores are similarities, higher = closer: cosine and dot give
``1 - distance`` (the cosine similarity, resp. the inner product), l2 gives
``1 / (1 + distance)``.

Filters: Mem0's forms — ``{key: value}``, ``{key: [values]}`` (any of),
``{key: {"eq"|"ne"|"gt"|"gte"|"lt"|"lte"|"in"|"nin"|"contains"|"icontains": v}}``,
``{"$or": [...]}``, ``{"$not": [...]}`` and ``AND``/``OR``/``NOT`` lists — on any payload key.
Every value compares literally: Mem0's ``{key: "*"}`` wildcard is not supported, because
a user id is data (a log's user ``*`` must see and delete only its own memories, never
everyone's), so ``"*"`` matches the value ``"*"`` like any other string. Equalities on
scope columns run in LanceDB as typed expressions (:mod:`lancedb.expr`) whose values are
bound literals, never SQL text built from data; so do lookups by row id. Anything else
is evaluated on the payload in Python.

Mem0 is imported with ``MEM0_TELEMETRY=False`` and
``MEM0_DIR=$TMPDIR/inferscale-mem0`` unless the caller set them (Mem0 reads both at import
and writes ``config.json`` there).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import uuid
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from lancedb.expr import Expr, col, lit
from pydantic import BaseModel, ConfigDict, Field, field_validator

os.environ.setdefault("MEM0_TELEMETRY", "False")  # both read by mem0 at import time
os.environ.setdefault("MEM0_DIR", os.path.join(tempfile.gettempdir(), "inferscale-mem0"))

from mem0.vector_stores.base import VectorStoreBase  # noqa: E402

log = logging.getLogger(__name__)

PROVIDER = "lancedb"
PK_METADATA = {b"lance-schema:unenforced-primary-key": b"true"}
SCOPE_KEYS = ("user_id", "agent_id", "run_id")
_OPS = {"eq", "ne", "gt", "gte", "lt", "lte", "in", "nin", "contains", "icontains"}


class OutputData(BaseModel):
    """One row as Mem0 expects it: ``.id``, ``.score`` (None outside search), ``.payload``."""

    id: str | None
    score: float | None
    payload: dict | None


class LanceDBConfig(BaseModel):
    """Config of one collection, as Mem0's ``vector_store.config`` dict."""

    model_config = ConfigDict(extra="forbid")

    collection_name: str = "mem0"
    uri: str = Field(..., description="LanceDB database: local directory or s3://bucket/prefix")
    storage_options: dict[str, str] | None = None
    embedding_model_dims: int = Field(384, ge=1)
    distance: Literal["cosine", "dot", "l2"] = "cosine"

    @field_validator("collection_name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v or not all(c.isalnum() or c in "_-." for c in v):
            raise ValueError(f"collection name {v!r}: use letters, digits, '_', '-', '.'")
        return v


class LanceDBStore(VectorStoreBase):
    """Mem0 vector store over one LanceDB table (see the module docstring)."""

    def __init__(self, collection_name: str = "mem0", uri: str = "", storage_options=None,
                 embedding_model_dims: int = 384, distance: str = "cosine"):
        cfg = LanceDBConfig(collection_name=collection_name, uri=uri,
                            storage_options=storage_options,
                            embedding_model_dims=embedding_model_dims, distance=distance)
        import lancedb

        self.config = cfg
        self.collection_name = cfg.collection_name
        self.embedding_model_dims = cfg.embedding_model_dims
        self.distance = cfg.distance
        self.db = lancedb.connect(cfg.uri, storage_options=cfg.storage_options or None)
        self.table = None
        self.create_col(cfg.collection_name, cfg.embedding_model_dims, cfg.distance)

    # -- collections

    def _schema(self, dims: int) -> pa.Schema:
        return pa.schema([
            pa.field("id", pa.string(), nullable=False, metadata=PK_METADATA),
            pa.field("vector", pa.list_(pa.float32(), dims), nullable=False),
            pa.field("payload", pa.string(), nullable=False),
            *(pa.field(k, pa.string(), nullable=True) for k in SCOPE_KEYS),
        ])

    def create_col(self, name, vector_size=None, distance=None):
        """Open the collection's table, creating it when missing (idempotent)."""
        dims = int(vector_size or self.embedding_model_dims)
        self.collection_name = name
        self.embedding_model_dims = dims
        if distance:
            self.distance = str(distance).lower()
        self.table = self.db.create_table(name, schema=self._schema(dims), exist_ok=True)
        stored = self.table.schema.field("vector").type.list_size
        if stored != dims:
            raise ValueError(f"collection {name!r} holds {stored}-d vectors, not {dims}-d")
        return self.table

    def list_cols(self) -> list[str]:
        names: list[str] = []
        token = None
        while True:
            resp = self.db.list_tables(page_token=token)
            names.extend(resp.tables)
            token = resp.page_token
            if not token:
                return names

    def delete_col(self):
        if self.collection_name in self.list_cols():
            self.db.drop_table(self.collection_name)
        self.table = None

    def col_info(self) -> dict:
        count = self.table.count_rows() if self.table is not None else 0
        return {"name": self.collection_name, "count": count,
                "dimension": self.embedding_model_dims, "distance": self.distance}

    def reset(self):
        log.warning("resetting collection %s", self.collection_name)
        self.delete_col()
        self.create_col(self.collection_name, self.embedding_model_dims, self.distance)

    # -- rows

    def _rows(self, vectors, payloads, ids) -> pa.Table:
        n = len(vectors)
        ids = list(ids) if ids is not None else [str(uuid.uuid4()) for _ in range(n)]
        payloads = list(payloads) if payloads is not None else [{} for _ in range(n)]
        if not (len(ids) == len(payloads) == n):
            raise ValueError("vectors, payloads and ids must have the same length")
        vec = np.asarray(vectors, dtype=np.float32).reshape(n, -1)  # [n, D]
        if vec.shape[1] != self.embedding_model_dims:
            raise ValueError(f"vectors are {vec.shape[1]}-d, collection is "
                             f"{self.embedding_model_dims}-d")
        cols = {
            "id": pa.array([str(i) for i in ids], pa.string()),
            "vector": pa.FixedSizeListArray.from_arrays(pa.array(vec.reshape(-1)),
                                                        self.embedding_model_dims),
            "payload": pa.array([json.dumps(p or {}, default=str) for p in payloads]),
        }
        for k in SCOPE_KEYS:
            cols[k] = pa.array([_scope_value(p, k) for p in payloads], pa.string())
        return pa.table(cols, schema=self._schema(self.embedding_model_dims))

    def insert(self, vectors, payloads=None, ids=None):
        """Upsert rows by id (a re-sent id replaces its row, never duplicates it)."""
        if len(vectors) == 0:
            return
        rows = self._rows(vectors, payloads, ids)
        (self.table.merge_insert("id").when_matched_update_all()
         .when_not_matched_insert_all().execute(rows))

    def delete(self, vector_id):
        self.table.delete(_id_is(vector_id))

    def update(self, vector_id, vector=None, payload=None):
        """Replace the vector and/or the payload of an existing row."""
        row = self._fetch(_id_is(vector_id), limit=1, with_vectors=True)
        if not row:
            raise ValueError(f"vector {vector_id!r} not found in {self.collection_name}")
        _, old_payload, old_vec = row[0]
        self.insert([old_vec if vector is None else vector],
                    [old_payload if payload is None else payload], [vector_id])

    def get(self, vector_id):
        row = self._fetch(_id_is(vector_id), limit=1)
        if not row:
            return None
        return OutputData(id=row[0][0], score=None, payload=row[0][1])

    def get_vectors(self, ids) -> dict[str, list[float]]:
        """id -> stored vector (an InferScale extension; Mem0 never calls it)."""
        ids = list(ids)
        if not ids:
            return {}
        where = col("id").isin([lit(str(i)) for i in ids])
        return {i: v for i, _, v in self._fetch(where, limit=None, with_vectors=True)}

    def list(self, filters=None, top_k=None):
        """Rows matching ``filters`` (at most ``top_k``), wrapped as ``[[rows]]`` like Mem0's
        other stores."""
        where, rest = _split_filters(filters)
        rows = self._fetch(where, limit=None if rest else top_k)
        out = [OutputData(id=i, score=None, payload=p) for i, p, _ in rows
               if _matches(p, rest)]
        return [out[:top_k] if top_k is not None else out]

    def search(self, query, vectors, top_k=5, filters=None):
        """Exact nearest rows to ``vectors`` (one query vector) among those matching
        ``filters``; best first."""
        if self.table is None or top_k <= 0:
            return []
        q = np.asarray(vectors, dtype=np.float32).reshape(-1)  # [D]
        where, rest = _split_filters(filters)
        builder = self.table.search(q, vector_column_name="vector").distance_type(self.distance)
        if where is not None:
            builder = builder.where(where, prefilter=True)
        # payload filters run after the search: fetch every row (an upper bound on matches)
        limit = top_k if not rest else max(self.table.count_rows(), 1)
        tbl = builder.select(["id", "payload", "_distance"]).limit(limit).to_arrow()
        out = []
        for i, p, d in zip(tbl["id"].to_pylist(), tbl["payload"].to_pylist(),
                           tbl["_distance"].to_pylist()):
            payload = json.loads(p)
            if rest and not _matches(payload, rest):
                continue
            out.append(OutputData(id=i, score=self._score(d), payload=payload))
            if len(out) >= top_k:
                break
        return out

    def _score(self, distance: float) -> float:
        if self.distance == "l2":
            return 1.0 / (1.0 + float(distance))
        return 1.0 - float(distance)

    def _fetch(self, where: Expr | None, limit: int | None, with_vectors: bool = False):
        cols = ["id", "payload"] + (["vector"] if with_vectors else [])
        q = self.table.search().select(cols)
        if where is not None:
            q = q.where(where)
        tbl = q.limit(limit).to_arrow()
        vecs = tbl["vector"].to_pylist() if with_vectors else [None] * tbl.num_rows
        return [(i, json.loads(p), v) for i, p, v in
                zip(tbl["id"].to_pylist(), tbl["payload"].to_pylist(), vecs)]


# ------------------------------------------------------------------------------- filters


def _scope_value(payload: dict | None, key: str) -> str | None:
    v = (payload or {}).get(key)
    return None if v is None else str(v)


def _id_is(vector_id: Any) -> Expr:
    return col("id") == lit(str(vector_id))


def _split_filters(filters: dict | None) -> tuple[Expr | None, dict]:
    """Mem0 filters -> (a LanceDB expression over the scope columns, its values bound
    literals; what must still be checked on payloads). Both compare literally."""
    if not filters:
        return None, {}
    where, rest = None, {}
    for key, value in filters.items():
        if key in SCOPE_KEYS and isinstance(value, (str, int)) and not isinstance(value, bool):
            term = col(key) == lit(str(value))
            where = term if where is None else where & term
        else:
            rest[key] = value
    return where, rest


def _matches(payload: dict, filters: dict) -> bool:
    """Evaluate Mem0-style filters on one payload (all keys must hold)."""
    for key, cond in (filters or {}).items():
        if key in ("$or", "OR"):
            if not any(_matches(payload, c) for c in cond):
                return False
        elif key in ("$not", "NOT"):
            if any(_matches(payload, c) for c in cond):
                return False
        elif key in ("$and", "AND"):
            if not all(_matches(payload, c) for c in cond):
                return False
        elif not _holds(payload, key, cond):
            return False
    return True


def _holds(payload: dict, key: str, cond: Any) -> bool:
    present = key in payload
    value = payload.get(key)
    if isinstance(cond, list):
        return present and value in cond
    if isinstance(cond, dict) and cond and set(cond) <= _OPS:
        return all(_op(value, present, op, arg) for op, arg in cond.items())
    return present and value == cond


def _op(value: Any, present: bool, op: str, arg: Any) -> bool:
    if op == "ne":
        return not present or value != arg
    if op == "nin":
        return not present or value not in arg
    if not present:
        return False
    try:
        if op == "eq":
            return value == arg
        if op == "in":
            return value in arg
        if op == "gt":
            return value > arg
        if op == "gte":
            return value >= arg
        if op == "lt":
            return value < arg
        if op == "lte":
            return value <= arg
        if op == "contains":
            return str(arg) in str(value)
        if op == "icontains":
            return str(arg).lower() in str(value).lower()
    except TypeError:
        return False
    raise ValueError(f"unsupported filter operator {op!r}")


# ---------------------------------------------------------------------------- registration


def register() -> None:
    """Make ``lancedb`` a Mem0 vector-store provider (idempotent)."""
    from mem0.utils.factory import VectorStoreFactory
    from mem0.vector_stores.configs import VectorStoreConfig

    VectorStoreFactory.provider_to_class[PROVIDER] = f"{__name__}.LanceDBStore"
    private = VectorStoreConfig.__private_attributes__["_provider_configs"]
    private.default[PROVIDER] = "LanceDBConfig"
    sys.modules.setdefault(f"mem0.configs.vector_stores.{PROVIDER}", sys.modules[__name__])


register()
