"""What a cold request costs the server before the engine, and whether it holds the loop.

A cold user is one the server's memory cache does not hold: its first request reads
LATEST, the manifest and the facts table (texts, token ids, embeddings) and builds the
user's retrieval index (``inferscale.serve.memory_cache``, on the cache's thread pool),
then embeds the query, takes the top-k and composes the prompt. This runs the real server
(``inferscale.serve.server.build_server`` without an engine: everything before it) over
users the load benchmark's builder publishes into a local store
(``benchmarks.datasets.users``: ``--facts`` LoCoMo turns each; random K/V of a tiny shape,
which the server never reads), read with ``O_DIRECT`` as the load benchmark's server reads
them (``--no-direct-io``: through the page cache). It reports:

- ``phases``: one cold user at a time, each stage timed on its own over ``--samples``
  users (median, p90, max): LATEST, the manifest, the facts table (read, checksum, Arrow
  parse), the retrieval index from it, the server's whole ``read_user`` and what of it
  the others leave (the facts as Python objects, the held memory), then the query's
  embedding, the top-k and the composition;
- ``burst``: ``--burst`` first requests of as many cold users at once, and one alone,
  ``--bursts`` times each, through ``MemoryServer.prepare`` on an event loop with the
  server's lag probe (``inferscale.serve.loop_lag``): each request's memory phase, the
  slowest per burst, the loop's lag p99/max (after one unmeasured burst: each thread's
  first call pays one-time costs);
- ``open_loop``: Poisson arrivals at ``--rate`` for ``--seconds``, ``--cold-share`` of
  them first requests of users never loaded, the rest of ``--resident`` users the server
  holds: the memory phase's p50/p99, the lag's p99/max, the garbage collections;
- ``idle``: the probe alone, the floor.

The query embedder runs on the CPU here (~15 ms a query; on a GPU server a CUDA graph
replay of ~1 ms): its share is reported apart, and ``--embed cached`` answers every
question from vectors the real embedder made before measuring, so the cold path's own
costs stand out as they would beside a GPU embedder. ``gc`` per scenario: collections by
generation, their longest and total pause (``gc.callbacks``).

    python -m benchmarks.cold_path --workdir /tmp/cold-path \\
        --out benchmarks/results/cold-path-cpu.json

Callers: this CLI; ``tests/benchmarks/test_cold_path.py`` (a few users of a few facts).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import shutil
import time
from pathlib import Path

from inferscale.settings import offline_environment

offline_environment()

from benchmarks.lib.results import command_line, cpu_device, write_result  # noqa: E402

FP = "cold-path-tiny-kv"  # the model fingerprint the users are published under
KV_SHAPE = (2, 1, 8)  # layers, KV heads, head dim: the server never reads the KV


def percentiles(xs: list[float]) -> dict:
    """n, p50, p90, p99 and max of ``xs`` (ms), nearest rank."""
    if not xs:
        return {"n": 0}
    s = sorted(xs)

    def rank(p: float) -> float:
        return round(s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))], 3)

    return {"n": len(s), "p50": rank(50), "p90": rank(90), "p99": rank(99),
            "max": round(s[-1], 3)}


class GcPauses:
    """Collections by generation while open, with their pauses (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._t = 0.0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.pauses[info["generation"]].append((time.perf_counter() - self._t) * 1e3)

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)

    def summary(self) -> dict:
        return {f"gen{g}": {"n": len(p), "max_ms": round(max(p, default=0.0), 3),
                            "total_ms": round(sum(p), 3)} for g, p in self.pauses.items()}


class CachedQueries:
    """The embedder (``dim``, ``device``, ``path``, ``embed``), answering a question
    it embedded before measuring from its table (``--embed cached``)."""

    def __init__(self, embedder, questions: list[str]):
        self.embedder, self.dim = embedder, embedder.dim
        self.device, self.path = embedder.device, embedder.path
        vectors = embedder.embed(questions)
        self.rows = {q: vectors[i:i + 1] for i, q in enumerate(questions)}

    def embed(self, texts):
        batch = [texts] if isinstance(texts, str) else list(texts)
        if len(batch) == 1 and batch[0] in self.rows:
            return self.rows[batch[0]].clone()
        return self.embedder.embed(batch)


