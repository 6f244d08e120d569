"""One user's verified KV memory in the serving worker: :class:`Resident` (the slab, its
chunk index and token ids), and what the resident store needs to place it
(:class:`HeadShard`, :func:`layer_major`). The store itself is
:class:`inferscale.hydrate.store.ResidentStore`.

A slab is always the logical ``[T, 2, L, H, D]`` (token, K/V, layer, KV head, dim); its
memory layout depends on where it lives (see the store)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from inferscale.hydrate.arena import NO_FENCE, Fence, Region

if TYPE_CHECKING:
    from storage_schemas.manifest import Manifest


def layer_major(slab: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``slab [T, 2, L, H, D]`` copied (and converted to ``dtype``) in one pass into
    layer-major CPU memory, viewed as ``[T, 2, L, H, D]``."""
    src = slab.permute(1, 2, 0, 3, 4)  # [2, L, T, H, D] view
    out = torch.empty(src.shape, dtype=dtype or slab.dtype)
    out.copy_(src)
    return out.permute(2, 0, 1, 3, 4)


class ResidencyError(RuntimeError):
    """A slab that cannot be made resident (too large for every budget, bad shape)."""


@dataclass(frozen=True)
class HeadShard:
    """KV heads ``[start, start + count)`` of a model's ``total``: what one tensor-parallel
    rank holds (built by the connector's worker half from vLLM's sharding rule,
    :func:`inferscale.vllm_plugin.compat.kv_head_shard`)."""

    start: int
    count: int
    total: int

    def __post_init__(self) -> None:
        if not (0 <= self.start and 0 < self.count and self.start + self.count <= self.total):
            raise ValueError(f"heads [{self.start}, {self.start + self.count}) are not "
                             f"inside the model's {self.total} KV heads")

    def take(self, slab: torch.Tensor) -> torch.Tensor:
        """This shard's heads of ``slab [T, 2, L, H, D]``: a view ``[T, 2, L, count, D]``
        (nothing copied)."""
        if slab.dim() != 5 or slab.shape[3] != self.total:
            raise ResidencyError(f"slab {tuple(slab.shape)} has not the model's {self.total} "
                                 "KV heads in dimension 3 of [T, 2, L, H, D]")
        return slab[:, :, :, self.start:self.start + self.count]


@dataclass
class Resident:
    """One user's verified KV memory of one artifact version: what hydration returns
    (:func:`inferscale.hydrate.slab.hydrate`) and what the store holds."""

    user: str
    version: str
    fingerprint: str  # the model fingerprint the KV was encoded with
    slab: torch.Tensor  # [T, 2, L, H, D], the stored dtype (in a store: its heads, dtype)
    index: dict[str, tuple[int, int]]  # chunk_id -> (row offset, length)
    token_ids: dict[str, tuple[int, ...]]  # chunk_id -> token ids
    tier: str = "gpu"  # where the slab is (the store sets it when it places the slab)
    manifest: Manifest | None = None  # the version's manifest, when read by hydration
    content_keys: dict[str, str] = field(default_factory=dict)  # chunk_id -> key (kv v2+)
    region: Region | None = None  # the arena memory the slab lives in (a store's or staging)
    last_use: Fence = NO_FENCE  # after the last enqueued read of the slab

    @property
    def nbytes(self) -> int:
        return self.slab.numel() * self.slab.element_size()

    def chunk(self, chunk_id: str) -> torch.Tensor:
        """Rows of one chunk: a view ``[t, 2, L, H, D]``."""
        offset, length = self.index[chunk_id]
        return self.slab[offset:offset + length]

    def kv_by_content_key(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``content key -> (keys, values)``, each a view ``[L, t, H, D]`` of the slab (the
        encoder's chunk layout), for every chunk stored with a key. Called by the pipeline
        to reuse a previous version's K/V (``encode.encoder.encode_facts(reuse=...)``)."""
        out = {}
        for chunk_id, key in self.content_keys.items():
            rows = self.chunk(chunk_id)  # [t, 2, L, H, D]
            out[key] = (rows[:, 0].permute(1, 0, 2, 3), rows[:, 1].permute(1, 0, 2, 3))
        return out

    def rows(self, chunk_ids: list[str]) -> list[tuple[int, int]]:
        """(offset, length) of each chunk, in request order; KeyError if unknown."""
        return [self.index[c] for c in chunk_ids]

    def runs(self, chunk_ids: list[str], start: int, end: int) -> list[tuple[int, int]]:
        """Memory tokens ``[start, end)`` of the chunks' concatenation as merged runs of
        slab rows: ``(first row, count)``."""
        runs: list[tuple[int, int]] = []
        pos = 0
        for off, length in self.rows(chunk_ids):
            lo, hi = max(start, pos), min(end, pos + length)
            if lo < hi:
                row = off + lo - pos
                if runs and runs[-1][0] + runs[-1][1] == row:
                    runs[-1] = (runs[-1][0], runs[-1][1] + hi - lo)
                else:
                    runs.append((row, hi - lo))
            pos += length
        return runs


@dataclass
class StoreEvent:
    """A resident added (``resident`` set) or removed, in the order it happened."""

    op: str  # "add" | "remove"
    user: str
    version: str
    resident: Resident | None = None
