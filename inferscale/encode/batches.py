"""Batches of the encoder's forward passes: segments of ``context`` then independent
chunks, padded into batches, with the 4-D block mask that keeps chunks apart.

A :class:`Segment` is one sequence of a pass: context token ids, then chunks that each
see the context and themselves, never one another (position ids restart after the
context for every chunk). :func:`plan_batches` groups segments under a padded-token
budget; :func:`build_batch` lays a batch out as model inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class Segment:
    """One sequence of a forward pass: ``context`` then independent ``chunks``."""

    context: tuple[int, ...]
    chunks: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def length(self) -> int:
        return len(self.context) + sum(len(ids) for _, ids in self.chunks)


def plan_batches(segments: Sequence[Segment], batch_tokens: int) -> list[list[int]]:
    """Group segment indices into batches of at most ``batch_tokens`` padded tokens.

    Segments are sorted by length so padding stays small, and single-chunk segments are
    kept apart from multi-chunk ones: a batch of single-chunk segments needs no block
    mask and runs the model's plain causal attention. A segment longer than
    ``batch_tokens`` gets a batch of its own.
    """
    order = sorted(range(len(segments)),
                   key=lambda i: (len(segments[i].chunks) > 1, segments[i].length))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = max([segments[j].length for j in current] + [segments[i].length])
        kind_changes = current and (len(segments[current[0]].chunks) > 1) != (
            len(segments[i].chunks) > 1)
        if current and (kind_changes or longest * (len(current) + 1) > batch_tokens):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def build_batch(segments: Sequence[Segment], pad_id: int, device: torch.device,
                mask_dtype: torch.dtype) -> dict[str, Any]:
    """Input ids, positions, an additive 4-D block mask, and where each chunk sits.

    Returns ``input_ids [B, S]``, ``position_ids [B, S]``, ``attention_mask [B, 1, S, S]``
    (0 where attention is allowed, dtype-min elsewhere; padding rows see themselves so no
    row is empty) or ``None`` when every segment has one chunk (then plain causal
    attention over right-padded rows is exact for every real token), and ``select_b``/``select_s`` ``[N]``: the (row, column) of every chunk
    token in order, plus ``spans``: per chunk ``(chunk_id, start, length)`` into ``N``.
    """
    B = len(segments)
    S = max(seg.length for seg in segments)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    pos = torch.zeros((B, S), dtype=torch.long)
    group = torch.full((B, S), -1, dtype=torch.long)  # -1 pad, 0 context, j+1 chunk j
    sel_b: list[int] = []
    sel_s: list[int] = []
    spans: list[tuple[str, int, int]] = []
    for b, seg in enumerate(segments):
        w = len(seg.context)
        if w:
            ids[b, :w] = torch.tensor(seg.context)
            pos[b, :w] = torch.arange(w)
            group[b, :w] = 0
        col = w
        for j, (chunk_id, chunk) in enumerate(seg.chunks):
            n = len(chunk)
            ids[b, col:col + n] = torch.tensor(chunk)
            pos[b, col:col + n] = torch.arange(w, w + n)
            group[b, col:col + n] = j + 1
            spans.append((chunk_id, len(sel_b), n))
            sel_b.extend([b] * n)
            sel_s.extend(range(col, col + n))
            col += n
    mask = None
    if any(len(seg.chunks) > 1 for seg in segments):
        group = group.to(device)
        q = group[:, :, None]  # [B, S, 1]
        k = group[:, None, :]  # [B, 1, S]
        causal = torch.ones(S, S, dtype=torch.bool, device=device).tril()
        allowed = causal & (k >= 0) & ((k == 0) | (k == q))
        allowed |= torch.eye(S, dtype=torch.bool, device=device)  # padding rows see themselves
        mask = torch.zeros((B, 1, S, S), dtype=mask_dtype, device=device)
        mask.masked_fill_(~allowed[:, None], torch.finfo(mask_dtype).min)
    return {
        "input_ids": ids.to(device),
        "position_ids": pos.to(device),
        "attention_mask": mask,
        "select_b": torch.tensor(sel_b, dtype=torch.long, device=device),
        "select_s": torch.tensor(sel_s, dtype=torch.long, device=device),
        "spans": spans,
    }