def publish_users(args, tok, embedder) -> tuple[object, list[str], list[str]]:
    """The users (published into ``--workdir``, or reused from an earlier run with the
    same settings) -> (store, users, every question)."""
    import torch

    from benchmarks.datasets import users as lu
    from benchmarks.lib.memory import vectors
    from inferscale.artifacts.layout import StoreConfig

    work = Path(args.workdir)
    pool, emb = lu.pool_turns(args.conversations, tok, vectors(embedder))
    groups = lu.make_groups(len(pool), args.groups, args.facts, args.users)
    key = {"users": args.users, "groups": args.groups, "facts": args.facts, "fp": FP,
           "kv_shape": list(KV_SHAPE),
           "conversations": [str(Path(c).resolve()) for c in args.conversations]}
    saved = work / "memory.json"
    if not (saved.is_file() and json.loads(saved.read_text()) == key):
        shutil.rmtree(work / "artifacts", ignore_errors=True)
        work.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        lu.publish_users(StoreConfig(str(work / "artifacts")), groups, pool, emb, tok,
                         lambda g, fids: lu.group_memory(g, fids, None, tok, pool, FP,
                                                         KV_SHAPE, dtype=torch.bfloat16),
                         progress=lambda m: None)
        saved.write_text(json.dumps(key))
        print(f"published {args.users} users in {time.perf_counter() - t:.0f} s", flush=True)
    store = StoreConfig(str(work / "artifacts"), direct_io=args.direct_io)
    users = sorted(u for g in groups for u in g.users)
    questions = [q for qs in lu.locomo_questions(args.conversations).values() for q in qs]
    return store, users, questions


def phases(server, store, users: list[str], questions: list[str], k: int,
           rng: random.Random) -> dict:
    """Each stage of a cold request, one user at a time (ms per stage)."""
    from inferscale.artifacts.read import latest_version, read_facts, read_manifest
    from inferscale.serve.backend import AnswerRequest
    from inferscale.serve.retrieval import FactIndex

    times: dict[str, list[float]] = {}
    for user in users:
        t = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            times.setdefault(name, []).append((now - t) * 1e3)
            t = now

        version = latest_version(store, user, FP)
        lap("latest")
        read_manifest(store, user, FP, version)
        lap("manifest")
        facts = read_facts(store, user, FP, version)
        lap("facts_read")
        FactIndex.from_table(facts, device="cpu")
        lap("fact_index")
        mem = server.read_user(user, version)
        lap("read_user")
        info = server.compose(mem, AnswerRequest(user, rng.choice(questions), top_k=k,
                                                 mode="kv")).info.timings_ms
        for name in ("embed", "retrieve", "compose"):
            times.setdefault(name, []).append(getattr(info, name))
    n = len(users)
    times["read_user_rest"] = [times["read_user"][i] - sum(
        times[s][i] for s in ("manifest", "facts_read", "fact_index")) for i in range(n)]
    times["cold_total_but_embed"] = [sum(times[s][i] for s in (
        "latest", "read_user", "retrieve", "compose")) for i in range(n)]
    return {name: percentiles(v) for name, v in times.items()}


async def with_probe(work, interval_s: float) -> tuple[object, list[float], dict]:
    """``await work`` with a lag probe (ms samples) and the collections meanwhile."""
    from inferscale.serve.loop_lag import LoopLagProbe

    lags: list[float] = []
    probe = LoopLagProbe(lambda s: lags.append(s * 1e3), interval_s)
    probe.start()
    await asyncio.sleep(interval_s * 2)
    with GcPauses() as pauses:
        out = await work
    await asyncio.sleep(interval_s * 2)
    probe.stop()
    return out, lags, pauses.summary()


async def first_requests(server, users: list[str], questions: list[str], k: int,
                         rng: random.Random) -> list[dict]:
    """``prepare`` for each user at once: per request its memory ms and wall ms."""
    from inferscale.serve.backend import AnswerRequest

    async def one(user: str) -> dict:
        t = time.perf_counter()
        p = await server.prepare(AnswerRequest(user, rng.choice(questions), top_k=k,
                                               mode="kv"))
        return {"memory_ms": p.info.timings_ms.memory,
                "wall_ms": (time.perf_counter() - t) * 1e3, "facts": len(p.info.facts or [])}

    return await asyncio.gather(*(one(u) for u in users))


async def open_loop(server, cold: list[str], warm: list[str], questions: list[str],
                    args, rng: random.Random) -> list[dict]:
    """Poisson arrivals: ``--cold-share`` first requests of users never loaded."""
    from inferscale.serve.backend import AnswerRequest

    loop = asyncio.get_running_loop()
    cold_users, tasks, at = iter(cold), [], 0.0
    start = loop.time()

    async def one(user: str, is_cold: bool, due: float) -> dict:
        lag = (loop.time() - due) * 1e3
        t = time.perf_counter()
        p = await server.prepare(AnswerRequest(user, rng.choice(questions), top_k=args.top_k,
                                               mode="kv"))
        return {"cold": is_cold, "memory_ms": p.info.timings_ms.memory, "dispatch_lag_ms": lag,
                "wall_ms": (time.perf_counter() - t) * 1e3}

    while True:
        at += rng.expovariate(args.rate)
        if at > args.seconds:
            break
        await asyncio.sleep(max(0.0, start + at - loop.time()))
        is_cold = rng.random() < args.cold_share
        user = next(cold_users) if is_cold else rng.choice(warm)
        tasks.append(asyncio.ensure_future(one(user, is_cold, start + at)))
    return list(await asyncio.gather(*tasks))


