"""GPU time of one engine step's fused injection, fp8 memory against bf16 memory (CUDA).

Where the fp8 TTFT gap of ``ttft-h200-llama31-8b-fp8.json`` lies: the library's own
step (:meth:`StepLoad.run` with a real :class:`FusedWriter` and its Triton kernel) run
alone on the GPU, outside vLLM, from a GPU-tier resident of ``--facts`` facts
(``[T, 2, L, H, D]`` token-major, as a CUDA store places it; Llama-3.1-8B shape by
default) into 32 layers of a FlashAttention-layout bf16 paged cache, ``k`` facts
retrieved in random order plus the instruction prefix. Per step:

- ``gpu_us``: CUDA-event time from before the step's host work to after its kernel (the
  index and scale copies and the kernel; the otherwise idle GPU waits for the enqueue,
  so this is the step's whole latency);
- ``host_us``: the engine thread's part of it (build, checks, packing, launch).

Each step is synchronized before the next (no overlap between steps; a served step
overlaps the launch with the forward pass that follows). Medians over ``--repeats``
steps cycling through ``--queries`` retrievals, after warm-up steps that compile both
kernel variants.

    python -m benchmarks.inject_kernel --out "$OUT/inject-kernel-h100.json"

Callers: this CLI; ``benchmarks/gpu/h200.sh fp8 ttft``;
``tests/benchmarks/test_inject_kernel.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from benchmarks.lib.results import command_line, write_result
from benchmarks.lib.step_inputs import (
    FP8, add_size_args, check_sizes, resident, retrievals,
)
from inferscale.hydrate.resident import Resident
from inferscale.hydrate.store import ResidentStore
from inferscale.vllm_plugin.compat import CacheLayout
from inferscale.vllm_plugin.inject import Job, StepLoad
from inferscale.vllm_plugin.kernels.writer import FusedWriter

DTYPES = {"bf16": torch.bfloat16, "fp8": FP8}
BLOCK = 16


def writer(L: int, H: int, D: int, blocks: int, positions: int,
           device: torch.device) -> FusedWriter:
    """The library's Triton writer over ``L`` layers of one bf16 paged cache in
    FlashAttention's layout (per layer ``[2, B, block, H, D]``): no vLLM here, so no
    backend writer to check it against (the unit tests check the kernel)."""
    cache = torch.zeros((L, 2, blocks, BLOCK, H, D), dtype=torch.bfloat16, device=device)
    layout = CacheLayout((BLOCK * H * D, H * D, D, 1), (BLOCK * H * D, H * D, D, 1), 0,
                         blocks * BLOCK * H * D, BLOCK, H, D)
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    f = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    cos_sin = torch.cat([f.cos(), f.sin()], -1)  # [P, D]
    # each layer's cache [2, B, block, H, D] viewed with blocks first, as vLLM's are
    return FusedWriter.over([(i, cache[i].transpose(0, 1)) for i in range(L)], layout,
                            cos_sin, torch.bfloat16)


def measure(res: Resident, w: FusedWriter, k: int, queries: int, repeats: int,
            warmup: int) -> dict:
    picks, widths, rng = retrievals(res, k, queries)
    slots = [BLOCK + rng.permutation(w.blocks * BLOCK - BLOCK)[:n].astype(np.int64)
             for n in widths]  # scattered slots, as a busy cache gives
    store = ResidentStore(res.slab.device, 0, 0)
    layers = w.layers
    gpu, host = [], []
    for i in range(warmup + repeats):
        q = i % queries
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        begin.record()
        StepLoad.run(store, [Job(res, picks[q], 0, widths[q], 0)], layers, torch.bfloat16,
                     None, [slots[q]], fused=w)
        end.record()
        t1 = time.perf_counter()
        end.synchronize()
        if i >= warmup:
            host.append((t1 - t0) * 1e6)
            gpu.append(begin.elapsed_time(end) * 1e3)
    return {"k": k, "tokens_mean": round(statistics.mean(widths), 1),
            "gpu_us": round(statistics.median(gpu), 1),
            "gpu_us_p90": round(float(np.percentile(gpu, 90)), 1),
            "host_us": round(statistics.median(host), 1)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_args(ap, repeats=200)
    ap.add_argument("--blocks", type=int, default=2048, help="paged-cache blocks per layer")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    args = ap.parse_args(argv)
    check_sizes(ap, args)
    L, H, D = args.shape
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if args.blocks * BLOCK < BLOCK + max(args.ks) * (args.tokens + 8) + args.prefix:
        ap.error("--blocks too few for the largest k")
    if not torch.cuda.is_available():
        ap.error("needs CUDA (the Triton kernel compiled for the GPU)")
    device = torch.device("cuda")
    w = writer(L, H, D, args.blocks, args.prefix + max(args.ks) * (args.tokens + 8), device)
    rows = []
    for name, dtype in DTYPES.items():
        res = resident(args.facts, args.tokens, args.prefix, dtype, L, H, D, device)
        for k in args.ks:
            rows.append({"memory": name, **measure(res, w, k, args.queries, args.repeats,
                                                   args.warmup)})
            print(rows[-1], flush=True)
        del res
    by = {(r["memory"], r["k"]): r for r in rows}
    summary = {"shape": [L, H, D], "facts": args.facts,
               **{f"{f}_{m}_k{k}": r[f] for (m, k), r in by.items()
                  for f in ("gpu_us", "host_us")},
               **{f"fp8_minus_bf16_gpu_us_k{k}": round(by["fp8", k]["gpu_us"]
                                                       - by["bf16", k]["gpu_us"], 1)
                  for k in args.ks}}
    return write_result({"command": command_line(__spec__.name, argv),
                         "device": f"{torch.cuda.get_device_name()} (torch {torch.__version__})",
                         "rows": rows, "summary": summary}, args.out)


if __name__ == "__main__":
    main()
