"""Serving under load: goodput of KV injection against stock vLLM and the prompt baseline.

Many users with published artifacts (:mod:`benchmarks.load_users`: LoCoMo turns as raw
facts, in ``--groups`` memory groups of ``--facts`` facts) are served by InferScale's
OpenAI-compatible server (:mod:`benchmarks.load_server`, a subprocess on 127.0.0.1).
Users are built once, for the largest of ``--user-counts`` (or ``--users``); each count
is a **scenario** run in turn in the same server: every user is evicted (admin API), the
count's most active users are hydrated into the gpu tier (as many as its budget holds)
and the next into the host tier (:func:`benchmarks.load_plan.tier_plan`); every other
user is read from storage when first asked for. A warm-up in each mode: a burst at a high
rate (``--warmup-requests`` at ``--warmup-rate``), so that engine steps admit several
requests at once and every kernel specialization is compiled before measuring, then one
request per distinct query length (``--warmup-lengths``: the query embedder's CUDA graph
per length). With ``--peer`` the same load drives stock ``vllm serve`` instead, on the
prompts the prompt mode composes (:mod:`benchmarks.load_peer`); its result, read back
with ``--peer-result``, sets KV's rates (its goodput P x ``--kv-rate-multipliers``), and
``--reuse-memory`` serves the users it published.

Load is open-loop: at each step, ``--requests`` requests arrive as a Poisson process at
the step's rate, whatever the server's progress; each asks a real LoCoMo question of one
of the scenario's users drawn by popularity (Zipf, ``--zipf``), with ``top_k`` facts and
exactly ``--max-tokens`` answer tokens (``ignore_eos``), streamed through the official
``openai`` client, so TTFT is what a client sees. Modes: ``prompt`` (the Mem0-style
baseline, facts as text, prefix caching on) and ``kv`` (memory injected). Which rates
run (:mod:`benchmarks.load_plan`): the baseline rises through ``--rates`` until its first
miss of the objective (p99 TTFT <= ``--objective-ms``); its goodput G is the highest rate
that passed; KV then runs at ``--kv-rate-multipliers`` x G until its first miss
(``--kv-rates same``: both at every rate, the original procedure). The same rate gets
the same arrivals, users and questions in both modes.

Storage is what a disk delivers, never the page cache: the users of a group share one KV
file on disk (hard links), which is fair only because the server reads its store with
``O_DIRECT`` (``--storage-direct-io``, on by default); before the scenarios the run
measures that disk with the same reader (:mod:`benchmarks.storage_bandwidth`) and every
result file records it under ``storage`` (``page_cache_bypassed`` only when the
measurement and every read of the server had it). A filesystem that refuses ``O_DIRECT``
stops the run at once, with an error, unless ``--no-storage-direct-io`` is given.

Per step: TTFT p50/p99 (client) and the requests over the objective, q2ft, engine TTFT,
end-to-end, tokens/s, dispatch lag, fallbacks, facts by the tier they came from, and what
``/metrics`` says changed (:mod:`benchmarks.load_metrics`: the engine's busy-step time
p50/p99, the injection, the connector's time, vLLM's queue and prefill times,
reloads...), and whose memory each answer used. Summary per scenario
(:func:`benchmarks.load_stats.summarize`): the goodputs, ``goodput_vs_peer``,
``kv_p99_ttft_at_peer_goodput_ms``, ``goodput_vs_prompt``,
``kv_p99_ttft_at_prompt_goodput_ms``, ``memory.no_foreign_memory``, KV's requests by
the tier their user started in, the step times.
One result file per user count, rewritten after every step.

    python benchmarks/load.py --users 8 --groups 2 --facts 200 --top-k 50 --max-tokens 8 \\
        --objective-ms 10000 --rates 0.04 0.07 0.12 0.2 0.3 0.45 0.7 --requests 8 \\
        --gpu-budget-gib 1 --host-budget-gib 1.5 --kv-cache-gib 2 --drain-s 60 \\
        --kv-rates same --out benchmarks/results/load-cpu-smollm2.json  # its steps
    bash benchmarks/gpu/h200.sh load  # H200: the peer, then users 24, 200, 2000 (Llama 8B)

Starts an engine (in the server process): run as a script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferscale.settings import offline_environment  # noqa: E402

offline_environment()

import torch  # noqa: E402

from benchmarks import load_plan as plan  # noqa: E402
from benchmarks.common import command_line  # noqa: E402
from benchmarks.load_metrics import (  # noqa: E402
    HISTOGRAM_METHOD, parse, step_metrics, step_time,
)
from benchmarks.load_server import (  # noqa: E402
    Http, ServerProcess, engine_status, evict_all, hydrate_plan, residency, scrape_text,
    wait_idle,
)
from benchmarks.load_setup import (  # noqa: E402
    build_memory, parser, prompt_goodput_for, resolve,
)
from benchmarks.load_stats import GIB, machine, step_summary, summarize  # noqa: E402
from benchmarks.load_client import Load  # noqa: E402
from benchmarks.load_users import popularity  # noqa: E402
from benchmarks.storage_bandwidth import (  # noqa: E402
    StorageNotBypassed, kv_files, refuse_unbypassed, with_server_reads,
)
from benchmarks.storage_bandwidth import measure as measure_storage  # noqa: E402


# ------------------------------------------------------------------------ the run


class Run:
    """One server, its users, and the scenarios run over them."""

    def __init__(self, args, server: ServerProcess, memory: dict, sizes: dict, started: float):
        self.args, self.server, self.sizes, self.started = args, server, sizes, started
        self.measured = memory["storage"]  # the storage bandwidth this run measured
        self.http = Http(server.url)
        self.ranked = sorted(memory["versions"])  # load-0000 is the most active user
        self.versions = memory["versions"]
        self.users_info: dict[str, dict] = {}  # this scenario's user -> version, tier
        self.load = Load(args, server.url, memory["questions"], memory["shares"])
        self.lengths = memory["question_lengths"]
        self.evicted: set[str] = set()  # users this run evicted through the admin API
        self.first_prompt: tuple[float, str] | None = None  # --prompt-once: (G, where)
        self.profiler = None
        if args.profile_dir:
            from benchmarks.load_profile import Profiler

            self.profiler = Profiler(args, server.proc.pid)

    def left_s(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.started)

    async def storage(self, result: dict) -> None:
        """The run's storage measurement with what the server read, by reader, so far."""
        status = await asyncio.to_thread(engine_status, self.http)
        result["storage"] = with_server_reads(self.measured, status)

    async def scrape(self) -> tuple[str, dict]:
        text = await asyncio.to_thread(scrape_text, self.http)
        return text, parse(text)

    async def step(self, count: int, mode: str, rate: float) -> dict | None:
        """One measured step, or None when it could not end before the deadline."""
        args = self.args
        schedule = self.load.schedule(rate, seed=count * 100_003 + round(rate * 1000))
        if schedule[-1][0] + args.drain_s > self.left_s():
            return None
        text0, before = await self.scrape()
        load_at_start = os.getloadavg()[0]
        prof = None
        if self.profiler and self.profiler.wanted(count, mode):
            prof = self.profiler.start(count, mode, rate, schedule[-1][0])
        t = time.perf_counter()
        records = await self.load.step(mode, schedule)
        row = step_summary(records, mode, rate, args.objective_ms, self.users_info)
        row["seconds"] = round(time.perf_counter() - t, 1)
        await wait_idle(self.http, 60)
        text1, after = await self.scrape()
        row["metrics"] = step_metrics(before, after)
        row.update(step_time(row["metrics"]), loadavg_1m_start=round(load_at_start, 2))
        if prof is not None:
            row["profile"] = await asyncio.to_thread(self.profiler.finish, prof)
        if args.keep_scrapes:
            keep = Path(args.keep_scrapes)
            keep.mkdir(parents=True, exist_ok=True)
            for when, text in (("start", text0), ("end", text1)):
                (keep / f"u{count}-{mode}-{rate:g}rps-{when}.prom").write_text(text)
        print(json.dumps({"users": count, **{k: row[k] for k in (
            "mode", "rate", "completed", "over_objective", "ttft_p50_ms", "ttft_p99_ms",
            "q2ft_p99_ms", "step_p50_ms", "step_p99_ms", "fallbacks", "served_from",
            "meets_objective")}, "foreign_memory": (row["memory_check"] or {}).get("foreign")}),
            flush=True)
        return row

    async def warmup(self, count: int, modes: list[str]) -> dict:
        """A burst per mode at ``--warmup-rate``, then wait until the server is idle."""
        args, out = self.args, {}
        t0 = time.perf_counter()
        lengths = (self.load.every_length(self.lengths, args.warmup_rate)
                   if args.warmup_lengths and "peer" not in modes else [])
        for mode in modes:
            burst = (self.load.schedule(args.warmup_rate, seed=999_983 + count,
                                        n=args.warmup_requests)
                     if args.warmup_requests > 0 else [])
            for name, schedule in (("burst", burst), ("lengths", lengths)):
                if schedule:
                    records = await self.load.step(mode, schedule)
                    s = step_summary(records, mode, args.warmup_rate, args.objective_ms,
                                     self.users_info)
                    out[f"{mode}_{name}"] = {k: s[k] for k in (
                        "requests", "completed", "over_objective", "ttft_p50_ms", "ttft_p99_ms",
                        "memory_check")}
                await wait_idle(self.http, 60)
        return {"requests_per_mode": args.warmup_requests, "rate": args.warmup_rate,
                "query_lengths_per_mode": len(lengths),
                "seconds": round(time.perf_counter() - t0, 1), "by_mode": out}

    async def place(self, count: int, users: list[str], result: dict) -> None:
        """Evict every user, hydrate the count's planned tiers (``result["tiers"]``)."""
        args = self.args
        self.evicted.update(await asyncio.to_thread(evict_all, self.http))
        tiers = plan.tier_plan(users, self.sizes, args)
        flagged = [u for u in tiers["storage"] if u in self.evicted]
        hydrate_s = await asyncio.to_thread(hydrate_plan, self.http, tiers, flagged)
        placed = await asyncio.to_thread(residency, self.http)
        planned = {u: t for t in ("gpu", "host") for u in tiers[t]}
        share = {t: round(float(sum(self.load.weights[users.index(u)] for u in tiers[t])), 3)
                 for t in tiers}
        result["tiers"] = {
            "user_bytes_placed_mean": int(sum(self.sizes[u] for u in users) / count),
            "users": {t: len(v) for t, v in tiers.items()},
            "request_share_by_starting_tier": share, "hydrate_seconds": round(hydrate_s, 1),
            "residents_match_plan": placed == planned,
            "residents_off_plan": sorted(set(placed.items()) ^ set(planned.items()))[:10]}
        print(json.dumps({"users": count, **result["tiers"]}), flush=True)
        self.users_info = {u: {"version": self.versions[u]["version"], "tier": t}
                           for t in tiers for u in tiers[t]}

    async def scenario(self, count: int, result: dict, out: Path | None) -> dict:
        args = self.args
        t0 = time.monotonic()
        users = self.ranked[:count]
        self.load.users, self.load.weights = users, list(popularity(count, args.zipf))
        await self.place(count, users, result)
        given, source = prompt_goodput_for(args, count), "another run (--prompt-goodput)"
        if args.prompt_once and self.first_prompt is not None:  # KV against the first's G
            args = argparse.Namespace(**{**vars(args), "modes": ["kv"]})
            given, source = self.first_prompt
        result["modes"] = args.modes
        result["warmup"] = await self.warmup(count, args.modes)
        print(json.dumps({"users": count, "warmup": result["warmup"]}), flush=True)
        await self.storage(result)
        if out:
            write(result, out)
        rows: list[dict] = []
        history: list[tuple[str, float, bool | None]] = []
        while (nxt := plan.next_step(history, args, given)) is not None:
            mode, rate = nxt
            row = await self.step(count, mode, rate)
            if row is None:
                history.append((mode, rate, None))
                result["stopped_by_deadline"] = True
                continue
            rows.append(row)
            history.append((mode, rate, row["meets_objective"]))
            result.update(rows=rows, summary=summarize(rows, args, given, source))
            await self.storage(result)
            if out:
                write(result, out)
            await asyncio.sleep(args.settle_s)
        result["final_scrape_excerpt"] = [
            line for line in (await asyncio.to_thread(scrape_text, self.http)).splitlines()
            if line.startswith(("inferscale_requests_total", "inferscale_fallbacks_total",
                                "inferscale_resident_", "inferscale_reloads_total",
                                "inferscale_reload_seconds_count",
                                "inferscale_memory_facts_total"))]
        summary = summarize(rows, args, given, source)
        await self.storage(result)
        if args.prompt_once and self.first_prompt is None and "prompt" in args.modes:
            self.first_prompt = (summary["goodput_prompt_rps"],
                                 f"the {count}-user scenario of this run (--prompt-once)")
        result.update(rows=rows, summary=summary, machine_after=machine(),
                      scenario_seconds=round(time.monotonic() - t0, 1),
                      total_seconds=round(time.monotonic() - self.started, 1))
        return result


