"""One engine step's memory injection: gather, rotate, write into the paged cache.

Built by the connector's worker side in ``start_load_kv`` from the step's verified loads.
All loads of the step share one staging buffer ``[N, 2, L, H, D]`` in the model's dtype:

- device-tier rows are gathered at once (one ``index_select`` per user on the device);
- host-tier rows, on CUDA, are copied from pinned host memory by DMA on a side stream,
  in groups of layers (one pitched ``cudaMemcpy2DAsync`` per run of rows and group:
  only the needed rows cross PCIe), each group signalling an event; the forward pass
  waits for layer ``l``'s group only when it reaches layer ``l`` (``wait_for_layer_load``),
  so the transfer of later layers overlaps the computation of earlier ones. Without
  CuPy's pitched copy the rows go in one group; without CUDA, up front.

Keys are rotated at their virtual positions with the model's own rotary op and every
layer is written with the attention backend's own cache writer. ``finish`` (called at
``wait_for_save``) writes any layer the forward pass did not ask for and releases the
buffers once the side stream is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from inferscale.resident import Resident, ResidentStore
from inferscale.vllm_compat import rotate_with_model, write_layer_kv

LAYER_GROUPS = 4  # host-tier transfer groups: the first group's copy is the only one exposed


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
    """The step's staging buffer, positions, slots and per-layer progress."""

    layers: dict[int, Any]  # layer index -> attention layer
    staging: torch.Tensor  # [N, 2, L, H, D], model dtype, compute device
    positions: torch.Tensor  # [N] virtual positions
    slots: torch.Tensor  # [N] paged-cache slots
    rotary: torch.nn.Module
    events: dict[int, Any] = field(default_factory=dict)  # layer -> CUDA event (layerwise)
    side_stream: Any = None
    done: set[int] = field(default_factory=set)
    jobs: list[Job] = field(default_factory=list)

    @classmethod
    def build(cls, store: ResidentStore, jobs: list[Job], layers: list[tuple[int, Any]],
              dtype: torch.dtype, rotary: torch.nn.Module, overlap: bool) -> "StepLoad":
        """Stage the jobs; with ``overlap`` (CUDA), host-tier rows stream in by layer group."""
        device = layers[0][1].kv_cache.device
        n = sum(j.width for j in jobs)
        _, _, L, H, D = jobs[0].resident.slab.shape
        staging = torch.empty((n, 2, L, H, D), dtype=dtype, device=device)  # [N, 2, L, H, D]
        positions = torch.cat([torch.arange(j.start, j.end) for j in jobs]).to(device)
        load = cls(dict(layers), staging, positions, torch.empty(0), rotary, jobs=jobs)
        deferred = []
        for j in jobs:
            slab = j.resident.slab
            if overlap and slab.device.type == "cpu" and slab.is_pinned() and slab.dtype == dtype:
                deferred.append(j)
            else:
                store.gather(j.resident, j.chunks, j.start, j.end, staging[j.at:j.at + j.width])
        if deferred:
            load._start_host_copies(deferred, L)
        else:
            load._rotate_all()
        return load

    # -------------------------------------------------------------- host-tier transfers

    def _start_host_copies(self, deferred: list[Job], num_layers: int) -> None:
        device = self.staging.device
        self.side_stream = torch.cuda.Stream(device)
        self.side_stream.wait_stream(torch.cuda.current_stream(device))
        pitched = _pitched_copy()
        bounds = _groups(num_layers, LAYER_GROUPS if pitched else 1)
        with torch.cuda.stream(self.side_stream):
            for l0, l1 in bounds:
                for j in deferred:
                    at = j.at
                    for row, count in j.resident.runs(j.chunks, j.start, j.end):
                        if pitched:
                            pitched(self.staging, at, j.resident.slab, row, count, l0, l1,
                                    self.side_stream.cuda_stream)
                        else:
                            self.staging[at:at + count].copy_(j.resident.slab[row:row + count],
                                                              non_blocking=True)
                        at += count
                ev = torch.cuda.Event()
                ev.record(self.side_stream)
                for layer in range(l0, l1):
                    self.events[layer] = ev

    # -------------------------------------------------------------- writing

    def _rotate_all(self) -> None:
        n, _, L, H, D = self.staging.shape
        # every layer's keys at once, in place: a [N, L*H*D] view, L*H "heads"
        rotate_with_model(self.rotary, self.positions, self.staging[:, 0].reshape(n, L * H, D))

    def set_slots(self, slots: list[Any]) -> None:
        """The jobs' slot mappings (int64 arrays, in job order) -> one device tensor [N]."""
        import numpy as np

        self.slots = torch.from_numpy(np.concatenate(slots)).to(self.staging.device)

    def layer(self, idx: int) -> None:
        """Make layer ``idx``'s memory KV present in the paged cache (idempotent)."""
        if idx in self.done or idx not in self.layers:
            return
        if self.events:
            torch.cuda.current_stream(self.staging.device).wait_event(self.events[idx])
            rotate_with_model(self.rotary, self.positions, self.staging[:, 0, idx])  # [N, H, D]
        # [N, H, D] views (token stride 2*L*H*D), as the model's own q/k/v split passes
        write_layer_kv(self.layers[idx], self.staging[:, 0, idx], self.staging[:, 1, idx],
                       self.slots)
        self.done.add(idx)

    def all_layers(self) -> None:
        for idx in sorted(self.layers):
            self.layer(idx)

    def finish(self) -> None:
        """Write layers nobody waited for; keep buffers alive until the side stream ends."""
        self.all_layers()
        if self.side_stream is not None:
            torch.cuda.current_stream(self.staging.device).wait_stream(self.side_stream)


def row_index(resident: Resident, chunks: list[str], start: int, end: int) -> torch.Tensor:
    """Slab rows ``[N]`` of memory tokens ``[start, end)`` of the chunks' concatenation."""
    return torch.cat([torch.arange(r, r + n) for r, n in resident.runs(chunks, start, end)])


def _groups(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """``groups`` contiguous layer ranges covering ``range(num_layers)``."""
    groups = max(1, min(groups, num_layers))
    edges = [round(i * num_layers / groups) for i in range(groups + 1)]
    return [(edges[i], edges[i + 1]) for i in range(groups)]


def _pitched_copy():
    """A host->device copy of layers ``[l0, l1)`` of ``count`` token rows between two
    ``[*, 2, L, H, D]`` buffers (one ``cudaMemcpy2DAsync``), or None without CuPy."""
    try:
        from cupy.cuda import runtime
    except ImportError:
        return None

    def copy(dst: torch.Tensor, dst_row: int, src: torch.Tensor, src_row: int, count: int,
             l0: int, l1: int, stream: int) -> None:
        _, _, L, H, D = src.shape
        es = src.element_size()
        layer_bytes = H * D * es
        pitch = L * layer_bytes  # bytes between consecutive (token, k|v) rows
        runtime.memcpy2DAsync(
            dst.data_ptr() + (dst_row * 2 * L + l0) * layer_bytes, pitch,
            src.data_ptr() + (src_row * 2 * L + l0) * layer_bytes, pitch,
            (l1 - l0) * layer_bytes, count * 2, runtime.memcpyHostToDevice, stream)

    return copy
