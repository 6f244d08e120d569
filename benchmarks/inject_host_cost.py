"""Host-side cost of one engine step's fused injection, fp8 memory against bf16 memory.

What the engine's thread does on CUDA before the Triton launch (everything but the launch
and its two non-blocking copies), with the library's own code on the CPU: one request's
job from a GPU-tier resident of ``--facts`` facts (``[T, 2, L, H, D]``, Llama-3.1-8B
shape by default), ``k`` of them retrieved in random order plus the instruction prefix,

- ``build``: :meth:`StepLoad.run` up to the writer (positions, slots, each job's slab
  rows and, fp8, its chunks' scale rows: the :class:`Source` list);
- ``check``: :meth:`FusedWriter.check_source` per source (bounds, once per launch);
- ``batches``: :func:`batches` (the launches' token and scale capacities);
- ``pack``: :func:`pack` per launch (the index columns and, fp8, the used chunks' scales,
  written into buffers standing for the pinned ones);
- ``total``: the whole, one call of :meth:`StepLoad.run`.

Residents are built as a CUDA store keeps them (fp8 stays fp8 beside its host scales
``[C, 2, L, H]``): a CPU store would dequantize fp8 when placing it. The slab is a
broadcast view (its shape only; no byte of it is read). Medians over ``--repeats`` steps
that cycle through ``--queries`` retrievals.

    python -m benchmarks.inject_host_cost --out benchmarks/results/inject-host-cost-cpu.json

Callers: this CLI; ``tests/benchmarks/test_inject_host_cost.py`` (tiny sizes).
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
from typing import Callable

import numpy as np
import torch

from benchmarks.lib.results import command_line, cpu_device, write_result
from benchmarks.lib.step_inputs import (
    FP8, add_size_args, check_sizes, resident, retrievals,
)
from inferscale.hydrate.resident import Resident
from inferscale.hydrate.store import ResidentStore
from inferscale.vllm_plugin.compat import CacheLayout
from inferscale.vllm_plugin.inject import Job, StepLoad
from inferscale.vllm_plugin.kernels.indices import (
    INDEX_CAPACITY, SCALE_CAPACITY, Source, batches, pack,
)
from inferscale.vllm_plugin.kernels.writer import FusedWriter

DTYPES = {"fp8": FP8, "bf16": torch.bfloat16}
BLOCK = 16


class HostWriter:
    """The host half of :meth:`FusedWriter.write` on CUDA: checks, batches, packing."""

    ok, kind = True, "host"

    def __init__(self, L: int, H: int, D: int, positions: int, blocks: int):
        self.writer = FusedWriter([], None, torch.bfloat16)
        self.writer.layout = CacheLayout((2 * BLOCK * H * D, H * D, D, 1),
                                         (2 * BLOCK * H * D, H * D, D, 1), 0,
                                         BLOCK * H * D, BLOCK, H, D)
        self.writer.cos_sin = torch.empty(positions, D)  # [P, D]: its length is checked
        self.layer_idx, self.blocks = np.arange(L, dtype=np.int64), blocks
        self.out = np.empty(4 * INDEX_CAPACITY, dtype=np.int64)  # the pinned index buffer
        self.packed = np.empty(SCALE_CAPACITY, dtype=np.float32)  # the pinned scales
        self.sources: list[Source] = []

    def check(self, sources: list[Source]) -> None:
        for src in sources:
            self.writer.check_source(src, self.layer_idx, self.blocks)

    def pack(self, cut: list[list[Source]]) -> int:
        floats = 0
        for batch in cut:
            n = sum(len(s.rows) for s in batch)
            floats += pack(batch, self.out[:4 * n].reshape(4, n), self.packed)
        return floats

    def write(self, sources: list[Source]) -> None:
        self.sources = sources
        self.check(sources)
        self.pack(batches(sources, INDEX_CAPACITY, SCALE_CAPACITY))


class BuildOnly(HostWriter):
    def write(self, sources: list[Source]) -> None:
        self.sources = sources


def timed(fn: Callable[[int], object], repeats: int) -> float:
    """Median microseconds of ``fn(i)`` over ``repeats`` calls (after 20 warm-up calls)."""
    for i in range(20):
        fn(i)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 1)


def measure(res: Resident, k: int, queries: int, repeats: int, L: int, H: int,
            D: int) -> dict:
    picks, widths, _ = retrievals(res, k, queries)
    blocks = -(-max(widths) // BLOCK) + 1
    store = ResidentStore("cpu", 0, 0)
    layers = [(i, types.SimpleNamespace(kv_cache=torch.empty(0))) for i in range(L)]
    slots = [np.arange(BLOCK, BLOCK + w, dtype=np.int64) for w in widths]
    host = HostWriter(L, H, D, max(widths), blocks)
    build = BuildOnly(L, H, D, max(widths), blocks)

    def step(i: int, writer: HostWriter = host) -> None:
        q = i % queries
        StepLoad.run(store, [Job(res, picks[q], 0, widths[q], 0)], layers, torch.bfloat16,
                     None, [slots[q]], fused=writer)

    built = []
    for q in range(queries):
        step(q, build)
        built.append(build.sources)
    cut = [batches(s, INDEX_CAPACITY, SCALE_CAPACITY) for s in built]
    row = {"k": k, "tokens_mean": round(statistics.mean(widths), 1),
           "build_us": timed(lambda i: step(i, build), repeats),
           "check_us": timed(lambda i: host.check(built[i % queries]), repeats),
           "batches_us": timed(lambda i: batches(built[i % queries], INDEX_CAPACITY,
                                                 SCALE_CAPACITY), repeats),
           "pack_us": timed(lambda i: host.pack(cut[i % queries]), repeats),
           "total_us": timed(step, repeats)}
    row["scale_floats_per_step"] = host.pack(cut[0])
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_args(ap, repeats=2000)
    args = ap.parse_args(argv)
    check_sizes(ap, args)
    L, H, D = args.shape
    rows = []
    for name, dtype in DTYPES.items():
        res = resident(args.facts, args.tokens, args.prefix, dtype, L, H, D)
        for k in args.ks:
            rows.append({"memory": name, **measure(res, k, args.queries, args.repeats,
                                                   L, H, D)})
            print(rows[-1], flush=True)
    total = {(r["memory"], r["k"]): r["total_us"] for r in rows}
    summary = {"facts": args.facts, "shape": [L, H, D],
               **{f"total_us_{m}_k{k}": v for (m, k), v in total.items()},
               **{f"fp8_minus_bf16_us_k{k}": round(total["fp8", k] - total["bf16", k], 1)
                  for k in args.ks}}
    return write_result({"command": command_line(__spec__.name, argv),
                         "device": cpu_device(f"numpy {np.__version__}",
                                               f"torch {torch.__version__}"),
                         "rows": rows, "summary": summary}, args.out)


if __name__ == "__main__":
    main()
