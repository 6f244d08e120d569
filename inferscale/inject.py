"""One engine step's memory injection: gather, rotate, write into the paged cache.

Built by the connector's worker side in ``start_load_kv`` from the step's verified loads.
All loads of the step share one staging buffer ``[N, 2, L, H, D]`` in the model's dtype:

- device-tier rows are gathered at once (one ``index_select`` per user on the device);
- host-tier rows, on CUDA, are gathered layer by layer on a side stream straight from
  pinned host memory (a zero-copy CUDA view of the pinned slab: only the needed rows
  cross PCIe), each layer signalling an event; the forward pass waits for layer ``l``
  only when it reaches layer ``l`` (``wait_for_layer_load``), so the transfer overlaps
  the computation of earlier layers. Without CUDA (or without the zero-copy view), host
  rows are copied up front.

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
    _in_flight: list[Any] = field(default_factory=list)  # tensors the side stream reads

    @classmethod
    def build(cls, store: ResidentStore, jobs: list[Job], layers: list[tuple[int, Any]],
              dtype: torch.dtype, rotary: torch.nn.Module, layerwise: bool) -> "StepLoad":
        device = layers[0][1].kv_cache.device
        n = sum(j.width for j in jobs)
        _, _, L, H, D = jobs[0].resident.slab.shape
        staging = torch.empty((n, 2, L, H, D), dtype=dtype, device=device)  # [N, 2, L, H, D]
        positions = torch.cat([torch.arange(j.start, j.end) for j in jobs]).to(device)
        load = cls(dict(layers), staging, positions, torch.empty(0), rotary, jobs=jobs)
        deferred = []
        for j in jobs:
            alias = store.device_alias(j.resident) if layerwise else None
            if alias is not None:
                deferred.append((j, alias))
            else:
                store.gather(j.resident, j.chunks, j.start, j.end, staging[j.at:j.at + j.width])
        if deferred:
            load._start_layerwise(deferred, L)
        else:
            load._rotate_all()
        return load

    # -------------------------------------------------------------- layerwise host loads

    def _start_layerwise(self, deferred: list[tuple[Job, torch.Tensor]], num_layers: int) -> None:
        device = self.staging.device
        self.side_stream = torch.cuda.Stream(device)
        self.side_stream.wait_stream(torch.cuda.current_stream(device))
        rows = [(j, alias, row_index(j.resident, j.chunks, j.start, j.end).to(device))
                for j, alias in deferred]
        self._in_flight = rows  # alive until finish(): the side stream reads them
        with torch.cuda.stream(self.side_stream):
            for layer in range(num_layers):
                for j, alias, idx in rows:
                    # [w, 2, H, D] of layer `layer`, read from pinned host memory over PCIe
                    part = torch.index_select(alias[:, :, layer], 0, idx)
                    self.staging[j.at:j.at + j.width, :, layer].copy_(part)
                ev = torch.cuda.Event()
                ev.record(self.side_stream)
                self.events[layer] = ev

    # -------------------------------------------------------------- writing

    def _rotate_all(self) -> None:
        n, _, L, H, D = self.staging.shape
        # every layer's keys at once, in place: a [N, L*H*D] view, L*H "heads"
        rotate_with_model(self.rotary, self.positions, self.staging[:, 0].reshape(n, L * H, D))

    def set_slots(self, slots: list[int]) -> None:
        self.slots = torch.tensor(slots, dtype=torch.long).to(self.staging.device)

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
            self.side_stream.synchronize()
            self._in_flight = []


def row_index(resident: Resident, chunks: list[str], start: int, end: int) -> torch.Tensor:
    """Slab rows ``[N]`` of memory tokens ``[start, end)`` of the chunks' concatenation."""
    return torch.cat([torch.arange(r, r + n) for r, n in resident.runs(chunks, start, end)])
