"""The server's garbage-collection pause with many users' facts held in memory.

The server's memory cache holds each user's facts (``inferscale.serve.memory_cache.
UserMemory``: fact ids, texts, token ids per chunk). CPython's collector traverses every
container it tracks on each full collection, a pause every request in flight waits out.
This builds ``--users`` users of ``--facts`` facts of ``--tokens`` token ids each twice:
as the server held them before issue 30's second H100 run (plain lists) and as
``UserMemory`` holds them now (ids and texts as tuples, which the collector stops
tracking after one pass; token ids one int32 array per user:
``inferscale.serve.user_memory``), and times ``--repeats`` full collections of each
(``gc.collect()``), reporting the median and the number of objects the collector
tracks. The engine's process holds the same users' chunk indexes (``inferscale.hydrate.
fact_reader.ChunkIndex``, an fp8 user's scales ``[C, 2, L, H]`` at ``--layers`` x
``--kv-heads``): timed likewise with a tensor per chunk (before) and one per user (now),
the imports' heap frozen first as vLLM's engine freezes its start-up heap.
Then (``--serving-imports``,
on by default) it imports what the server's process imports before it serves (vLLM's
``AsyncLLM``, torch, the server, the embedder's library, uvicorn) and times full
collections again, before and after ``serve_app``'s ``freeze_startup_heap``: the pause
the users' facts were not, and what freezing the start-up heap leaves.

    python -m benchmarks.gc_pause --out benchmarks/results/gc-pause-cpu.json

Callers: this CLI; ``tests/benchmarks/test_gc_pause.py`` (tiny sizes).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import random
import statistics
import time

from benchmarks.lib.results import command_line, cpu_device, write_result
from inferscale.serve.memory_cache import UserMemory


def users_as_lists(users: int, facts: int, tokens: int, seed: int = 0) -> list[dict]:
    """What the server held per user before: lists (the form ``to_pylist`` returns)."""
    rng = random.Random(seed)
    out = []
    for u in range(users):
        ids = [f"u{u}-f{i}" for i in range(facts)]
        out.append({"fact_ids": ids, "texts": [f"fact {i} of user {u}" for i in ids],
                    "token_ids": {f: [rng.randrange(50_000) for _ in range(tokens)]
                                  for f in ids}})
    return out


def held(users: list[dict]) -> list[UserMemory]:
    """The same users as the server holds them now."""
    return [UserMemory(f"user-{i}", "v", u["fact_ids"], u["texts"], u["token_ids"], None)
            for i, u in enumerate(users)]


def chunk_indexes(users: int, facts: int, tokens: int, layers: int, heads: int,
                  per_chunk: bool) -> list:
    """The users' chunk indexes as the engine's fact reader holds them: their scales one
    tensor per user (now), or, ``per_chunk``, a tensor per chunk (before). Imported here:
    torch's objects would otherwise count in the server's forms, timed first."""
    import torch

    from inferscale.hydrate.fact_reader import ChunkIndex

    out = []
    for u in range(users):
        ids = [f"u{u}-f{i}" for i in range(facts)]
        scales = torch.ones(facts, 2, layers, heads)  # [C, 2, L, H]
        index = ChunkIndex(f"user-{u}", "v", "kv.arrow", "float8_e4m3fn", (layers, heads, 128),
                           0, {c: (i * tokens, tokens, i) for i, c in enumerate(ids)},
                           {c: tuple(range(i, i + tokens)) for i, c in enumerate(ids)},
                           None if per_chunk else scales)
        out.append((index, dict(zip(ids, scales.unbind(0)))) if per_chunk else index)
    return out


def pause(repeats: int) -> dict:
    """Median and max seconds of a full collection, and the objects tracked."""
    gc.collect()  # the first pass untracks what it can
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t0)
    return {"full_collection_ms_median": round(statistics.median(times) * 1e3, 2),
            "full_collection_ms_max": round(max(times) * 1e3, 2),
            "tracked_objects": len(gc.get_objects())}


# what the server's process has imported by the time it serves (inferscale serve, the
# load benchmark's server process)
SERVING_IMPORTS = ("torch", "vllm.v1.engine.async_llm", "inferscale.serve.server",
                   "inferscale.serve.app", "sentence_transformers", "uvicorn")


def serving_rows(repeats: int) -> list[dict]:
    """Full collections with the serving process's imports loaded, then after its
    start-up heap is frozen (``inferscale.serve.app.freeze_startup_heap``)."""
    for name in SERVING_IMPORTS:
        importlib.import_module(name)
    from inferscale.serve.app import freeze_startup_heap

    rows = [{"form": "serving_imports", **pause(repeats)}]
    frozen = freeze_startup_heap()
    try:
        rows.append({"form": "serving_imports_frozen", **pause(repeats),
                     "frozen_objects": frozen})
    finally:
        gc.unfreeze()
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=2000)
    ap.add_argument("--facts", type=int, default=400)
    ap.add_argument("--tokens", type=int, default=40, help="token ids per fact")
    ap.add_argument("--layers", type=int, default=32, help="the chunk indexes' scales")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--serving-imports", action=argparse.BooleanOptionalAction, default=True,
                    help="also time collections with the server's imports, then frozen")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if min(args.users, args.facts, args.tokens, args.repeats, args.layers, args.kv_heads) < 1:
        ap.error("--users, --facts, --tokens, --layers, --kv-heads and --repeats must be >= 1")
    rows = []
    for form in ("lists", "user_memory", "chunk_indexes_per_chunk", "chunk_indexes"):
        engine = form.startswith("chunk_indexes")
        if engine:  # vLLM's engine freezes its start-up heap; the indexes come after
            importlib.import_module("inferscale.hydrate.fact_reader")  # torch too: frozen
            gc.collect()
            gc.freeze()
            data = chunk_indexes(args.users, args.facts, args.tokens, args.layers,
                                 args.kv_heads, per_chunk=form.endswith("per_chunk"))
        else:
            data = users_as_lists(args.users, args.facts, args.tokens)
        if form == "user_memory":
            data = held(data)
        rows.append({"form": form, **pause(args.repeats)})
        del data
        if engine:
            gc.unfreeze()
        print(rows[-1], flush=True)
    gc.collect()
    lists, now, per_chunk, indexes = rows
    if args.serving_imports:
        rows += serving_rows(args.repeats)
        for r in rows[4:]:
            print(r, flush=True)
    summary = {"users": args.users, "facts": args.facts, "tokens": args.tokens,
               "layers": args.layers, "kv_heads": args.kv_heads,
               **{f"{k}_{r['form']}": r[k] for r in rows
                  for k in ("full_collection_ms_median", "tracked_objects")}}
    summary["pause_ratio"] = round(lists["full_collection_ms_median"]
                                   / max(now["full_collection_ms_median"], 1e-3), 1)
    summary["engine_pause_ratio"] = round(per_chunk["full_collection_ms_median"]
                                          / max(indexes["full_collection_ms_median"], 1e-3), 1)
    return write_result({"command": command_line(__spec__.name, argv),
                         "device": cpu_device(),
                         "rows": rows, "summary": summary}, args.out)


if __name__ == "__main__":
    main()
