"""Serving under load: goodput of KV injection against stock vLLM and the prompt baseline.

Many users with published artifacts (:mod:`benchmarks.datasets.users`: LoCoMo turns as
raw facts, in ``--groups`` memory groups of ``--facts`` facts) are served by InferScale's
OpenAI-compatible server (:mod:`benchmarks.lib.load.server_process`, a subprocess on
127.0.0.1).
Users are built once, for the largest of ``--user-counts`` (or ``--users``); each count
is a **scenario** run in turn in the same server: every user is evicted (admin API), the
count's most active users are hydrated into the gpu tier (as many as its budget holds)
and the next into the host tier (:func:`benchmarks.lib.load.plan.tier_plan`); every other
user is read from storage when first asked for. A warm-up in each mode: a burst at a high
rate (``--warmup-requests`` at ``--warmup-rate``), so that engine steps admit several
requests at once and every kernel specialization is compiled before measuring, then one
request per distinct query length (``--warmup-lengths``: the query embedder's CUDA graph
per length). With ``--peer`` the same load drives stock ``vllm serve`` instead, on the
prompts the prompt mode composes (:mod:`benchmarks.lib.load.peer`); its result, read back
with ``--peer-result``, sets KV's rates (its goodput P x ``--kv-rate-multipliers``), and
``--reuse-memory`` serves the users it published.

Load is open-loop: at each step, ``--requests`` requests arrive as a Poisson process at
the step's rate, whatever the server's progress; each asks a real LoCoMo question of one
of the scenario's users drawn by popularity (Zipf, ``--zipf``), with ``top_k`` facts and
exactly ``--max-tokens`` answer tokens (``ignore_eos``), streamed through the official
``openai`` client, so TTFT is what a client sees. Modes: ``prompt`` (the Mem0-style
baseline, facts as text, prefix caching on) and ``kv`` (memory injected). Which rates
run (:mod:`benchmarks.lib.load.plan`): the baseline rises through ``--rates`` until its first
miss of the objective (p99 TTFT <= ``--objective-ms``); its goodput G is the highest rate
that passed; KV then runs at ``--kv-rate-multipliers`` x G until its first miss
(``--kv-rates same``: both at every rate, the original procedure). The same rate gets
the same arrivals, users and questions in both modes.

Storage is what a disk delivers, never the page cache: the users of a group share one KV
file on disk (hard links), which is fair only because the server reads its store with
``O_DIRECT`` (``--storage-direct-io``, on by default); before the scenarios the run
measures that disk with the same reader (:mod:`benchmarks.lib.load.storage_bandwidth`) and every
result file records it under ``storage`` (``page_cache_bypassed`` only when the
measurement and every read of the server had it). A filesystem that refuses ``O_DIRECT``
stops the run at once, with an error, unless ``--no-storage-direct-io`` is given.

Per step: TTFT p50/p99 (client) and the requests over the objective, q2ft, engine TTFT,
the server's time before the engine (``memory_p50_ms``/``memory_p99_ms``: lookup,
retrieval, composition), end-to-end, tokens/s, dispatch lag, fallbacks, facts by the
tier they came from, and what ``/metrics`` says changed (:mod:`benchmarks.lib.load.scrapes`: the engine's busy-step time
p50/p99, the injection, the connector's time, vLLM's queue and prefill times,
reloads, promotions declined..., and the server's event-loop lag: ``loop_lag_p99_ms``,
``loop_lag_max_ms``, the largest lag's bucket), and whose memory each answer used. Summary per scenario
(:func:`benchmarks.lib.load.goodput.summarize`): the goodputs, ``goodput_vs_peer``,
``kv_p99_ttft_at_peer_goodput_ms``, ``goodput_vs_prompt``,
``kv_p99_ttft_at_prompt_goodput_ms``, ``memory.no_foreign_memory``, KV's requests by
the tier their user started in, the step times.
One result file per user count, rewritten after every step (:mod:`benchmarks.lib.load.run`).

    python -m benchmarks.load --users 8 --groups 2 --facts 200 --top-k 50 --max-tokens 8 \\
        --objective-ms 10000 --rates 0.04 0.07 0.12 0.2 0.3 0.45 0.7 --requests 8 \\
        --gpu-budget-gib 1 --host-budget-gib 1.5 --kv-cache-gib 2 --drain-s 60 \\
        --kv-rates same --out benchmarks/results/load-cpu-smollm2.json  # its steps
    bash benchmarks/gpu/h200.sh load  # H200: the peer, then users 24, 200, 2000 (Llama 8B)

Starts an engine (in the server process).
"""