def out_path(args, count: int) -> Path | None:
    return Path(args.out.replace("{users}", str(count))) if args.out else None


async def measure(args, base: dict) -> list[dict]:
    from inferscale.serve.retrieval import Embedder

    cuda = torch.cuda.is_available()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="inferscale-load-"))
    work.mkdir(parents=True, exist_ok=True)
    refuse_unbypassed(work, args.storage_direct_io)  # before minutes of setup
    started = time.monotonic()
    embedder = Embedder(args.embedder, device="cuda" if cuda else "cpu",
                        dtype=torch.float16 if cuda else None)
    memory = build_memory(args, work, embedder, args.users)
    tok = embedder.model.tokenizer  # the server's embedder tokenizes queries the same way
    memory["question_lengths"] = {q: len(tok(q, truncation=True, max_length=256)["input_ids"])
                                  for qs in memory["questions"].values() for q in qs}
    setup_s = time.monotonic() - started
    base.update(setup_seconds=round(setup_s, 1), memory_reused=memory["reused"],
                machine_before=machine(),
                serve_settings={k: memory["server"][k] for k in ("memory_cache", "cold_split")})
    print(json.dumps({k: base[k] for k in ("setup_seconds", "memory_reused",
                                           "machine_before")}), flush=True)
    if args.peer:  # stock vLLM; the embedder composes its prompts
        from benchmarks.load_peer import measure_peer

        base["estimate"] = plan.estimate(args, args.counts, setup_s=setup_s)
        print(plan.estimate_line(base["estimate"], args.counts), flush=True)
        return await measure_peer(args, base, memory, work, started, embedder)
    del embedder
    if cuda:
        torch.cuda.empty_cache()  # the engine and the gpu tier get the whole GPU
    # the disk under the store, read as the server reads it (storage_bandwidth.py)
    memory["storage"] = base["storage"] = measure_storage(
        kv_files(memory["server"]["engine"]["artifact_root"]), direct=args.storage_direct_io,
        seconds=args.storage_seconds, max_bytes=int(args.storage_gib * GIB),
        threads=args.storage_threads)
    refuse_unbypassed(work, args.storage_direct_io, base["storage"])
    print(json.dumps({"storage": {k: v for k, v in base["storage"].items() if k != "patterns"}}),
          flush=True)
    # bf16 artifacts, placed in the engine's dtype (float32 on CPU: twice the bytes)
    factor = 2 if memory["server"]["engine"]["dtype"] == "float32" else 1
    sizes = {u: v["slab_bytes"] * factor for u, v in memory["versions"].items()}
    if max(sizes.values()) > args.host_budget_gib * GIB:
        raise ValueError(f"a user takes up to {max(sizes.values()) / GIB:.3f} GiB placed, more "
                         f"than --host-budget-gib {args.host_budget_gib}: reloads could never "
                         "land; raise the budget or lower --facts")
    ranked, resident = sorted(sizes), {}
    for c in args.counts:  # users hydrated per scenario, for the estimate
        tiers = plan.tier_plan(ranked[:c], sizes, args)
        resident[c] = len(tiers["gpu"]) + len(tiers["host"])
    base["estimate"] = plan.estimate(args, args.counts, resident, setup_s=base["setup_seconds"])
    print(plan.estimate_line(base["estimate"], args.counts), flush=True)
    server = ServerProcess.inferscale(memory["server"], work,
                                      Path(args.server_log or work / "server.log"))
    results = []
    try:
        t = time.monotonic()
        server.wait_ready(args.start_timeout_s)
        base["server_engine"] = {**(server.engine_info() or {}),
                                 "start_seconds": round(time.monotonic() - t, 1)}
        print(json.dumps({"server_engine": base["server_engine"]}), flush=True)
        run = Run(args, server, memory, sizes, started)
        for count in args.counts:
            result = {**base, "users": count}
            results.append(await run.scenario(count, result, out_path(args, count)))
            if out_path(args, count):
                write(result, out_path(args, count))
    finally:
        server.stop()
    return results


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({k: v for k, v in result.items() if not k.startswith("_")},
                              indent=2) + "\n")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = parser(__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    args = resolve(ap, ap.parse_args(argv), cuda)
    if args.estimate_only:
        setup = args.estimate_setup_s + (
            0.0 if args.reuse_memory else args.users * args.estimate_setup_per_user_s)
        resident = None  # users hydrated per count: all of them unless a user's size is given
        if args.estimate_user_gib:
            size = dict.fromkeys(range(args.users), int(args.estimate_user_gib * GIB))
            tiers = {c: plan.tier_plan(list(range(c)), size, args) for c in args.counts}
            resident = {c: len(t["gpu"]) + len(t["host"]) for c, t in tiers.items()}
        est = plan.estimate(args, args.counts, resident, setup_s=setup)
        print(plan.estimate_line(est, args.counts))
        return []
    import vllm  # noqa: F401 - its version goes into the result

    base: dict = {
        "command": command_line(argv),
        "device": (torch.cuda.get_device_name() if cuda else platform.processor() or "cpu")
        + f" (torch {torch.__version__}, vllm {vllm.__version__})",
        "model": args.model, "user_counts": args.counts, "users_built": args.users,
        "groups": args.groups or args.users, "facts_per_user": args.facts,
        "text_tail": args.text_tail, "top_k": args.top_k, "max_tokens": args.max_tokens,
        "zipf": args.zipf, "objective_ms": args.objective_ms, "modes": args.modes,
        "rates": args.rates, "kv_rates": args.kv_rates,
        "kv_rate_multipliers": args.kv_rate_multipliers,
        "prompt_goodput_given": args.prompt_goodput, "requests_per_step": args.requests,
        "peer_goodput": args.peer_goodput, "peer_source": args.peer_source,
        "budgets_gib": {"gpu": args.gpu_budget_gib, "host": args.host_budget_gib},
        "step_time_method": HISTOGRAM_METHOD,
    }
    # `timeout` (the GPU runs) sends SIGTERM: unwind, so that the server (a session of its
    # own) is stopped and each result file holds every finished step
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        results = asyncio.run(measure(args, base))
    except StorageNotBypassed as exc:
        sys.exit(f"load.py: {exc}")
    for result in results:
        print(json.dumps({"users": result["users"], **result["summary"]}))
    return results


if __name__ == "__main__":
    main()
