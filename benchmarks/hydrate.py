"""Hydration throughput: publish a synthetic KV artifact, then hydrate it against a raw read.

Publishes one artifact of ``--size-gb`` (random bf16 KV, Qwen3-8B-like geometry:
36 layers, 8 KV heads, head_dim 128; chunks of 8-40 tokens) on a local root, then, in the
same run and alternating, ``--repeats`` times each:

- ``raw_read``: a plain sequential read of kv.arrow into a preallocated buffer (pinned
  when CUDA is used, plain memory otherwise), 64 MiB ``readinto`` calls;
- ``hydrate``: ``inferscale.hydrate.slab.hydrate(tier="host")``: manifest and fingerprint
  checks, the read fused with the xxh3-128 checksum, Arrow parsing, the slab view
  (pinned host memory on CUDA, plain memory/mmap on CPU);
- on CPU also ``hydrate_copy`` (``use_mmap=False``: the read-into-a-buffer path that the
  pinned tier uses on CUDA);
- on CUDA also ``h2d`` (hydrated pinned slab -> device), ``h2d_plain`` (a fresh pinned
  tensor of the same size -> device) and ``hydrate_gpu`` (``tier="gpu"``).

The page cache is dropped before every timed read when ``/proc/sys/vm/drop_caches`` can
be written (cold reads); otherwise reads are warm and the summary says so. Reported
figures are medians. No timed assertion anywhere: this prints figures.

Needs only torch, numpy, pyarrow, fsspec and xxhash (plus this repository).

    python -m benchmarks.hydrate --device cpu --size-gb 2 \
        --out benchmarks/results/hydrate-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import pyarrow as pa
import torch

from benchmarks.lib.results import command_line
from inferscale.artifacts.blobs import Location
from inferscale.artifacts.layout import KV_FILE, StoreConfig
from inferscale.artifacts.publish import Lineage, publish
from inferscale.artifacts.read import data_path
from inferscale.hydrate.slab import hydrate
from inferscale.types import PREFIX_ID
from storage_schemas import facts as facts_schema

REPO = Path(__file__).resolve().parents[1]

LAYERS, HEADS, HEAD_DIM = 36, 8, 128
FP = "bench-synthetic-qwen3-8b-geometry"
USER = "bench-user"
OPTIONAL = ("lancedb", "s3fs", "moto", "pydantic", "prefect", "vllm")


class Chunk:
    def __init__(self, chunk_id, token_ids, kv):
        self.chunk_id, self.token_ids, self.kv = chunk_id, token_ids, kv  # kv [T, 2, L, H, D]


class Memory:
    def __init__(self, chunks, fp, config):
        self.chunks, self.model_fingerprint, self.encoder_config = chunks, fp, config
        self.geometry = (LAYERS, HEADS, HEAD_DIM)  # the synthetic model's


def synthetic(size_bytes: int, seed: int = 0) -> tuple[Memory, pa.Table, Lineage]:
    row_bytes = 2 * LAYERS * HEADS * HEAD_DIM * 2
    tokens = max(1, size_bytes // row_bytes)
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(LAYERS, tokens, HEADS, HEAD_DIM, generator=g, dtype=torch.bfloat16)
    values = torch.randn(LAYERS, tokens, HEADS, HEAD_DIM, generator=g, dtype=torch.bfloat16)
    kv = torch.stack([keys, values]).permute(2, 0, 1, 3, 4)  # [T, 2, L, H, D] (a view)
    del keys, values
    lengths, total = [16], 16
    while total < tokens:
        n = min(int(torch.randint(8, 41, (1,), generator=g)), tokens - total)
        lengths.append(n)
        total += n
    lengths[-1] -= total - tokens
    chunks, fact_ids, token_ids, o = [], [], [], 0
    for i, n in enumerate(lengths):
        cid = PREFIX_ID if i == 0 else f"fact-{i:06d}"
        ids = list(range(o, o + n))
        chunks.append(Chunk(cid, ids, kv[o:o + n]))  # views
        if i:
            fact_ids.append(cid)
            token_ids.append(ids)
        o += n
    dim = 384
    facts = pa.table({
        "fact_id": fact_ids, "user": [USER] * len(fact_ids),
        "source_turn_id": ["t"] * len(fact_ids), "source_index": [0] * len(fact_ids),
        "text": ["synthetic"] * len(fact_ids), "token_ids": token_ids,
        "embedding": torch.randn(len(fact_ids), dim, generator=g).tolist(),
    }, schema=facts_schema.schema(dim))
    memory = Memory(chunks, FP, {"synthetic": True, "seed": seed, "dtype": "bfloat16"})
    return memory, facts, Lineage(f"synthetic-log-{seed}-{size_bytes}", f"synthetic-facts-{seed}")


def drop_caches() -> tuple[bool, str]:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True, "ok"
    except OSError as exc:
        return False, f"{type(exc).__name__}: {exc}"


def raw_read(path: str, buf: torch.Tensor) -> None:
    mv = memoryview(buf.numpy()).cast("B")
    n, size = 0, len(mv)
    with open(path, "rb", buffering=0) as f:
        while n < size:
            got = f.readinto(mv[n:n + (64 << 20)])
            if not got:
                raise RuntimeError(f"{path} ended at {n} bytes")
            n += got


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)}; torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {cpu}, {os.cpu_count()} cores; torch {torch.__version__}"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=2.0, help="artifact size in GB (1e9 bytes)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--root", default=str(REPO / "inferscale-data" / "bench-hydrate"),
                   help="local artifact root (created, then removed unless --keep)")
    p.add_argument("--out", help="write the JSON result here (also printed)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cache", choices=["both", "cold", "warm"], default="both",
                   help="page cache state of the timed reads (cold needs root; falls back "
                        "to warm)")
    p.add_argument("--keep", action="store_true", help="keep the published artifact")
    args = p.parse_args(argv)

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    cuda = dev.type == "cuda"
    store = StoreConfig(args.root)
    t = time.perf_counter()
    memory, facts, lineage = synthetic(int(args.size_gb * 1e9))
    gen_s = time.perf_counter() - t
    t = time.perf_counter()
    result = publish(store, USER, memory, facts, lineage, embeddings=False)
    publish_s = time.perf_counter() - t
    del memory, facts
    path = data_path(Location(store, USER, FP), result.manifest, KV_FILE)
    size = os.path.getsize(path)
    slab_bytes = result.manifest.kv["slab_bytes"]

    can_drop, drop_note = drop_caches()
    rows: list[dict] = []
    raw_buf = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
    raw_buf.fill_(0)  # touch every page before timing

    def timed(name: str, fn, nbytes: int, rep: int, cache: str):
        if cache == "cold":
            drop_caches()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rows.append({"op": name, "repeat": rep, "seconds": dt, "bytes": nbytes,
                     "gbps": nbytes / dt / 1e9, "page_cache": cache})
        return out

    # one untimed hydration first: warms the pinned host caching allocator on CUDA
    t = time.perf_counter()
    hydrate(store, USER, FP, tier="host", device=dev)
    first_s = time.perf_counter() - t
    hydrated = None
    caches = ["cold", "warm"] if can_drop and args.cache == "both" else (
        ["cold"] if can_drop and args.cache == "cold" else ["warm"])
    for cache in caches:
        if cache == "warm":
            raw_read(path, raw_buf)  # bring the file into the page cache
        for rep in range(args.repeats):
            # results are dropped at once: a live mmap would pin its pages in the page cache
            timed("raw_read", lambda: raw_read(path, raw_buf), size, rep, cache)
            hydrated = None
            hydrated = timed("hydrate", lambda: hydrate(store, USER, FP, tier="host", device=dev),
                             size, rep, cache)
            if not cuda:
                hydrated = None
                timed("hydrate_copy", lambda: hydrate(store, USER, FP, tier="host", device=dev,
                                                      use_mmap=False), size, rep, cache)
    if cuda:
        assert hydrated.slab.is_pinned()
        dst = torch.empty(slab_bytes, dtype=torch.uint8, device=dev)
        plain = torch.empty(slab_bytes, dtype=torch.uint8, pin_memory=True)
        plain.fill_(1)
        src = hydrated.slab.reshape(-1).view(torch.uint8)
        for rep in range(args.repeats):
            rows.append(_h2d("h2d", src, dst, rep))
            rows.append(_h2d("h2d_plain", plain, dst, rep))
        del dst, plain
        for rep in range(args.repeats):
            timed("hydrate_gpu", lambda: hydrate(store, USER, FP, tier="gpu", device=dev),
                  size, rep, caches[0])
        torch.cuda.empty_cache()

    def med(op: str, key: str = "gbps", cache: str = caches[0]) -> float | None:
        vals = [r[key] for r in rows if r["op"] == op and r["page_cache"] in (cache, "n/a")]
        return statistics.median(vals) if vals else None

    def ratio(op: str, cache: str = caches[0]) -> float:
        return med("raw_read", "seconds", cache) / med(op, "seconds", cache)

    summary = {
        "hydrate_vs_raw_read": ratio("hydrate"),
        "hydrate_gbps": med("hydrate"),
        "raw_read_gbps": med("raw_read"),
        "page_cache": ("cold: dropped before every timed read" if caches[0] == "cold"
                       else f"warm ({drop_note if not can_drop else 'asked for'})"),
        "hydrate_memory": "pinned host" if cuda else "plain host (mmap of the local file)",
        "artifact_bytes": size, "slab_bytes": slab_bytes,
        "chunks": result.manifest.counts["chunks"], "tokens": result.manifest.counts["tokens"],
        "geometry": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
        "repeats": args.repeats, "generate_s": gen_s, "publish_s": publish_s,
        "first_hydrate_s": first_s,
        "optional_modules_loaded": sorted(m for m in OPTIONAL if m in sys.modules),
    }
    if "warm" in caches and caches[0] != "warm":
        summary["hydrate_vs_raw_read_warm"] = ratio("hydrate", "warm")
        summary["hydrate_gbps_warm"] = med("hydrate", cache="warm")
        summary["raw_read_gbps_warm"] = med("raw_read", cache="warm")
    if not cuda:
        summary["hydrate_copy_gbps"] = med("hydrate_copy")
        summary["hydrate_copy_vs_raw_read"] = ratio("hydrate_copy")
        if "warm" in caches and caches[0] != "warm":
            summary["hydrate_copy_vs_raw_read_warm"] = ratio("hydrate_copy", "warm")
    else:
        summary["h2d_gbps"] = med("h2d")
        summary["h2d_plain_pinned_gbps"] = med("h2d_plain")
        summary["h2d_vs_plain_pinned"] = med("h2d") / med("h2d_plain")
        summary["hydrate_gpu_gbps"] = med("hydrate_gpu")
    out = {"command": command_line(__spec__.name, argv), "device": device_name(dev),
           "rows": rows, "summary": summary}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if not args.keep:
        shutil.rmtree(args.root, ignore_errors=True)
    return out


def _h2d(name: str, src: torch.Tensor, dst: torch.Tensor, rep: int) -> dict:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    dt = start.elapsed_time(end) / 1e3
    return {"op": name, "repeat": rep, "seconds": dt, "bytes": src.numel(),
            "gbps": src.numel() / dt / 1e9, "page_cache": "n/a"}


if __name__ == "__main__":
    main()
