"""One user's verified KV memory in the serving worker: :class:`Resident` (the slab, its
chunk index and token ids), and what the resident store needs to place it
(:class:`HeadShard`, :func:`layer_major`). The store itself is
:class:`inferscale.hydrate.store.ResidentStore`.

A slab is always the logical ``[T, 2, L, H, D]`` (token, K/V, layer, KV head, dim); its
memory layout (:class:`~inferscale.types.KVFormat`) depends on where it lives (see the
store)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from inferscale.hydrate.arena import NO_FENCE, Fence, Region
from inferscale.kv_quant import check_scales_for, dequantize, is_quantized
from inferscale.types import KVFormat, KVGeometry, dtype_name

if TYPE_CHECKING:
    from storage_schemas.manifest import Manifest


def layer_major(slab: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``slab [T, 2, L, H, D]`` (in CPU memory) copied, and converted to ``dtype``, in
    one pass into :attr:`~inferscale.types.KVFormat.LAYER_MAJOR` memory (what a CPU
    engine's store holds), viewed as ``[T, 2, L, H, D]``."""
    return KVFormat.LAYER_MAJOR.copy(slab, dtype)


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

    def take_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """This shard's heads of fp8 scales ``[C, 2, L, H]`` -> ``[C, 2, L, count]``."""
        return scales[:, :, :, self.start:self.start + self.count].contiguous()


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
    # fp8 slabs: each chunk's scales [C, 2, L, H] float32 in host memory, one row per chunk
    # in ``index`` order (inferscale.kv_quant); None when the slab is in a float dtype
    scales: torch.Tensor | None = None
    _pos: dict[str, int] | None = field(default=None, repr=False, compare=False)
    # built once: chunk rows' slab offsets and lengths ([C] int64 each, ``index`` order)
    _spans: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False,
                                                         compare=False)

    @property
    def nbytes(self) -> int:
        extra = self.scales.numel() * 4 if self.scales is not None else 0
        return self.slab.numel() * self.slab.element_size() + extra

    def scale_pos(self, chunk_id: str) -> int:
        """The row of ``chunk_id``'s scales in :attr:`scales`."""
        if self._pos is None:
            self._pos = {c: i for i, c in enumerate(self.index)}
        return self._pos[chunk_id]

    def row_scales(self) -> torch.Tensor:
        """Every slab row's scales ``[T, 2, L, H]`` (rows lie in ``index`` order)."""
        lengths = torch.tensor([n for _, n in self.index.values()], dtype=torch.int64)
        return torch.repeat_interleave(self.scales, lengths, dim=0)

    def scale_rows(self, chunk_ids: list[str], start: int, end: int) -> np.ndarray:
        """Per memory token ``[start, end)`` of the chunks' concatenation, the row of its
        chunk's scales (``[N]`` int64; what :meth:`runs` is for the slab's rows)."""
        return self.token_rows(chunk_ids, start, end, scales=True)[1]

    def token_rows(self, chunk_ids: list[str], start: int, end: int, scales: bool = False
                   ) -> tuple[np.ndarray, np.ndarray | None]:
        """Slab rows ``[N]`` (int64) of memory tokens ``[start, end)`` of the chunks'
        concatenation and, with ``scales``, each token's row of :attr:`scales` (its
        chunk's; ``[N]`` int64, else None). One Python pass over the chunk ids; the rest
        vectorized (:func:`token_spans`). KeyError for an unknown chunk."""
        if self._spans is None:
            self._spans = (np.asarray([o for o, _ in self.index.values()], dtype=np.int64),
                           np.asarray([n for _, n in self.index.values()], dtype=np.int64))
        if self._pos is None:
            self._pos = {c: i for i, c in enumerate(self.index)}
        pos = np.fromiter(map(self._pos.__getitem__, chunk_ids), np.int64,
                          len(chunk_ids))  # [k]: the chunks' rows of the index
        offsets, lengths = self._spans[0][pos], self._spans[1][pos]  # [k]
        first, count = token_spans(lengths, start, end)  # [k]
        # token t of chunk j: slab row offsets[j] + first[j] + (t - chunk j's first t)
        rows = (offsets + first + count - count.cumsum()).repeat(count)  # [N]
        rows += np.arange(len(rows), dtype=np.int64)
        return rows, pos.repeat(count) if scales else None

    def rows_float(self, rows: torch.Tensor) -> torch.Tensor:
        """Slab rows ``rows [N]`` as float32 ``[N, 2, L, H, D]`` (fp8 rows dequantized)."""
        got = self.slab[rows.to(self.slab.device)]
        if self.scales is None:
            return got.float()
        pos = {o: self.scale_pos(c) for c, (o, _) in self.index.items()}
        starts = torch.tensor(sorted(pos), dtype=torch.int64)
        which = torch.tensor([pos[int(o)] for o in starts])[
            torch.searchsorted(starts, rows.cpu(), right=True) - 1]
        return dequantize(got, self.scales[which])

    def chunk(self, chunk_id: str) -> torch.Tensor:
        """Rows of one chunk: a view ``[t, 2, L, H, D]``."""
        offset, length = self.index[chunk_id]
        return self.slab[offset:offset + length]

    def gather(self, chunk_ids: list[str], start: int, end: int, out: torch.Tensor) -> None:
        """Copy memory tokens ``[start, end)`` of the chunks' concatenation into ``out``
        (``[end - start, 2, L, H, D]`` on the compute device, any dtype): one
        ``index_select`` from a token-major slab on that device, else one non-blocking
        copy per contiguous run of needed rows (pinned host -> device). fp8 rows gathered
        into a float ``out`` are dequantized (the generic path's staging)."""
        slab = self.slab
        if self.scales is not None and out.dtype != slab.dtype:
            raw = torch.empty(out.shape, dtype=slab.dtype, device=out.device)
            self.gather(chunk_ids, start, end, raw)
            # only the used chunks' scales cross ([U, 2, L, H]), spread per token there:
            # not [N, 2, L, H] gathered on the host (2 KB a token at Llama-3.1-8B's shape)
            used, inverse = np.unique(self.scale_rows(chunk_ids, start, end),
                                      return_inverse=True)
            table = self.scales[torch.from_numpy(used)].to(out.device)  # [U, 2, L, H]
            out.copy_(dequantize(raw, table[torch.from_numpy(inverse).to(out.device)]))
            return
        runs = self.runs(chunk_ids, start, end)
        if slab.device == out.device and slab.is_contiguous():
            if len(runs) == 1:
                out.copy_(slab[runs[0][0]:runs[0][0] + runs[0][1]])
                return
            idx = torch.cat([torch.arange(r, r + n) for r, n in runs]).to(slab.device)
            if slab.dtype == out.dtype:
                torch.index_select(slab, 0, idx, out=out)
            else:
                out.copy_(torch.index_select(slab, 0, idx))
            return
        at = 0
        for row, n in runs:
            out[at:at + n].copy_(slab[row:row + n], non_blocking=True)
            at += n

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


