"""Serving under load: goodput of KV injection against the prompt baseline, one run.

Many users with published artifacts (:mod:`benchmarks.load_users`: LoCoMo turns as raw
facts, ``--users`` users in ``--groups`` memory groups of ``--facts`` facts) are served
by InferScale's OpenAI-compatible server (:mod:`benchmarks.load_server`, a subprocess on
127.0.0.1), with more users than the tier budgets hold. Before measuring, the most
active users are hydrated into the gpu tier (as many as its budget holds) and the next
ones into the host tier; every other user is read from storage by a background reload
when first asked for (its request is answered by prefill meanwhile), and reloads land
in the host tier, evicting its least recently used users.

Load is open-loop: at each arrival rate of ``--rates`` (requests/s, rising), ``--requests``
requests arrive as a Poisson process, whatever the server's progress; each asks a real
LoCoMo question of a user drawn by popularity (Zipf, ``--zipf``), with ``top_k`` memory
facts and exactly ``--max-tokens`` answer tokens (``ignore_eos``), streamed through the
official ``openai`` client, so TTFT is what a client sees (request sent -> first chunk,
which the server sends with the first token). Both modes (``kv``: memory KV injected;
``prompt``: the Mem0-style baseline, the same facts as text, prefix caching on) run at
every rate with the same arrival times, users and questions, alternating which goes
first; a mode stops after the first rate whose p99 TTFT misses the objective
(``--objective-ms``), or on the time limit (``--deadline-s``).

Per step: TTFT p50/p99 (client), query-to-first-token p50/p99 (server, in the response
extras), engine TTFT, end-to-end latency, output tokens/s, dispatch lag, fallbacks by
reason, and what ``/metrics`` says changed (reloads, failed loads, residents per tier).
Goodput of a mode: the highest rate whose p99 TTFT met the objective (a request that
failed or did not finish counts as missing it; :mod:`benchmarks.load_stats`). Summary:
both goodputs and ``goodput_vs_prompt``. The result file is rewritten after every step.

    python benchmarks/load.py --users 20 --groups 2 --facts 200 --objective-ms 6000 \\
        --rates 0.06 0.1 0.15 0.25 0.4 0.6 0.9 1.35 --requests 10 --gpu-budget-gib 1 \\
        --host-budget-gib 1.5 --kv-cache-gib 2 --out benchmarks/results/load-cpu-smollm2.json
    bash benchmarks/gpu/h200.sh load  # the H200 run: 200 users, Llama-3.1-8B shape

Starts an engine (in the server process): run as a script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferscale.settings import Settings, offline_environment  # noqa: E402

offline_environment()

import torch  # noqa: E402

from benchmarks.common import command_line  # noqa: E402
from benchmarks.load_server import (  # noqa: E402
    Http, ServerProcess, free_port, metrics_delta, scrape, wait_idle,
)
from benchmarks.load_stats import GIB, MODES, machine, step_summary, summarize  # noqa: E402
from benchmarks.shapes import SHAPES  # noqa: E402


# ------------------------------------------------------------------------ load


class Load:
    """The open-loop client: steps of Poisson arrivals through the ``openai`` client."""

    def __init__(self, args, url: str, users: list[str], weights, decks: dict):
        import openai

        self.args, self.users, self.weights = args, users, weights
        self.decks = decks  # mode -> user -> QuestionDeck (same seeds: same questions)
        self.client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                         timeout=args.request_timeout_s)

    def schedule(self, rate: float, seed: int) -> list[tuple[float, str]]:
        """``--requests`` (arrival time, user): exponential gaps, users by popularity."""
        rng = random.Random(seed)
        t, out = 0.0, []
        for _ in range(self.args.requests):
            t += rng.expovariate(rate)
            out.append((t, rng.choices(self.users, self.weights)[0]))
        return out

    async def one(self, user: str, question: str, mode: str, scheduled: float,
                  t0: float) -> dict:
        sent = time.perf_counter()
        rec: dict = {"user": user, "scheduled": scheduled, "sent": sent,
                     "lag_ms": (sent - t0 - scheduled) * 1e3}
        first = info = None
        tokens = 0
        try:
            stream = await self.client.chat.completions.create(
                model="load", user=user, messages=[{"role": "user", "content": question}],
                max_tokens=self.args.max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True},
                extra_body={"inferscale": {"mode": mode, "top_k": self.args.top_k},
                            "ignore_eos": True})
            async for chunk in stream:
                if first is None and chunk.choices:
                    first = time.perf_counter()
                info = (chunk.model_extra or {}).get("inferscale") or info
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            end = time.perf_counter()
            timings = info["timings_ms"]
            rec.update(ttft_ms=(first - sent) * 1e3, e2e_ms=(end - sent) * 1e3, end=end,
                       tokens=tokens, q2ft_ms=timings["query_to_first_token"],
                       engine_ttft_ms=timings["engine_ttft"],
                       injected=info.get("injected_tokens", 0),
                       memory_tokens=info.get("memory_tokens", 0),
                       fallback_reason=info.get("fallback_reason"))
        except asyncio.CancelledError:
            rec["error"] = "not finished within the drain time"
        except Exception as exc:  # noqa: BLE001 - a failed request counts against the mode
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return rec

    async def step(self, mode: str, schedule: list[tuple[float, str]]) -> list[dict]:
        decks = self.decks[mode]
        t0 = time.perf_counter()
        tasks = []
        for at, user in schedule:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.one(user, decks[user].next(), mode, at, t0)))
        _, pending = await asyncio.wait(tasks, timeout=self.args.drain_s)
        for t in pending:
            t.cancel()
        return [await t for t in tasks]


# ------------------------------------------------------------------------ setup


def build_memory(args, work: Path, embedder) -> tuple[dict, list, dict, dict]:
    """Publish every user -> (the server's config, the groups, the question decks per
    mode and user, user -> {"version", "slab_bytes"})."""
    from transformers import AutoTokenizer

    from benchmarks import load_users as lu
    from benchmarks.shapes import write_dummy_checkpoint
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.models import dummy_fingerprint, load_model, resolve_checkpoint

    home = Settings().home
    cuda = torch.cuda.is_available()
    store = StoreConfig(str(work / "artifacts"))
    if args.model in SHAPES:
        tok_dir = args.tokenizer or str(resolve_checkpoint("embedded", home))
        ckpt = write_dummy_checkpoint(args.model, tok_dir, work / args.model)
        fp, tok = dummy_fingerprint(ckpt), AutoTokenizer.from_pretrained(ckpt)
        engine = dict(model=str(ckpt), load_format="dummy",
                      dtype="bfloat16" if cuda else "float32")
    else:
        loaded = load_model(args.model, home, device="cpu", dtype="float32")
        ckpt, fp, tok = loaded.checkpoint, loaded.fingerprint, loaded.tokenizer
        engine = dict(model=str(ckpt), dtype="bfloat16" if cuda else "float32")
    pool = lu.pool_turns(args.conversations, tok)
    groups = lu.make_groups(len(pool), args.groups or args.users, args.facts, args.users)
    embeddings = embedder.embed([t.text for t in pool]).float().cpu().numpy()
    if args.model in SHAPES:
        cfg = SHAPES[args.model]
        shape = (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"])

        def memory_of(group, fids):
            return lu.group_memory(group, fids, None, tok, pool, fp, shape)
    else:
        t = time.perf_counter()
        encoded = lu.encode_pool(loaded.model, tok, pool, groups, fp, "bfloat16")
        print(f"encoded {len(encoded.chunks) - 1} turns at w=0 "
              f"in {time.perf_counter() - t:.0f} s", flush=True)
        del loaded

        def memory_of(group, fids):
            return lu.group_memory(group, fids, encoded, tok, pool, fp)
    versions = lu.publish_users(store, groups, pool, embeddings, memory_of,
                                progress=lambda m: print(m, flush=True))
    questions = lu.locomo_questions(args.conversations)
    decks = {mode: {u: lu.QuestionDeck(questions, lu.shares(g, pool), seed=int(u[5:]))
                    for g in groups for u in g.users} for mode in MODES}
    engine.update(
        model_fingerprint=fp, artifact_root=store.root, max_model_len=args.max_model_len,
        enforce_eager=not cuda if args.eager is None else args.eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=int(args.kv_cache_gib * GIB) if args.kv_cache_gib else None,
        gpu_budget_bytes=int(args.gpu_budget_gib * GIB),
        host_budget_bytes=int(args.host_budget_gib * GIB))
    server = {"engine": engine, "tokenizer": str(ckpt), "embedder": args.embedder,
              "top_k": args.top_k, "model_name": "load", "port": free_port()}
    return server, groups, decks, versions


def tier_plan(users: list[str], placed_bytes: dict[str, int], args) -> dict[str, list[str]]:
    """Users by popularity rank: the gpu tier as full as its budget allows, then the host
    tier; the rest start in storage."""
    plan: dict[str, list[str]] = {"gpu": [], "host": [], "storage": []}
    budget = {"gpu": args.gpu_budget_gib * GIB, "host": args.host_budget_gib * GIB}
    used = dict.fromkeys(budget, 0)
    tier = "gpu"
    for user in users:
        if tier == "gpu" and used["gpu"] + placed_bytes[user] > budget["gpu"]:
            tier = "host"
        if tier == "host" and used["host"] + placed_bytes[user] > budget["host"]:
            tier = "storage"
        plan[tier].append(user)
        if tier != "storage":
            used[tier] += placed_bytes[user]
    return plan


async def warm_tiers(http, plan: dict[str, list[str]]) -> float:
    """Hydrate the planned users, least active first, so that the most active are the
    most recently used (the host tier evicts the least recently used). Seconds taken."""
    t0 = time.perf_counter()
    for tier in ("host", "gpu"):
        for user in reversed(plan[tier]):
            status, text = await asyncio.to_thread(http.post, "/admin/hydrate",
                                                   {"user": user, "tier": tier})
            if status != 200 or json.loads(text)["tier"] != tier:
                raise RuntimeError(f"hydrating {user} into {tier}: {status} {text[:300]}")
    return time.perf_counter() - t0


# ------------------------------------------------------------------------ the run


async def measure(args, result: dict, out: Path | None) -> dict:
    from benchmarks import load_users as lu
    from inferscale.serve.retrieval import Embedder

    cuda = torch.cuda.is_available()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="inferscale-load-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    embedder = Embedder(args.embedder, device="cuda" if cuda else "cpu",
                        dtype=torch.float16 if cuda else None)
    server_cfg, groups, decks, versions = build_memory(args, work, embedder)
    del embedder
    if cuda:
        torch.cuda.empty_cache()  # the engine and the gpu tier get the whole GPU
    ranked = [u for g in groups for u in g.users]
    ranked.sort()  # load-0000 is the most active user, load-0001 the next, ...
    weights = lu.popularity(len(ranked), args.zipf)
    setup_s = time.monotonic() - started
    result.update(setup_seconds=round(setup_s, 1), machine_before=machine())
    print(json.dumps({"setup_seconds": result["setup_seconds"], **result["machine_before"]}),
          flush=True)

    # bf16 artifacts, placed in the engine's dtype (float32 on CPU: twice the bytes)
    factor = 2 if server_cfg["engine"]["dtype"] == "float32" else 1
    sizes = {u: v["slab_bytes"] * factor for u, v in versions.items()}
    if max(sizes.values()) > args.host_budget_gib * GIB:
        raise ValueError(f"a user takes up to {max(sizes.values()) / GIB:.3f} GiB placed, more "
                         f"than --host-budget-gib {args.host_budget_gib}: reloads could never "
                         "land; raise the budget or lower --facts")
    plan = tier_plan(ranked, sizes, args)
    server = ServerProcess(server_cfg, work, Path(args.server_log or work / "server.log"))
    rows: list[dict] = []
    try:
        server.wait_ready(args.start_timeout_s)
        http = Http(server.url)
        warm_s = await warm_tiers(http, plan)
        share = {t: round(float(sum(weights[ranked.index(u)] for u in plan[t])), 3)
                 for t in plan}
        result["tiers"] = {
            "user_bytes_placed_mean": int(sum(sizes.values()) / len(sizes)),
            "users": {t: len(v) for t, v in plan.items()},
            "request_share_by_starting_tier": share, "hydrate_seconds": round(warm_s, 1)}
        print(json.dumps(result["tiers"]), flush=True)
        load = Load(args, server.url, ranked, list(weights), decks)
        for mode in MODES:  # kernels, allocator, the client's connections
            warm = load.schedule(args.warmup_rate, seed=999)[:args.warmup_requests]
            await load.step(mode, warm)
        await wait_idle(http, 60)
        done: set[str] = set()
        for i, rate in enumerate(args.rates):
            schedule = load.schedule(rate, seed=i)
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                if mode in done:
                    continue
                need = schedule[-1][0] + args.drain_s
                if time.monotonic() - started + need > args.deadline_s:
                    done.add(mode)
                    result["stopped_by_deadline"] = True
                    continue
                before = await asyncio.to_thread(scrape, http)
                load_at_start = os.getloadavg()[0]
                t = time.perf_counter()
                records = await load.step(mode, schedule)
                row = step_summary(records, mode, rate, args.objective_ms)
                row["seconds"] = round(time.perf_counter() - t, 1)
                await wait_idle(http, 60)
                row["metrics"] = metrics_delta(before, await asyncio.to_thread(scrape, http))
                row["loadavg_1m_start"] = round(load_at_start, 2)
                rows.append(row)
                print(json.dumps({k: row[k] for k in (
                    "mode", "rate", "completed", "ttft_p50_ms", "ttft_p99_ms", "q2ft_p99_ms",
                    "e2e_p99_ms", "output_tokens_per_s", "fallbacks", "meets_objective")}),
                    flush=True)
                if not row["meets_objective"]:
                    done.add(mode)
                result.update(rows=rows, summary=summarize(rows, args))
                if out:
                    write(result, out)
                await asyncio.sleep(args.settle_s)
            if done >= set(MODES):
                break
        result["final_scrape_excerpt"] = [
            line for line in http.get("/metrics")[1].splitlines()
            if line.startswith(("inferscale_requests_total", "inferscale_fallbacks_total",
                                "inferscale_resident_", "inferscale_reloads_total",
                                "inferscale_reload_seconds_count"))]
    finally:
        server.stop()
    result.update(rows=rows, summary=summarize(rows, args), machine_after=machine(),
                  total_seconds=round(time.monotonic() - started, 1))
    return result


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({k: v for k, v in result.items() if not k.startswith("_")},
                              indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded",
                    help=f"'embedded', an HF checkpoint dir, or one of {sorted(SHAPES)}")
    ap.add_argument("--conversations", nargs="+", default=[
        "../shared/data/locomo/conv-26.json", "../shared/data/locomo/conv-30.json"])
    ap.add_argument("--users", type=int, default=20)
    ap.add_argument("--groups", type=int, default=None,
                    help="memory groups (default: one per user); users of a group share "
                         "their KV file on disk (hard links), never in memory")
    ap.add_argument("--facts", type=int, default=400, help="facts (LoCoMo turns) per user")
    ap.add_argument("--zipf", type=float, default=1.0,
                    help="popularity exponent: user rank r asks with weight r**-zipf")
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5, 0.75, 1.0],
                    help="arrival rates (requests/s), rising")
    ap.add_argument("--requests", type=int, default=50, help="requests per rate and mode")
    ap.add_argument("--objective-ms", type=float, default=1000.0, help="p99 TTFT objective")
    ap.add_argument("--gpu-budget-gib", type=float, default=1.5)
    ap.add_argument("--host-budget-gib", type=float, default=2.3)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="vLLM's KV cache (default: CPU 3 GiB; CUDA: by utilization)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--embedder", default="embedded")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir for the -shape models")
    ap.add_argument("--warmup-requests", type=int, default=6)
    ap.add_argument("--warmup-rate", type=float, default=0.5)
    ap.add_argument("--drain-s", type=float, default=120.0,
                    help="after a step's last arrival, wait this long for its requests")
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--start-timeout-s", type=float, default=900.0)
    ap.add_argument("--deadline-s", type=float, default=6 * 3600.0,
                    help="start no step that could end after this many seconds of the run")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--server-log", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.rates != sorted(args.rates) or min(args.rates) <= 0:
        ap.error("--rates must be positive and rising")
    cuda = torch.cuda.is_available()
    args.gpu_memory_utilization = args.gpu_memory_utilization or (0.85 if cuda else 0.5)
    if not cuda and args.kv_cache_gib is None:
        args.kv_cache_gib = 3.0
    import vllm  # noqa: F401 - its version goes into the result

    result: dict = {
        "command": command_line(argv),
        "device": (torch.cuda.get_device_name() if cuda else platform.processor() or "cpu")
        + f" (torch {torch.__version__}, vllm {vllm.__version__})",
        "model": args.model, "users": args.users, "groups": args.groups or args.users,
        "facts_per_user": args.facts, "top_k": args.top_k, "max_tokens": args.max_tokens,
        "zipf": args.zipf, "objective_ms": args.objective_ms, "rates": args.rates,
        "requests_per_step": args.requests,
        "budgets_gib": {"gpu": args.gpu_budget_gib, "host": args.host_budget_gib},
    }
    out = Path(args.out) if args.out else None
    # `timeout` (the GPU runs) sends SIGTERM: unwind, so that the server (a session of its
    # own) is stopped and the result file holds every finished step
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = asyncio.run(measure(args, result, out))
    if out:
        write(result, out)
    print(json.dumps(result["summary"]))
    return result


if __name__ == "__main__":
    main()