from __future__ import annotations

import asyncio
import json
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

from inferscale.settings import offline_environment

offline_environment()

import torch  # noqa: E402

from benchmarks.lib.load import plan  # noqa: E402
from benchmarks.lib.load.goodput import machine  # noqa: E402
from benchmarks.lib.load.plan import GIB  # noqa: E402
from benchmarks.lib.load.run import Run, out_path, write  # noqa: E402
from benchmarks.lib.load.scrapes import HISTOGRAM_METHOD  # noqa: E402
from benchmarks.lib.load.server_process import ServerProcess  # noqa: E402
from benchmarks.lib.load.setup import build_memory, parser, resolve, served_layout  # noqa: E402
from benchmarks.lib.load.storage_bandwidth import (  # noqa: E402
    StorageNotBypassed, kv_files, refuse_unbypassed,
)
from benchmarks.lib.load.storage_bandwidth import measure as measure_storage  # noqa: E402
from benchmarks.lib.memory import placed_bytes  # noqa: E402
from benchmarks.lib.results import command_line  # noqa: E402


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
        from benchmarks.lib.load.peer import measure_peer

        base["estimate"] = plan.estimate(args, args.counts, setup_s=setup_s)
        print(plan.estimate_line(base["estimate"], args.counts), flush=True)
        return await measure_peer(args, base, memory, work, started, embedder)
    del embedder
    if cuda:
        torch.cuda.empty_cache()  # the engine and the gpu tier get the whole GPU
    # the disk under the store, read as the server reads it (lib/load/storage_bandwidth.py)
    memory["storage"] = base["storage"] = measure_storage(
        kv_files(memory["server"]["engine"]["artifact_root"]), direct=args.storage_direct_io,
        seconds=args.storage_seconds, max_bytes=int(args.storage_gib * GIB),
        threads=args.storage_threads)
    refuse_unbypassed(work, args.storage_direct_io, base["storage"])
    # the split's prior: the bandwidth just measured, as an operator sets
    # INFERSCALE_COLD_BANDWIDTH_PRIOR for its disk (its own estimate takes over once it reads)
    measured = [v for v in base["storage"]["bandwidth_bytes_per_s"].values() if v]
    if measured:
        memory["server"]["cold_split"]["bandwidth_prior"] = float(min(measured))
    print(json.dumps({"storage": {k: v for k, v in base["storage"].items() if k != "patterns"}}),
          flush=True)
    sizes = placed_sizes(memory, cuda)
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


def placed_sizes(memory: dict, cuda: bool) -> dict[str, int]:
    """user -> the bytes its version takes placed in the server's tiers (in the engine's
    dtype; fp8 kept with its scales on CUDA), from the manifests."""
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.read import read_manifest

    engine = memory["server"]["engine"]
    store = StoreConfig(engine["artifact_root"])
    return {u: placed_bytes(read_manifest(store, u, engine["model_fingerprint"], v["version"]),
                            engine["dtype"], cuda) for u, v in memory["versions"].items()}


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
        "command": command_line(__spec__.name, argv),
        "device": (torch.cuda.get_device_name() if cuda else platform.processor() or "cpu")
        + f" (torch {torch.__version__}, vllm {vllm.__version__})",
        "model": args.model, "user_counts": args.counts, "users_built": args.users,
        "groups": args.groups or args.users, "facts_per_user": args.facts,
        "memory_dtype": args.memory_dtype,
        "text_tail": args.text_tail, "layout": served_layout(args), "top_k": args.top_k,
        "max_tokens": args.max_tokens,
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
        sys.exit(f"benchmarks.load: {exc}")
    for result in results:
        print(json.dumps({"users": result["users"], **result["summary"]}))
    return results


if __name__ == "__main__":
    main()
