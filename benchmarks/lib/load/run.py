"""The load benchmark's run (``benchmarks.load``): one server, its users, and the
scenarios run over them (a user count each: users placed in the tiers, a warm-up, then
the steps :mod:`benchmarks.lib.load.plan` decides), each result file rewritten after
every step. :class:`benchmarks.lib.load.peer.PeerRun` runs the same against stock vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from benchmarks.datasets.users import popularity
from benchmarks.lib.load import plan
from benchmarks.lib.load.client import Load
from benchmarks.lib.load.goodput import machine, step_summary, summarize
from benchmarks.lib.load.scrapes import loop_lag, parse, step_metrics, step_time
from benchmarks.lib.load.server_process import (
    Http, ServerProcess, engine_status, evict_all, hydrate_plan, preload_facts, residency,
    scrape_text, split_state, wait_idle,
)
from benchmarks.lib.load.setup import prompt_goodput_for
from benchmarks.lib.load.storage_bandwidth import with_server_reads


class Run:
    """One server, its users, and the scenarios run over them."""

    def __init__(self, args, server: ServerProcess, memory: dict, sizes: dict, started: float):
        self.args, self.server, self.sizes, self.started = args, server, sizes, started
        # the storage bandwidth this run measured (None against stock vLLM: no storage tier)
        self.measured: dict | None = memory.get("storage")
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
            from benchmarks.lib.load.profiler import Profiler

            self.profiler = Profiler(args, server.proc.pid)

    def left_s(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.started)

    async def storage(self, result: dict) -> None:
        """The run's storage measurement with what the server read, by reader, so far."""
        if self.measured is None:  # the peer: vllm serve reads no memory from storage
            return
        status = await asyncio.to_thread(engine_status, self.http)
        result["storage"] = with_server_reads(self.measured, status)

    async def scrape(self) -> tuple[str, dict]:
        text = await asyncio.to_thread(scrape_text, self.http)
        return text, parse(text)

    async def step(self, count: int, mode: str, rate: float) -> dict:
        """One measured step, or ``{"skipped": ...}`` (what it needed, what was left) when
        it could not end before the deadline."""
        args = self.args
        schedule = self.load.schedule(rate, seed=count * 100_003 + round(rate * 1000))
        needs, left = schedule[-1][0] + args.drain_s, self.left_s()
        if needs > left:
            return {"skipped": {"mode": mode, "rate": rate, "needs_s": round(needs, 1),
                                "left_s": round(max(left, 0.0), 1)}}
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
        if mode == "kv":  # what the split's E stood on at the step's end
            row["split_state"] = await asyncio.to_thread(split_state, self.http)
        row.update(step_time(row["metrics"]), **loop_lag(before, after),
                   loadavg_1m_start=round(load_at_start, 2))
        if prof is not None:
            row["profile"] = await asyncio.to_thread(self.profiler.finish, prof)
        if args.keep_scrapes:
            keep = Path(args.keep_scrapes)
            keep.mkdir(parents=True, exist_ok=True)
            for when, text in (("start", text0), ("end", text1)):
                (keep / f"u{count}-{mode}-{rate:g}rps-{when}.prom").write_text(text)
        print(json.dumps({"users": count, **{k: row[k] for k in (
            "mode", "rate", "completed", "over_objective", "ttft_p50_ms", "ttft_p99_ms",
            "q2ft_p99_ms", "step_p50_ms", "step_p99_ms", "loop_lag_p99_ms",
            "loop_lag_max_ms", "loop_stalls", "gc_pauses", "fallbacks", "served_from",
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
                    # the cold splits' estimates too: what the warm-up teaches the split
                    out[f"{mode}_{name}"] = {k: s[k] for k in (
                        "requests", "completed", "over_objective", "ttft_p50_ms", "ttft_p99_ms",
                        "memory_check", "cold_decisions", "slowest")}
                await wait_idle(self.http, 60)
            if mode == "kv":  # what the warm-up left the split's E standing on
                out[f"{mode}_split_state"] = await asyncio.to_thread(split_state, self.http)
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
        preload = None
        if args.preload_facts:  # the storage tier's facts held, as a vector store's
            preload = await asyncio.to_thread(preload_facts, self.http, {
                u: self.versions[u]["version"] for u in tiers["storage"]})
        placed = await asyncio.to_thread(residency, self.http)
        planned = {u: t for t in ("gpu", "host") for u in tiers[t]}
        share = {t: round(float(sum(self.load.weights[users.index(u)] for u in tiers[t])), 3)
                 for t in tiers}
        result["tiers"] = {
            "user_bytes_placed_mean": int(sum(self.sizes[u] for u in users) / count),
            "users": {t: len(v) for t, v in tiers.items()},
            "request_share_by_starting_tier": share, "hydrate_seconds": round(hydrate_s, 1),
            "facts_preloaded": preload, "residents_match_plan": placed == planned,
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
            if "skipped" in row:  # ends this mode: its rates rise only past steps that met
                history.append((mode, rate, None))
                result["stopped_by_deadline"] = True
                result.setdefault("skipped_steps", []).append(row["skipped"])
                print(json.dumps({"users": count, **row}), flush=True)
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


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({k: v for k, v in result.items() if not k.startswith("_")},
                              indent=2) + "\n")
