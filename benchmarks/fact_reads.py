"""What reading one request's facts from storage costs, as the serving worker reads them.

A request of a user in neither tier has its retrieved facts read from the user's kv file
(:class:`inferscale.hydrate.fact_reader.FactReader`, on the worker's threads inside
vLLM's engine process): the version's chunk index once per user (the kv file's index
columns, verified against the manifest), then one byte range per fact. This builds one
user of a model shape (LoCoMo turns as facts, random K/V of the shape, stored like the
load benchmark's users: ``benchmarks.datasets.users``) in ``--workdir`` and measures,
reading around the page cache (``O_DIRECT``) as the load benchmark's server does:

- ``index``: the chunk index read by a fresh reader (a user's first read), per sample;
- ``reads``: ``--k`` facts picked at random per sample, read three ways side by side in
  alternating order: ``bounced`` into a buffer with no slack (each fact through the
  aligned bounce buffer and a copy, unless the slab happens to sit on a 4 KiB boundary),
  ``in_place`` into :meth:`FactReader.buffer_bytes` of room (rows of whole 4 KiB blocks
  land where the file's offsets agree, and are read straight into the buffer), and
  ``raw``: ``os.preadv`` of the same facts' aligned ranges into aligned memory on as
  many threads, nothing checked (the disk's floor for this pattern);
- ``storage``: the load benchmark's bandwidth probe over the same file (32 MiB
  sequential, 8 MiB random on 8 threads).

The figures before the index was read from the Arrow buffers (commit 789b58d) came from
this script run against that tree (``--label``); that code had no ``buffer_bytes``,
so only ``bounced`` ran there.

    python -m benchmarks.fact_reads --workdir /tmp/fact-reads \\
        --out benchmarks/results/fact-reads-cpu.json

Callers: this CLI; ``tests/benchmarks/test_fact_reads.py`` (a tiny shape).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from inferscale.settings import offline_environment

offline_environment()

from benchmarks.lib.results import command_line, cpu_device, write_result  # noqa: E402
from inferscale.artifacts.direct_io import ALIGN  # noqa: E402

FP = "fact-reads-shape"  # the model fingerprint the user is published under


def build(args) -> tuple[object, str, str]:
    """The user (published into ``--workdir``, or reused from a run with the same
    settings) -> (store, user, version)."""
    import numpy as np
    import torch

    from benchmarks.datasets import users as U
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.models import resolve_checkpoint
    from inferscale.settings import Settings
    from transformers import AutoTokenizer

    work = Path(args.workdir)
    key = {"facts": args.facts, "shape": args.shape, "dtype": args.dtype,
           "tokenizer": args.tokenizer,
           "conversations": [str(Path(c).resolve()) for c in args.conversations]}
    store = StoreConfig(root=str(work / "store"), direct_io=not args.no_direct_io)
    marker = work / "user.json"
    if marker.exists() and json.loads(marker.read_text()).get("key") == key:
        got = json.loads(marker.read_text())
        return store, got["user"], got["version"]
    tok = AutoTokenizer.from_pretrained(args.tokenizer or str(
        resolve_checkpoint("embedded", Settings().home)))
    rng = np.random.default_rng(0)  # the embeddings are never read here
    pool, emb = U.pool_turns(args.conversations, tok,
                             lambda texts: rng.random((len(texts), 8), dtype=np.float32))
    (group,) = U.make_groups(len(pool), 1, min(args.facts, len(pool)), 1)
    dtype = getattr(torch, args.dtype)
    versions = U.publish_users(store, [group], pool, emb, tok, lambda g, fids: U.group_memory(
        g, fids, None, tok, pool, FP, tuple(args.shape), dtype), progress=lambda *_: None)
    (user, info), = versions.items()
    marker.write_text(json.dumps({"key": key, "user": user, "version": info["version"]}))
    return store, user, info["version"]


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": round(statistics.median(xs), 3), "min": round(min(xs), 3),
            "max": round(max(xs), 3)}


def raw_read(path: str, ranges: list[tuple[int, int]], threads: int) -> float:
    """Seconds to ``preadv`` each range's aligned superset into aligned memory."""
    spans = [(off // ALIGN * ALIGN, -(-(off + n) // ALIGN) * ALIGN) for off, n in ranges]
    buf = mmap.mmap(-1, sum(hi - lo for lo, hi in spans))
    view, at, jobs = memoryview(buf), 0, []
    for lo, hi in spans:
        jobs.append((view[at:at + hi - lo], lo))
        at += hi - lo
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        with ThreadPoolExecutor(threads) as pool:
            t = time.perf_counter()
            list(pool.map(lambda j: os.preadv(fd, [j[0]], j[1]), jobs))
            return time.perf_counter() - t
    finally:
        os.close(fd)
        for part, _ in jobs:
            part.release()
        view.release()
        buf.close()


def measure(args, store, user: str, version: str) -> dict:
    import torch

    from inferscale.hydrate.fact_reader import FactReader

    index_ms = []
    for _ in range(args.samples):
        t = time.perf_counter()
        index = FactReader(store, FP, workers=1).index(user, version)
        index_ms.append((time.perf_counter() - t) * 1e3)
    reader = FactReader(store, FP, workers=args.threads)
    facts = [c for c in index.rows if c != "prefix"]
    rng = random.Random(1)
    rb = index.row_bytes
    has_slack = hasattr(FactReader, "buffer_bytes")  # not in the trees before it
    ways = ("bounced", "in_place", "raw") if has_slack else ("bounced", "raw")
    rates: dict[str, list[float]] = {w: [] for w in ways}
    nbytes = []
    for s in range(args.samples):
        picked = rng.sample(facts, min(args.k, len(facts)))
        n = index.tokens(picked) * rb
        nbytes.append(n)
        order = list(ways) if s % 2 == 0 else list(reversed(ways))
        for way in order:
            if way == "raw":
                ranges = [(index.slab_offset + index.rows[c][0] * rb, index.rows[c][1] * rb)
                          for c in picked]
                secs = raw_read(index.path, ranges, args.threads)
            else:
                room = reader.buffer_bytes(index, picked) if way == "in_place" else n
                out = torch.empty(room + ALIGN, dtype=torch.uint8)
                skew = (-out.data_ptr()) % ALIGN  # a page-aligned start, as pinned memory
                t = time.perf_counter()
                reader.read(index, picked, out[skew:skew + room])
                secs = time.perf_counter() - t
            rates[way].append(n / secs / 1e9)
    from benchmarks.lib.load.storage_bandwidth import measure as probe

    storage = probe([index.path], direct=not args.no_direct_io, seconds=1.0)
    return {"chunks": len(facts), "row_bytes": rb, "slab_offset_mod_4096":
            index.slab_offset % ALIGN, "read_bytes_mean": round(statistics.mean(nbytes)),
            "index_ms": summary(index_ms),
            "reads_gb_per_s": {w: summary(v) for w, v in rates.items()},
            "storage": {"bandwidth_bytes_per_s": storage["bandwidth_bytes_per_s"],
                        "page_cache_bypassed": storage["page_cache_bypassed"],
                        "reader": storage["reader"]}}


def parse(argv: list[str] | None) -> argparse.Namespace:
    here = Path(__file__).resolve().parent
    locomo = here.parent.parent / "shared" / "data" / "locomo"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", nargs="+",
                    default=[str(locomo / "conv-26.json"), str(locomo / "conv-30.json")])
    ap.add_argument("--facts", type=int, default=400, help="facts of the user (LoCoMo turns)")
    ap.add_argument("--shape", type=int, nargs=3, default=[32, 8, 128],
                    metavar=("LAYERS", "KV_HEADS", "HEAD_DIM"),
                    help="the model's KV shape (default Llama-3.1-8B's)")
    ap.add_argument("--dtype", default="float8_e4m3fn",
                    choices=["float8_e4m3fn", "bfloat16", "float16", "float32"])
    ap.add_argument("--tokenizer", help="a tokenizer directory (default: the embedded "
                    "SmolLM2's, converted from its GGUF; the GPU staging's LEAN=1 has only "
                    "the tokenizer files)")
    ap.add_argument("--k", type=int, default=50, help="facts a request reads")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--threads", type=int, default=8, help="the reader's threads")
    ap.add_argument("--no-direct-io", action="store_true",
                    help="read through the page cache (not an honest storage figure)")
    ap.add_argument("--label", default="", help="a note kept in the result (e.g. the tree)")
    ap.add_argument("--workdir", required=True, help="where the user is published (reused)")
    ap.add_argument("--out", help="the result JSON")
    args = ap.parse_args(argv)
    if min(args.facts, args.k, args.samples, args.threads, *args.shape) < 1:
        ap.error("--facts, --k, --samples, --threads and --shape must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    t = time.perf_counter()
    store, user, version = build(args)
    built = time.perf_counter() - t
    row = measure(args, store, user, version)
    reads = row["reads_gb_per_s"]
    result = {"command": command_line("benchmarks.fact_reads", argv),
              "device": cpu_device(), "label": args.label, "shape": args.shape,
              "dtype": args.dtype, "facts": args.facts, "k": args.k,
              "threads": args.threads, "setup_seconds": round(built, 1), "rows": [row],
              "summary": {"index_ms_p50": row["index_ms"]["p50"],
                          **{f"{w}_gb_per_s_p50": v["p50"] for w, v in reads.items()},
                          "page_cache_bypassed": row["storage"]["page_cache_bypassed"]}}
    return write_result(result, args.out)


if __name__ == "__main__":
    main()
