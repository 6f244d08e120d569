"""One engine step's memory injection: gather, rotate, write into the paged cache.

Built by the connector's worker half (:mod:`inferscale.vllm_plugin.worker`) in
``start_load_kv`` from the step's verified loads.

Fused path (:mod:`inferscale.vllm_plugin.kernels`, when the cache layout is known and
the kernel passed its check against the backend's writer): one kernel per source slab
reads each needed slab row once, rotates the keys of every layer at their virtual positions and
stores K and V into every layer's paged blocks. Device-tier users are read in place;
host-tier rows first arrive in the staging buffer by one non-blocking pinned-host ->
device copy per contiguous run of needed rows (only those rows cross PCIe). fp8 rows stay
fp8 all the way (half the bytes over PCIe) and are dequantized by the kernel with their
chunks' scales.

Generic path (any other backend): all loads of the step share the staging buffer
``[N, 2, L, H, D]`` in the model's dtype (fp8 rows dequantized into it); keys of every
layer are rotated by one call of the model's own rotary op and each layer is written with
the backend's own writer.

Everything is enqueued on the compute stream without waiting: the GPU runs the copies,
the rotation and the writes in order before the forward pass that follows, while the CPU
goes on preparing that forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from inferscale.encode.rope import RotaryTables, rotate_keys
from inferscale.hydrate.resident import Resident
from inferscale.hydrate.store import ResidentStore
from inferscale.vllm_plugin.compat import read_layer_kv, rotate_with_model, write_layer_kv
from inferscale.vllm_plugin.kernels.indices import Source, unique_runs
from inferscale.vllm_plugin.kernels.writer import FusedWriter


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


class Staging:
    """A staging buffer reused by every step (owned by the connector's worker side).

    A fresh 70-200 MB buffer per step costs page faults on CPU (tens of ms for the
    kernel to zero new pages); one grown buffer costs them once. On CUDA the caching
    allocator would reuse the memory anyway; reuse is safe there because every step's
    copies, rotation and writes are ordered on the one compute stream.
    """

    def __init__(self) -> None:
        self._bufs: dict[torch.dtype, torch.Tensor] = {}  # flat, per dtype, compute device

    def take(self, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """A ``shape`` view of the ``dtype`` buffer (contents undefined), grown if too
        small (one per dtype: a step may stage fp8 rows and float rows)."""
        n = int(np.prod(shape))
        buf = self._bufs.get(dtype)
        if buf is None or buf.numel() < n or buf.device != device:
            buf = self._bufs[dtype] = torch.empty(
                max(n, buf.numel() if buf is not None else 0), dtype=dtype, device=device)
        return buf[:n].view(shape)


@dataclass
class StepLoad:
    """What one step loaded: kept by the connector for ``verify_last_load``."""

    layers: dict[int, Any]  # layer index -> attention layer
    positions: torch.Tensor  # [N] virtual positions (host)
    slots: torch.Tensor  # [N] paged-cache slots (host)
    jobs: list[Job] = field(default_factory=list)
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    path: str = "generic"

    @classmethod
    def run(cls, store: ResidentStore, jobs: list[Job], layers: list[tuple[int, Any]],
            dtype: torch.dtype, rotary: torch.nn.Module, slots: list[np.ndarray],
            staging: Staging | None = None, fused: FusedWriter | None = None) -> "StepLoad":
        """Gather, rotate and write every job of the step (enqueued, not awaited)."""
        device = layers[0][1].kv_cache.device
        staging = staging or Staging()
        positions = np.concatenate([np.arange(j.start, j.end) for j in jobs])  # [N]
        slot_mapping = np.concatenate(slots)  # [N]
        if fused is not None and fused.ok:
            _fused(store, jobs, staging, dtype, device, positions, slot_mapping, fused)
            path = fused.kind
        else:
            _generic(store, jobs, layers, staging, dtype, device, rotary, positions,
                     slot_mapping)
            path = "generic"
        return cls(dict(layers), torch.from_numpy(positions), torch.from_numpy(slot_mapping),
                   jobs, device, dtype, path)


def _fused(store: ResidentStore, jobs: list[Job], staging: Staging, dtype: torch.dtype,
           device: torch.device, positions: np.ndarray, slots: np.ndarray,
           fused: FusedWriter) -> None:
    sources, moved = [], {}
    for j in jobs:
        sl = slice(j.at, j.at + j.width)
        res = j.resident
        if res.slab.device == device and (res.slab.dtype == dtype or res.scales is not None):
            rows, scale_rows = _token_rows(j)  # [N] each (scale rows: fp8 only)
            sources.append(Source(res.slab, rows, positions[sl], slots[sl], res.scales,
                                  scale_rows))
        else:  # host tier behind a device (fp8 rows cross as fp8: half the bytes)
            moved.setdefault(res.slab.dtype, []).append(j)
    for kept, group in moved.items():  # only the needed rows cross, into staging
        _, _, L, H, D = group[0].resident.slab.shape
        fp8 = group[0].resident.scales is not None
        n = sum(j.width for j in group)
        buf = staging.take((n, 2, L, H, D), kept if fp8 else dtype, device)  # [n, 2, L, H, D]
        at, pos, sl_, scales, rows, base = 0, [], [], [], [], 0
        for j in group:
            store.gather(j.resident, j.chunks, j.start, j.end, buf[at:at + j.width])
            pos.append(positions[j.at:j.at + j.width])
            sl_.append(slots[j.at:j.at + j.width])
            if fp8:  # the rows' chunks' scales, renumbered for this source
                used, inverse = unique_runs(j.resident.scale_rows(j.chunks, j.start, j.end))
                scales.append(j.resident.scales[torch.from_numpy(used)])
                rows.append(inverse + base)
                base += len(used)
            at += j.width
        sources.append(Source(buf, np.arange(n, dtype=np.int64), np.concatenate(pos),
                              np.concatenate(sl_), torch.cat(scales) if fp8 else None,
                              np.concatenate(rows) if fp8 else None))
    fused.write(sources)


def _token_rows(j: Job) -> tuple[np.ndarray, np.ndarray | None]:
    res = j.resident
    return token_rows(res, j.chunks, j.start, j.end, scales=res.scales is not None)


def _generic(store: ResidentStore, jobs: list[Job], layers: list[tuple[int, Any]],
             staging: Staging, dtype: torch.dtype, device: torch.device,
             rotary: torch.nn.Module, positions: np.ndarray, slots: np.ndarray) -> None:
    n = sum(j.width for j in jobs)
    _, _, L, H, D = jobs[0].resident.slab.shape
    buf = staging.take((n, 2, L, H, D), dtype, device)  # [N, 2, L, H, D]
    for j in jobs:
        store.gather(j.resident, j.chunks, j.start, j.end, buf[j.at:j.at + j.width])
    pos = torch.from_numpy(positions).to(device, non_blocking=True)
    slot_mapping = torch.from_numpy(slots).to(device, non_blocking=True)
    # every layer's keys at once, in place: a [N, L*H*D] view, L*H "heads"
    rotate_with_model(rotary, pos, buf[:, 0].reshape(n, L * H, D))
    for idx, layer in layers:
        # [N, H, D] views (token stride 2*L*H*D), as the model's own q/k/v split passes
        write_layer_kv(layer, buf[:, 0, idx], buf[:, 1, idx], slot_mapping)


def token_rows(resident: Resident, chunks: list[str], start: int, end: int,
               scales: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """:meth:`Resident.token_rows`, where nothing to load is an error (ValueError)."""
    rows, scale_rows = resident.token_rows(chunks, start, end, scales=scales)
    if not len(rows):
        raise ValueError(f"no memory tokens in [{start}, {end})")
    return rows, scale_rows


def row_numpy(resident: Resident, chunks: list[str], start: int, end: int) -> np.ndarray:
    """Slab rows ``[N]`` (int64) of memory tokens ``[start, end)`` of the chunks'
    concatenation."""
    return token_rows(resident, chunks, start, end)[0]


def row_index(resident: Resident, chunks: list[str], start: int, end: int) -> torch.Tensor:
    """:func:`row_numpy` as a tensor."""
    return torch.from_numpy(row_numpy(resident, chunks, start, end))


def verify_step(step: StepLoad, hf_config: Any, block_size: int) -> dict:
    """Compare the paged cache at a kept load's slots with an independent computation:
    the residents' pre-RoPE K/V, rotated with transformers' tables of the served config
    (``hf_config``; fp32). Returns max abs errors, or ``checked: False`` where the
    backend's layout cannot be read back. Called through the worker extension's
    ``inferscale_verify_last_load``."""
    device = step.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    pre = torch.cat([j.resident.rows_float(row_index(j.resident, j.chunks, j.start, j.end))
                     .to(device) for j in step.jobs])  # [N, 2, L, H, D], fp8 dequantized
    tables = RotaryTables.from_config(hf_config, device=device)
    positions = step.positions.to(device)
    want_k = rotate_keys(pre[:, 0], positions, tables, token_dim=0)  # [N, L, H, D]
    err_k = err_v = 0.0
    scale = float(pre.abs().max())
    for idx, layer in step.layers.items():
        got = read_layer_kv(layer, step.slots.to(device), block_size)
        if got is None:
            return {"checked": False, "reason": f"{type(layer.impl).__name__} layout"}
        err_k = max(err_k, float((got[0].float() - want_k[:, idx]).abs().max()))
        err_v = max(err_v, float((got[1].float() - pre[:, 1, idx]).abs().max()))
    return {"checked": True, "tokens": int(pre.shape[0]), "max_abs_err_k": err_k,
            "max_abs_err_v": err_v, "max_abs_value": scale,
            "tiers": sorted({j.resident.tier for j in step.jobs}),
            "dtype": str(step.dtype), "path": step.path}
