"""Which misses should promote their user: a replay of the load benchmark's arrivals
against the connector's own admission rule (:class:`~inferscale.vllm_plugin.promotion.
Promotions`), no GPU and no engine.

Users are asked for with Zipf popularity (``benchmarks.load``'s: weight 1/rank); the
serving task places the most popular in the gpu tier (never dropped here: reloads land in
the host tier) and the next in the host tier, least recently used first out. A miss the
rule admits orders a whole-user reload that takes ``--reload-s`` on one of ``--workers``
(the connector's ``reload_workers``), then drops the host tier's least recently used user.
Each step prints the share of requests whose user was resident, and the reloads ordered.

Two rules side by side, the same arrivals: ``before`` (admission only after the first
drop, residents counting from zero, a miss needing just more than the least-asked
resident) and ``now`` (the connector's: full once the placed users fill the host tier,
residents counting ``min_requests`` from placement, a margin of one request).

    python -m benchmarks.promotion --users 2000 --gpu-slots 16 --host-slots 51
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import random
from collections import OrderedDict
from pathlib import Path

from inferscale.vllm_plugin.promotion import Promotions


def replay(rule: str, seed: int, users: int, gpu_slots: int, host_slots: int,
           steps: list[tuple[float, int]], reload_s: float, workers: int) -> dict:
    """One replay: per step (rate, requests) the share served from the tiers; reloads."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(users)]
    total, cum, acc = sum(weights), [], 0.0
    for w in weights:
        acc += w / total
        cum.append(acc)
    now_rule = rule == "now"
    promotions = Promotions() if now_rule else Promotions(margin=0.0)
    gpu = set(range(gpu_slots))
    # the serving task places the most popular last, so they are the most recently used
    host = OrderedDict((u, None) for u in reversed(range(gpu_slots, gpu_slots + host_slots)))
    if now_rule:
        for u in [*gpu, *host]:
            promotions.resident(u, now=0.0)
        promotions.dropped()  # the placement filled the host tier (ResidentAdded.full)
    running: list[tuple[float, int]] = []  # (done at, user)
    queued: list[int] = []
    pending: set[int] = set()
    t, reloads, out = 0.0, 0, []
    for rate, n in steps:
        hits = 0
        for _ in range(n):
            t += rng.expovariate(rate)
            while running and running[0][0] <= t:
                done, u = heapq.heappop(running)
                pending.discard(u)
                if len(host) >= host_slots:
                    host.popitem(last=False)
                    promotions.dropped()
                host[u] = None
                if now_rule:
                    promotions.resident(u, now=done)
                if queued:
                    heapq.heappush(running, (done + reload_s, queued.pop(0)))
            u = bisect.bisect_left(cum, rng.random())
            promotions.seen(u, now=t)
            if u in gpu or u in host:
                hits += 1
                if u in host:
                    host.move_to_end(u)
                continue
            if u in pending or not promotions.admit(u, [*gpu, *host], now=t):
                continue
            reloads += 1
            pending.add(u)
            if len(running) < workers:
                heapq.heappush(running, (t + reload_s, u))
            else:
                queued.append(u)
        out.append({"rate": rate, "requests": n, "served_from_tiers": hits / n})
    return {"steps": out, "reloads": reloads}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=2000)
    ap.add_argument("--gpu-slots", type=int, default=16, help="users placed in the gpu tier")
    ap.add_argument("--host-slots", type=int, default=51, help="users the host tier holds")
    ap.add_argument("--warmup", type=float, nargs=2, default=[64, 64],
                    metavar=("RATE", "REQUESTS"), help="the load benchmark's warm-up")
    ap.add_argument("--rates", type=float, nargs="+", default=[4, 12, 20])
    ap.add_argument("--requests", type=int, default=400, help="per step")
    ap.add_argument("--reload-s", type=float, default=5.0,
                    help="one whole-user reload (~1.3 GB fp8 at the reloads' 512 MiB/s, "
                    "two at once: ~5 s each on the H100)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=40, help="replays averaged")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.users < args.gpu_slots + args.host_slots or min(args.rates) <= 0:
        ap.error("need users >= gpu + host slots and rates > 0")
    steps = [(args.warmup[0], int(args.warmup[1]))] + [(r, args.requests) for r in args.rates]
    result = {"command": "python -m benchmarks.promotion " + " ".join(argv or []),
              "users": args.users, "gpu_slots": args.gpu_slots, "host_slots": args.host_slots,
              "zipf": 1.0, "seeds": args.seeds, "reload_s": args.reload_s,
              "steps": [{"rate": r, "requests": n} for r, n in steps], "rules": {}}
    for rule in ("before", "now"):
        runs = [replay(rule, s, args.users, args.gpu_slots, args.host_slots, steps,
                       args.reload_s, args.workers) for s in range(args.seeds)]
        shares = [round(sum(r["steps"][i]["served_from_tiers"] for r in runs) / len(runs), 4)
                  for i in range(len(steps))]
        result["rules"][rule] = {"served_from_tiers": shares,
                                 "reloads_per_replay": sum(r["reloads"] for r in runs) / len(runs)}
        print(rule, json.dumps(result["rules"][rule]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
