"""One engine step's memory injection: gather, rotate, write into the paged cache.

Built by the connector's worker side in ``start_load_kv`` from the step's verified loads.
All loads of the step share one staging buffer ``[N, 2, L, H, D]`` in the model's dtype:
device-tier rows are gathered with one ``index_select`` per user; host-tier rows arrive
by one non-blocking pinned-host -> device copy per contiguous run of needed rows (only
those rows cross PCIe). Keys of every layer are then rotated at their virtual positions
by one call of the model's own rotary op, and each layer is written with the attention
backend's own cache writer.

Everything is enqueued on the compute stream without waiting: the GPU runs the copies,
the rotation and the writes in order before the forward pass that follows, while the CPU
goes on preparing that forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from inferscale.resident import Resident, ResidentStore
from inferscale.vllm_compat import rotate_with_model, write_layer_kv


@dataclass
class Job:
    """One request's rows: ``[start, end)`` of its memory, at staging rows ``at..``."""

    resident: Resident
    chunks: list[str]
    start: int
    end: int
    at: int

    @property
    def width(self) -> int:
        return self.end - self.start


@dataclass
class StepLoad:
    """The step's staging buffer, positions and slots."""

    layers: dict[int, Any]  # layer index -> attention layer
    staging: torch.Tensor  # [N, 2, L, H, D], model dtype, compute device
    positions: torch.Tensor  # [N] virtual positions
    slots: torch.Tensor  # [N] paged-cache slots
    jobs: list[Job] = field(default_factory=list)

    @classmethod
    def run(cls, store: ResidentStore, jobs: list[Job], layers: list[tuple[int, Any]],
            dtype: torch.dtype, rotary: torch.nn.Module, slots: list[Any]) -> "StepLoad":
        """Gather, rotate and write every job of the step (enqueued, not awaited)."""
        import numpy as np

        device = layers[0][1].kv_cache.device
        n = sum(j.width for j in jobs)
        _, _, L, H, D = jobs[0].resident.slab.shape
        staging = torch.empty((n, 2, L, H, D), dtype=dtype, device=device)  # [N, 2, L, H, D]
        for j in jobs:
            store.gather(j.resident, j.chunks, j.start, j.end, staging[j.at:j.at + j.width])
        positions = torch.from_numpy(np.concatenate(
            [np.arange(j.start, j.end) for j in jobs])).to(device, non_blocking=True)
        slot_mapping = torch.from_numpy(np.concatenate(slots)).to(device, non_blocking=True)
        # every layer's keys at once, in place: a [N, L*H*D] view, L*H "heads"
        rotate_with_model(rotary, positions, staging[:, 0].reshape(n, L * H, D))
        for idx, layer in layers:
            # [N, H, D] views (token stride 2*L*H*D), as the model's own q/k/v split passes
            write_layer_kv(layer, staging[:, 0, idx], staging[:, 1, idx], slot_mapping)
        return cls(dict(layers), staging, positions, slot_mapping, jobs)


def row_index(resident: Resident, chunks: list[str], start: int, end: int) -> torch.Tensor:
    """Slab rows ``[N]`` of memory tokens ``[start, end)`` of the chunks' concatenation."""
    return torch.cat([torch.arange(r, r + n) for r, n in resident.runs(chunks, start, end)])