def scenario(name: str, records: list[dict], lags: list[float], pauses: dict,
             **extra) -> dict:
    row = {"scenario": name, **extra, "requests": len(records),
           "memory_ms": percentiles([r["memory_ms"] for r in records]),
           "wall_ms": percentiles([r["wall_ms"] for r in records]),
           "loop_lag_ms": percentiles(lags), "loop_lag_total_ms": round(sum(lags), 3),
           "gc": pauses}
    for kind in ("cold", "warm"):
        part = [r["memory_ms"] for r in records if r.get("cold") is (kind == "cold")]
        if part:
            row[f"memory_ms_{kind}"] = percentiles(part)
    if any("dispatch_lag_ms" in r for r in records):
        row["dispatch_lag_ms"] = percentiles([r["dispatch_lag_ms"] for r in records])
    print(json.dumps({k: row[k] for k in ("scenario", "requests", "memory_ms", "loop_lag_ms")}),
          flush=True)
    return row


def build(args):
    """The tokenizer, the CPU embedder, the users and a server without an engine."""
    from transformers import AutoTokenizer

    from inferscale.models import resolve_checkpoint
    from inferscale.serve.cold_split import ColdSplitConfig
    from inferscale.serve.memory_cache import MemoryCacheConfig
    from inferscale.serve.retrieval import Embedder
    from inferscale.serve.server import ServerConfig, build_server
    from inferscale.settings import Settings

    tok = AutoTokenizer.from_pretrained(resolve_checkpoint("embedded", Settings().home))
    embedder = Embedder(args.embedder, device="cpu")
    store, users, questions = publish_users(args, tok, embedder)
    if args.embed == "cached":
        embedder = CachedQueries(embedder, sorted(set(questions)))
    # no rate limit (the load benchmark's), no compute-or-load split (that needs an engine)
    config = ServerConfig(top_k=args.top_k, cache=MemoryCacheConfig(
        budget_bytes=64 << 30, misses_per_s=1e6, miss_burst=10**6),
        cold=ColdSplitConfig(mode="off"))
    return build_server(None, tok, embedder, store, config, fingerprint=FP), store, users, \
        questions