def token_spans(lengths: np.ndarray, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """Memory tokens ``[start, end)`` of the concatenation of chunks of ``lengths``
    (``[k]`` int64): per chunk the first of its tokens taken and how many (``[k]`` each;
    0 for a chunk outside the range)."""
    begins = lengths.cumsum() - lengths  # [k]: each chunk's first memory token
    first = np.minimum(np.maximum(start - begins, 0), lengths)
    return first, np.maximum(np.minimum(end - begins, lengths) - first, 0)


def check_servable(resident: Resident, geometry: KVGeometry | None,
                   dtype: torch.dtype) -> None:
    """:class:`ResidencyError` unless ``resident``'s slab (all of the model's heads, as
    read) can serve a model of ``geometry`` (None: any) computing in ``dtype``:
    ``[T, 2, L, H, D]`` of that geometry in a KV dtype, and for fp8 one row of scales
    ``[2, L, H]`` per chunk, each keeping the values it dequantizes (and the keys
    rotated from them) finite in ``dtype`` (:func:`inferscale.kv_quant.check_scales_for`).
    The same bytes per token in another geometry would be written through the paged
    cache's strides into other requests' blocks."""
    slab, scales = resident.slab, resident.scales
    if slab.dim() != 5 or slab.shape[1] != 2:
        raise ResidencyError(f"slab must be [T, 2, L, H, D], got {tuple(slab.shape)}")
    if geometry is not None and tuple(slab.shape[2:]) != tuple(geometry):
        raise ResidencyError(
            f"user {resident.user!r}: slab {list(slab.shape)} is not [T, 2, L, H, D] of the "
            f"model's geometry {KVGeometry(*geometry).describe()}")
    if dtype_name(slab.dtype) is None:
        raise ResidencyError(f"user {resident.user!r}: slab dtype {slab.dtype} is not a KV "
                             "dtype")
    if is_quantized(slab.dtype) != (scales is not None):
        raise ResidencyError(f"user {resident.user!r}: a {slab.dtype} slab "
                             f"{'without' if scales is None else 'with'} scales")
    if scales is not None:
        want = (len(resident.index), 2, *slab.shape[2:4])
        if tuple(scales.shape) != want:
            raise ResidencyError(f"user {resident.user!r}: scales {list(scales.shape)} for "
                                 f"{list(want)}")
        try:
            check_scales_for(scales, dtype)
        except ValueError as exc:
            raise ResidencyError(f"user {resident.user!r}: {exc}") from exc


@dataclass
class StoreEvent:
    """A resident added (``resident`` set) or removed, in the order it happened."""

    op: str  # "add" | "remove"
    user: str
    version: str
    resident: Resident | None = None
    for_room: bool = False  # removed to make room for another user (a budget's drop)
    # added, and the host tier (where users are dropped) has no room left for another
    # user of this one's size: the next reload drops someone
    full: bool = False
