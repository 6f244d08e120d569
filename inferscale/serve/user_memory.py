"""What the server holds per user (:class:`UserMemory`), its token ids in one array.

The server holds every cached user's token ids (400 facts of ~40 tokens) and composes
~50 chunks of them per request. As Python tuples they took ~36 bytes a token (an int
object and its slot: ~0.6 MB a user, ~1.2 GB for 2,000) and ~1 ms of GIL-held loops per
first load (the facts table's lists, their tuples, the sums of the byte count), which
the event loop's thread waits out, and dropping an evicted user freed them on that
thread. :class:`TokenTable` holds them as one array and its offsets (4 bytes a token, no
object per id, nothing the garbage collector tracks), filled from the Arrow column by
vectorized copies; a request turns only the chunks it composes into tuples.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np


class TokenTable(Mapping[str, tuple[int, ...]]):
    """``chunk id -> token ids`` (a tuple of ints) over one flat array.

    ``flat[offsets[i]:offsets[i + 1]]`` are the ids of ``ids[i]``; a repeated id names
    its last row (as a dict built from the same pairs would), in the order it first
    came."""

    __slots__ = ("_rows", "_flat", "_offsets")

    def __init__(self, ids: Sequence[str], flat: np.ndarray, offsets: np.ndarray):
        flat, offsets = np.asarray(flat), np.asarray(offsets, dtype=np.int64)
        if flat.ndim != 1 or not np.issubdtype(flat.dtype, np.integer):
            raise ValueError(f"token ids must be a flat integer array, not {flat.dtype} "
                             f"of shape {flat.shape}")
        if offsets.shape != (len(ids) + 1,) or offsets[0] != 0 or \
                offsets[-1] != len(flat) or np.any(np.diff(offsets) < 0):
            raise ValueError(f"offsets must rise from 0 to {len(flat)}, one more than the "
                             f"{len(ids)} chunk ids")
        self._rows = {c: i for i, c in enumerate(ids)}
        self._flat, self._offsets = flat, offsets

    @classmethod
    def from_lists(cls, chunks: Mapping[str, Sequence[int]]) -> "TokenTable":
        """From ``chunk id -> token ids`` (lists, tuples)."""
        ids = list(chunks)
        lengths = [len(t) for t in chunks.values()]
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter((t for ts in chunks.values() for t in ts), dtype=np.int64,
                           count=int(offsets[-1]))
        return cls(ids, _narrow(flat), offsets)

    @classmethod
    def from_arrow(cls, ids: Sequence[str], column: Any,
                   extra: Mapping[str, Sequence[int]] | None = None) -> "TokenTable":
        """From a list-of-integers Arrow column (a facts table's ``token_ids``: row ``i``
        the ids of ``ids[i]``), then ``extra`` chunks (the instruction prefix); a null
        row is refused (ValueError) as the schema forbids it."""
        import pyarrow as pa

        col = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        if len(col) != len(ids):
            raise ValueError(f"{len(col)} rows of token ids for {len(ids)} chunk ids")
        if col.null_count:
            raise ValueError(f"{col.null_count} null rows of token ids")
        offsets = col.offsets.to_numpy().astype(np.int64)  # of this slice, into values
        start = int(offsets[0])
        values = col.values.slice(start, int(offsets[-1]) - start)
        if values.null_count:
            raise ValueError(f"{values.null_count} null token ids")
        flat = _integers(values.to_numpy(zero_copy_only=False))
        more = list((extra or {}).items())
        if more:
            tail = [_integers(np.asarray(t).reshape(-1)) for _, t in more]
            flat = np.concatenate([flat.astype(np.int64), *(t.astype(np.int64) for t in tail)])
            ends = np.cumsum([len(t) for t in tail]) + offsets[-1]
            offsets = np.concatenate([offsets, ends])
        return cls([*ids, *(c for c, _ in more)], _narrow(flat), offsets - start)

    def __getitem__(self, chunk: str) -> tuple[int, ...]:
        i = self._rows[chunk]
        return tuple(self._flat[self._offsets[i]:self._offsets[i + 1]].tolist())

    def length(self, chunk: str) -> int:
        """``len(self[chunk])``, without building the tuple."""
        i = self._rows[chunk]
        return int(self._offsets[i + 1] - self._offsets[i])

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __contains__(self, chunk: object) -> bool:
        return chunk in self._rows

    @property
    def tokens(self) -> int:
        """Token ids held, over every row (repeated ids' earlier rows too)."""
        return len(self._flat)

    @property
    def nbytes(self) -> int:
        return int(self._flat.nbytes + self._offsets.nbytes)


def _integers(a: np.ndarray) -> np.ndarray:
    """``a`` when it holds integers that fit int64 (an empty list comes as floats), else
    ValueError."""
    if a.size == 0:
        return a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, not {a.dtype}")
    if a.dtype.kind == "u" and int(a.max()) > np.iinfo(np.int64).max:
        raise ValueError("token ids beyond int64")
    return a


def _narrow(flat: np.ndarray) -> np.ndarray:
    """int32 when every id fits (token ids do), else int64: a copy the table owns."""
    flat = _integers(flat)
    info = np.iinfo(np.int32)
    if flat.size == 0 or (int(flat.min()) >= info.min and int(flat.max()) <= info.max):
        return flat.astype(np.int32)
    return flat.astype(np.int64)


@dataclass
class UserMemory:
    """What the server holds per user: the version, facts and their retrieval index.

    Ids and texts are tuples, token ids one :class:`TokenTable` (given a dict, or built
    from the facts table's column by the server): the collector stops
    tracking a tuple of strings after one pass and an array holds no object per id, while
    lists stay tracked. With 2,000 users of 400 facts, lists made a full collection take
    485 ms on a 2-core CPU, tuples 3 ms (``benchmarks/results/gc-pause-cpu.json``, issue
    30); the table also spares a first load ~16,000 int objects built under the GIL."""

    user: str
    version: str
    fact_ids: tuple[str, ...]
    texts: tuple[str, ...]
    token_ids: TokenTable  # chunk id -> token ids ("prefix" included)
    index: Any  # retrieval.FactIndex
    source_index: dict[str, int] = field(default_factory=dict)  # fact id -> source turn index
    memory_order: str = "relevance"  # the artifact's composer settings (encoder config)
    text_tail: int = 0
    tail_max_k: int = 0
    kv_row_bytes: int = 0  # stored KV bytes per memory token (0: unknown)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.fact_ids, self.texts = tuple(self.fact_ids), tuple(self.texts)  # see the doc
        if not isinstance(self.token_ids, TokenTable):
            self.token_ids = TokenTable.from_lists(self.token_ids)
        emb = getattr(self.index, "embeddings", None)
        self.nbytes = ((emb.numel() * emb.element_size() if emb is not None else 0)
                       + self.token_ids.nbytes + sum(map(len, map(str.encode, self.texts))))