async def measure(args, server, store, users: list[str], questions: list[str]) -> list[dict]:
    rng = random.Random(args.seed)
    warm, cold = users[:args.resident], users[args.resident:]
    t = time.perf_counter()
    for user in warm:  # what the server holds: loaded as a first request would
        server.memories.put(server.read_user(user))
    print(f"holding {len(warm)} users ({server.memories.nbytes / 2**20:.0f} MiB) after "
          f"{time.perf_counter() - t:.0f} s", flush=True)
    for u in questions[:3]:  # the embedder's first calls
        server.embedder.embed([u])
    rows = [{"scenario": "phases", "ms": phases(server, store, cold[:args.samples], questions,
                                                args.top_k, rng)}]
    print(json.dumps(rows[0]), flush=True)
    cold = cold[args.samples:]
    _, lags, pauses = await with_probe(asyncio.sleep(args.idle_s), args.interval_s)
    rows.append(scenario("idle", [], lags, pauses, seconds=args.idle_s))
    # each pool thread's first load, the retrieval thread's first query: not measured
    group, cold = cold[:args.burst], cold[args.burst:]
    await first_requests(server, group, questions, args.top_k, rng)
    for n in (1, args.burst):
        groups = [cold[i * n:(i + 1) * n] for i in range(args.bursts)]
        cold = cold[n * args.bursts:]

        async def bursts() -> list[list[dict]]:
            out = []
            for group in groups:
                out.append(await first_requests(server, group, questions, args.top_k, rng))
                await asyncio.sleep(0.05)
            return out

        out, lags, pauses = await with_probe(bursts(), args.interval_s)
        rows.append(scenario(f"burst_{n}", [r for b in out for r in b], lags, pauses,
                             concurrent=n, bursts=args.bursts, slowest_per_burst_ms=percentiles(
                                 [max(r["memory_ms"] for r in b) for b in out])))
    out, lags, pauses = await with_probe(open_loop(server, cold, warm, questions, args, rng),
                                         args.interval_s)
    rows.append(scenario("open_loop", out, lags, pauses, rate=args.rate,
                         seconds=args.seconds, cold_share=args.cold_share))
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = ap.add_argument
    a("--users", type=int, default=2000, help="users published (resident and cold)")
    a("--groups", type=int, default=20, help="memory groups (users of a group share facts)")
    a("--facts", type=int, default=400, help="facts (LoCoMo turns) per user")
    a("--resident", type=int, default=1000, help="users the server holds before measuring")
    a("--samples", type=int, default=40, help="cold users timed stage by stage")
    a("--burst", type=int, default=12, help="first requests of cold users at once")
    a("--bursts", type=int, default=8, help="bursts measured (and as many single requests)")
    a("--rate", type=float, default=12.0, help="open-loop arrivals per second")
    a("--seconds", type=float, default=20.0, help="open-loop duration")
    a("--cold-share", type=float, default=0.5, help="share of open-loop arrivals for cold users")
    a("--idle-s", type=float, default=1.0, help="the idle probe's duration")
    a("--interval-s", type=float, default=0.01, help="the lag probe's sleep")
    a("--top-k", type=int, default=50)
    a("--direct-io", action=argparse.BooleanOptionalAction, default=True,
      help="read the store around the page cache (O_DIRECT), as the load benchmark does")
    a("--embedder", default="embedded")
    a("--embed", choices=("model", "cached"), default="model",
      help="the query embedding: the model on the CPU, or vectors it made before measuring")
    a("--label", default=None, help="recorded in the result (e.g. the code measured)")
    a("--conversations", nargs="+", default=[
        "../shared/data/locomo/conv-26.json", "../shared/data/locomo/conv-30.json"])
    a("--workdir", default="/tmp/inferscale-cold-path",
      help="where the users are published (reused by a later run with the same settings)")
    a("--torch-threads", type=int, default=1,
      help="torch's CPU threads (on a shared 2-core machine two threads wait on each other "
           "whenever another process takes a core: timings swing tenfold)")
    a("--seed", type=int, default=0)
    a("--out", default=None)
    args = ap.parse_args(argv)
    if min(args.users, args.groups, args.facts, args.samples, args.burst, args.bursts) < 1 or \
            args.resident < 1 or args.rate <= 0 or args.seconds <= 0 or \
            not 0 <= args.cold_share <= 1 or args.interval_s <= 0:
        ap.error("sizes must be >= 1, --rate, --seconds and --interval-s > 0, "
                 "--cold-share in [0, 1]")
    if args.groups > args.users:
        ap.error("--groups must be <= --users")
    # cold users: the stage samples, the unmeasured burst, the bursts and single ones,
    # the open loop's (with room)
    need = args.resident + args.samples + args.burst + args.bursts * (1 + args.burst) + int(
        args.rate * args.seconds * args.cold_share * 1.5 + 10)
    if args.users < need:
        ap.error(f"--users {args.users}: these settings need {need}")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(args.torch_threads)
    t = time.perf_counter()
    server, store, users, questions = build(args)
    try:
        rows = asyncio.run(measure(args, server, store, users, questions))
    finally:
        server.close()
        torch.set_num_threads(threads)
    ph = rows[0]["ms"]
    by = {r["scenario"]: r for r in rows[1:]}
    burst = by[f"burst_{args.burst}"]
    summary = {
        "users": args.users, "facts": args.facts, "resident": args.resident,
        "direct_io": args.direct_io, "torch_threads": args.torch_threads,
        "embed": args.embed, "label": args.label,
        "read_user_p50_ms": ph["read_user"]["p50"],
        "cold_request_p50_ms_but_embed": ph["cold_total_but_embed"]["p50"],
        "embed_p50_ms": ph["embed"]["p50"],
        "idle_loop_lag_max_ms": by["idle"]["loop_lag_ms"].get("max"),
        "single_memory_p50_ms": by["burst_1"]["memory_ms"]["p50"],
        "burst_memory_p50_ms": burst["memory_ms"]["p50"],
        "burst_slowest_p50_ms": burst["slowest_per_burst_ms"]["p50"],
        "burst_memory_max_ms": burst["memory_ms"]["max"],
        "burst_loop_lag_max_ms": burst["loop_lag_ms"].get("max"),
        "burst_loop_lag_total_ms": burst["loop_lag_total_ms"],
        "open_loop_memory_p50_ms": by["open_loop"]["memory_ms"]["p50"],
        "open_loop_memory_p99_ms": by["open_loop"]["memory_ms"]["p99"],
        "open_loop_loop_lag_p99_ms": by["open_loop"]["loop_lag_ms"].get("p99"),
        "open_loop_loop_lag_max_ms": by["open_loop"]["loop_lag_ms"].get("max"),
        "seconds": round(time.perf_counter() - t, 1)}
    return write_result({"command": command_line(__spec__.name, argv),
                         "device": cpu_device("embedder on cpu"),
                         "rows": rows, "summary": summary}, args.out)


if __name__ == "__main__":
    main()
