"""The load benchmark's setup (``benchmarks.load``): its command line, and the memory it
serves (every user published once, for the largest user count, or reused from an
earlier run in the same ``--workdir``) with the server's config.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.lib.load.plan import GIB
from benchmarks.lib.shapes import SHAPES
from inferscale.settings import Settings

MEMORY_FILE = "memory.json"  # in --workdir: what was published there, for --reuse-memory


def served_layout(args) -> dict:
    """How requests lay out the users' memory (kept with their artifacts): ``--text-tail``
    and the encoder's default order and tail bound."""
    from inferscale.encode.identity import EncoderConfig

    cfg = EncoderConfig(window=0, text_tail=args.text_tail)
    return {"memory_order": cfg.memory_order, "text_tail": cfg.text_tail,
            "tail_max_k": cfg.tail_max_k}


def memory_key(args, users: int) -> dict:
    """The settings the published users depend on (``--reuse-memory`` compares them)."""
    return {"model": args.model, "users": users, "groups": args.groups or users,
            "facts": args.facts, "layout": served_layout(args), "tokenizer": args.tokenizer,
            "memory_dtype": args.memory_dtype,
            "embedder": args.embedder,
            "conversations": [str(Path(c).resolve()) for c in args.conversations]}


def reused_memory(args, work: Path, users: int) -> dict | None:
    """What an earlier run published in ``work`` with the same settings (``--reuse-memory``;
    None: nothing was published there yet). Users published with other settings cannot
    be published again beside them: refused."""
    saved = work / MEMORY_FILE
    if not args.reuse_memory or not saved.is_file():
        return None
    data = json.loads(saved.read_text())
    key = memory_key(args, users)
    if data["key"] != key:
        differ = sorted(k for k in key if data["key"].get(k) != key[k])
        raise ValueError(f"--reuse-memory: {work} holds users published with other settings "
                         f"({', '.join(differ)}); use a fresh --workdir")
    return data


def build_memory(args, work: Path, embedder, users: int) -> dict:
    """Publish ``users`` users (or reuse those an earlier run published in ``work``:
    ``--reuse-memory``) -> ``{"server": the server's config, "groups", "questions":
    conversation -> questions, "shares": user -> conversation shares, "versions": user
    -> {"version", "slab_bytes"}, "reused": whether they were reused}``."""
    from transformers import AutoTokenizer

    from benchmarks.datasets import users as lu
    from benchmarks.lib.memory import vectors
    from benchmarks.lib.shapes import dummy_checkpoint
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.models import dummy_fingerprint, load_model, resolve_checkpoint

    home = Settings().home
    cuda = torch.cuda.is_available()
    store = StoreConfig(str(work / "artifacts"))
    if args.model in SHAPES:
        tok_dir = args.tokenizer or str(resolve_checkpoint("embedded", home))
        ckpt = dummy_checkpoint(args.model, tok_dir, work / args.model)
        fp, tok = dummy_fingerprint(ckpt), AutoTokenizer.from_pretrained(ckpt)
        engine = dict(model=str(ckpt), load_format="dummy",
                      dtype="bfloat16" if cuda else "float32")
    else:
        loaded = load_model(args.model, home, device="cpu", dtype="float32")
        ckpt, fp, tok = loaded.checkpoint, loaded.fingerprint, loaded.tokenizer
        engine = dict(model=str(ckpt), dtype="bfloat16" if cuda else "float32")
    pool, embeddings = lu.pool_turns(args.conversations, tok, vectors(embedder))
    groups = lu.make_groups(len(pool), args.groups or users, args.facts, users)
    reused = reused_memory(args, work, users)
    versions = reused["versions"] if reused else publish_memory(
        args, store, tok, fp, pool, embeddings, groups,
        None if args.model in SHAPES else loaded)
    if not reused:
        (work / MEMORY_FILE).write_text(json.dumps(
            {"key": memory_key(args, users), "versions": versions}))
    engine.update(
        model_fingerprint=fp, artifact_root=store.root, max_model_len=args.max_model_len,
        enforce_eager=not cuda if args.eager is None else args.eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **({} if args.max_num_batched_tokens is None else
           {"max_num_batched_tokens": args.max_num_batched_tokens}),
        kv_cache_memory_bytes=int(args.kv_cache_gib * GIB) if args.kv_cache_gib else None,
        gpu_budget_bytes=int(args.gpu_budget_gib * GIB),
        host_budget_bytes=int(args.host_budget_gib * GIB),
        # room for reloads of whole users (2.7 GB each at the Llama shape) beside the
        # requests' reads of single facts, and for those facts on the device
        staging_bytes=int(args.staging_gib * GIB),
        device_staging_bytes=int(args.device_staging_gib * GIB),
        # every preloaded user's chunk index kept (~1 MB each, fp8 at the Llama shape)
        index_cache=max(256, *args.counts) if args.preload_facts else 256,
        direct_io=args.storage_direct_io)  # reads from storage bypass the page cache
    from benchmarks.lib.load.server_process import free_port

    server = {"engine": engine, "tokenizer": str(ckpt), "embedder": args.embedder,
              "top_k": args.top_k, "model_name": "load", "port": free_port(),
              "memory_cache": memory_cache_settings(args),
              "cold_split": cold_split_settings(args)}
    return {"server": server, "groups": groups, "versions": versions, "reused": bool(reused),
            "questions": lu.locomo_questions(args.conversations),
            "shares": {u: lu.shares(g, pool) for g in groups for u in g.users}}


def memory_cache_settings(args) -> dict:
    """The server's memory cache (``MemoryCacheConfig`` fields), set here rather than by
    ``INFERSCALE_SERVE_*`` so that the result records them: a budget that holds every
    user's facts and retrieval index (~0.8 MB a user of 400 facts), and storage lookups
    of users the cache does not hold yet never shed (a step's first requests of
    thousands of users are such lookups, and a shed request is answered without
    memory)."""
    return {"budget_bytes": int(args.memory_budget_gib * GIB),
            "misses_per_s": args.storage_misses_per_s, "miss_burst": args.storage_miss_burst}


def cold_split_settings(args) -> dict:
    """How the server splits a cold request between reading from storage and prefilling
    (``ColdSplitConfig`` fields; ``auto`` by default, as a server runs), recorded in the
    result: ``off`` reads every chunk once the engine schedules the request (no prefetch),
    ``pinned:N`` always reads the first N chunks, for comparisons in one session."""
    mode, _, n = args.cold_split.partition(":")
    return {"mode": mode, "pinned_chunks": int(n or 0)}


def cold_split_arg(value: str) -> str:
    """``--cold-split``'s value, checked as the server would take it."""
    from inferscale.serve.cold_split import ColdSplitConfig

    mode, sep, n = value.partition(":")
    try:
        if (mode == "pinned") != bool(sep):
            raise ValueError("pinned needs :N, the others take none")
        ColdSplitConfig(mode=mode, pinned_chunks=int(n or 0))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}") from None
    return value


def publish_memory(args, store, tok, fp: str, pool, embeddings, groups, loaded) -> dict:
    """Publish every group's users (random K/V of the shape's geometry, or the real
    model's encoding when ``loaded``)."""
    from benchmarks.datasets import users as lu
    from inferscale.types import KVGeometry

    if loaded is None:
        shape = KVGeometry.of_config(SHAPES[args.model])

        def memory_of(group, fids):
            return lu.group_memory(group, fids, None, tok, pool, fp, shape,
                                   dtype=getattr(torch, args.memory_dtype),
                                   text_tail=args.text_tail)
    else:
        t = time.perf_counter()
        encoded = lu.encode_pool(loaded.model, tok, pool, groups, fp, args.memory_dtype,
                                 text_tail=args.text_tail)
        print(f"encoded {len(encoded.chunks) - 1} turns at w=0 "
              f"in {time.perf_counter() - t:.0f} s", flush=True)

        def memory_of(group, fids):
            return lu.group_memory(group, fids, encoded, tok, pool, fp)
    return lu.publish_users(store, groups, pool, embeddings, tok, memory_of,
                            progress=lambda m: print(m, flush=True))


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    a = ap.add_argument
    a("--model", default="embedded",
      help=f"'embedded', an HF checkpoint dir, or one of {sorted(SHAPES)}")
    a("--conversations", nargs="+", default=[
        "../shared/data/locomo/conv-26.json", "../shared/data/locomo/conv-30.json"])
    a("--users", type=int, default=20, help="users (one scenario; see --user-counts)")
    a("--user-counts", type=int, nargs="+", default=None,
      help="scenarios in one server: users are built once for the largest count; for each "
           "count in turn every user is evicted, the first N by popularity placed in the "
           "tiers and the steps run over them (one result file each: --out with {users})")
    a("--groups", type=int, default=None,
      help="memory groups (default: one per user); users of a group share their KV file "
           "on disk (hard links), never in memory")
    a("--facts", type=int, default=400, help="facts (LoCoMo turns) per user")
    a("--text-tail", type=int, default=Settings().text_tail,
      help="facts the served layout prefills as text after the injected ones, kept with the "
           "artifacts (default: INFERSCALE_TEXT_TAIL or the encoder's default)")
    a("--memory-dtype", default=None, choices=("bfloat16", "float8_e4m3fn"),
      help="the users' stored KV: bfloat16, or fp8 (e4m3 with per-chunk scales: half the "
           "bytes read from storage and held in each tier); default: what the encoder "
           "stores on this machine (INFERSCALE_KV_DTYPE, auto: fp8 on CUDA, bf16 on the CPU)")
    a("--zipf", type=float, default=1.0,
      help="popularity exponent: user rank r asks with weight r**-zipf")
    a("--top-k", type=int, default=50)
    a("--max-tokens", type=int, default=32)
    a("--modes", nargs="+", choices=("prompt", "kv"), default=["prompt", "kv"])
    a("--rates", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5, 0.75, 1.0],
      help="arrival rates (requests/s), rising: the prompt baseline's (and KV's with "
           "--kv-rates same)")
    a("--kv-rates", nargs="+", default=["adaptive"],
      help="'adaptive': --kv-rate-multipliers x the baseline's goodput; 'same': both modes "
           "at every rate of --rates, alternating; or KV's own rates")
    a("--kv-rate-multipliers", type=float, nargs="+", default=[1, 2, 3, 4, 5])
    a("--prompt-goodput", type=float, nargs="+", default=None,
      help="the baseline's goodput from another run (with --modes kv): one value, or one "
           "per user count")
    a("--peer", action="store_true",
      help="run stock `vllm serve` on the same checkpoint instead of InferScale's server, "
           "on the prompts the prompt mode composes for the first of --user-counts, rising "
           "through --rates until its first miss (benchmarks/lib/load/peer.py); one result")
    a("--peer-serve-args", default="",
      help="more arguments for the peer's `vllm serve` (a CPU host's small KV cache); "
           "recorded in the result")
    a("--peer-result", default=None,
      help="the peer's result file (--peer): every summary reports goodput_vs_peer and KV "
           "runs at --kv-rate-multipliers x its goodput")
    a("--peer-goodput", type=float, default=None,
      help="the peer's goodput as a number (instead of --peer-result; for estimates)")
    a("--reuse-memory", action="store_true",
      help="reuse the users an earlier run (the peer's) published in --workdir with the same "
           "settings instead of publishing them again")
    a("--prompt-once", action="store_true",
      help="run the baseline in the first user count only; the later counts run KV against "
           "its goodput (the baseline reads no tier: its goodput does not depend on them)")
    a("--requests", type=int, default=None,
      help="requests per step (default: 400 on CUDA, 50 on CPU)")
    a("--objective-ms", type=float, default=1000.0, help="p99 TTFT objective")
    a("--gpu-budget-gib", type=float, default=1.5)
    a("--host-budget-gib", type=float, default=2.3)
    a("--staging-gib", type=float, default=4.0,
      help="pinned host memory reads from storage land in (the connector's staging_bytes)")
    a("--device-staging-gib", type=float, default=1.0,
      help="device memory facts read for requests wait in until injected")
    a("--storage-direct-io", action=argparse.BooleanOptionalAction, default=True,
      help="the server reads its artifact store around the page cache (O_DIRECT), and the "
           "storage bandwidth is measured so (the users of a group share one KV file on "
           "disk: read through the page cache, 'storage' would be RAM); --no-storage-"
           "direct-io: through it, and the results say page_cache_bypassed: false")
    a("--cold-split", default="auto", type=cold_split_arg,
      help="a cold request's split between storage and prefill: auto (the rule, measured "
           "while serving), off (every chunk read once scheduled), pinned:N (N leading "
           "chunks read)")
    a("--storage-seconds", type=float, default=3.0,
      help="the storage bandwidth measurement: seconds per read pattern (at most)")
    a("--storage-gib", type=float, default=2.0,
      help="... and GiB per read pattern (at most)")
    a("--storage-threads", type=int, default=8,
      help="... and concurrent random 8 MiB reads (the connector's fetch_workers)")
    a("--memory-budget-gib", type=float, default=8.0,
      help="the server's memory cache: every user's facts and retrieval index")
    a("--preload-facts", action=argparse.BooleanOptionalAction, default=True,
      help="before a count's steps, hydrate the facts alone (tier facts) of its users in "
           "storage: their first lookups find their facts and retrieval index held, as a "
           "vector store holds them, the workers their chunk index, and only their KV "
           "is cold")
    a("--storage-misses-per-s", type=float, default=1e6,
      help="the server's lookups of users its memory cache does not hold, per second, "
           "before it sheds them (answered without memory): by default never")
    a("--storage-miss-burst", type=int, default=1_000_000)
    a("--gpu-memory-utilization", type=float, default=None)
    a("--kv-cache-gib", type=float, default=None,
      help="vLLM's KV cache (default: CPU 3 GiB; CUDA: by utilization)")
    a("--max-model-len", type=int, default=4096)
    a("--max-num-batched-tokens", type=int, default=None,
      help="the server engine's token budget per step (default: the server's, 2048; "
           "the peer always runs vllm serve's)")
    a("--eager", action=argparse.BooleanOptionalAction, default=None)
    a("--embedder", default="embedded")
    a("--tokenizer", default=None, help="tokenizer dir for the -shape models")
    a("--warmup-requests", type=int, default=None,
      help="warm-up burst per mode and user count (default: 64 on CUDA, 6 on CPU)")
    a("--warmup-rate", type=float, default=None,
      help="its arrival rate: high, so that steps admit several requests at once "
           "(default: 64 on CUDA, 0.5 on CPU)")
    a("--warmup-lengths", action=argparse.BooleanOptionalAction, default=None,
      help="then one request per distinct query length (the server's query embedder "
           "captures a CUDA graph per length; default: on CUDA)")
    a("--drain-s", type=float, default=120.0,
      help="after a step's last arrival, wait this long for its requests")
    a("--settle-s", type=float, default=2.0)
    a("--request-timeout-s", type=float, default=600.0)
    a("--start-timeout-s", type=float, default=900.0)
    a("--deadline-s", type=float, default=6 * 3600.0,
      help="start no step that could end after this many seconds of the run (its "
           "arrivals and --drain-s; one that would not is listed in skipped_steps and "
           "ends its mode; a scenario with no step has no goodput: null, not 0)")
    a("--workdir", default=None)
    a("--server-log", default=None)
    a("--out", "--out-pattern", dest="out", default=None,
      help="result file; '{users}' in it is replaced by the user count (needed with "
           "several counts)")
    a("--keep-scrapes", default=None, help="directory for each step's /metrics scrapes")
    a("--profile-dir", default=None,
      help="py-spy profiles of the engine core and the server during chosen steps")
    a("--profile-users", type=int, nargs="+", default=None,
      help="the user counts to profile (default: the smallest)")
    a("--profile-modes", nargs="+", choices=("prompt", "kv"), default=["kv"])
    a("--profile-seconds", type=float, default=15.0)
    a("--profile-hz", type=int, default=100)
    a("--profile-format", choices=("raw", "speedscope", "chrometrace", "flamegraph"),
      default="raw")
    a("--py-spy", default=None, help="py-spy executable (default: on PATH)")
    a("--estimate-only", action="store_true", help="print the time estimate and exit")
    a("--estimate-setup-s", type=float, default=None,
      help="setup allowance in the estimate besides the users' (default: 60 s on CUDA, "
           "30 s on CPU)")
    a("--estimate-setup-per-user-s", type=float, default=0.03,
      help="seconds to publish one user, in the estimate (0.029 s measured on the 2-core "
           "CPU under load, a user of 400 facts; none with --reuse-memory)")
    a("--estimate-user-gib", type=float, default=None,
      help="a user's placed size in the estimate, for the users hydrated per count "
           "(default: every user, an upper bound; 2.49 at the Llama-3.1-8B shape, bf16)")
    a("--estimate-start-s", type=float, default=None,
      help="the server's start in the estimate (default: 150 s on CUDA: compile and CUDA "
           "graphs; 60 s on CPU)")
    a("--estimate-hydrate-s", type=float, default=1.0,
      help="seconds per hydrated user in the estimate")
    return ap


def resolve(ap: argparse.ArgumentParser, args, cuda: bool):
    """Defaults that depend on the device; checks across options."""
    if args.rates != sorted(args.rates) or min(args.rates) <= 0:
        ap.error("--rates must be positive and rising")
    words = [w for w in args.kv_rates if not w.replace(".", "", 1).isdigit()]
    if words and (len(args.kv_rates) != 1 or words[0] not in ("adaptive", "same")):
        ap.error("--kv-rates: 'adaptive', 'same' or rates")
    args.kv_rates = words[0] if words else sorted(float(r) for r in args.kv_rates)
    missing = [c for c in args.conversations if not Path(c).is_file()]
    if missing and not args.estimate_only:
        ap.error(f"--conversations: no such file {missing[0]}")
    args.counts = args.user_counts or [args.users]
    args.users = max(args.counts)
    if len(args.counts) > 1 and args.out and "{users}" not in args.out and not args.peer:
        ap.error("several --user-counts need '{users}' in --out")  # the peer runs one
    if args.prompt_goodput and len(args.prompt_goodput) not in (1, len(args.counts)):
        ap.error("--prompt-goodput: one value, or one per user count")
    args.requests = args.requests or (400 if cuda else 50)
    if args.peer:
        if args.peer_result or args.peer_goodput:
            ap.error("--peer measures the peer: no --peer-result or --peer-goodput")
        args.modes = ["peer"]
    read_peer_result(ap, args)
    if ("prompt" not in args.modes and args.kv_rates == "adaptive" and not args.peer
            and not args.prompt_goodput and not args.peer_goodput):
        ap.error("--modes kv with adaptive KV rates needs --prompt-goodput or the peer's")
    args.warmup_requests = (args.warmup_requests if args.warmup_requests is not None
                            else 64 if cuda else 6)
    args.warmup_rate = args.warmup_rate or (64.0 if cuda else 0.5)
    args.warmup_lengths = cuda if args.warmup_lengths is None else args.warmup_lengths
    args.profile_users = args.profile_users or [min(args.counts)]
    args.gpu_memory_utilization = args.gpu_memory_utilization or (0.85 if cuda else 0.5)
    if args.memory_dtype is None:
        args.memory_dtype = Settings().resolved_kv_dtype("cuda" if cuda else "cpu")
        if args.memory_dtype not in ("bfloat16", "float8_e4m3fn"):
            ap.error(f"INFERSCALE_KV_DTYPE={args.memory_dtype}: pass --memory-dtype")
    if not cuda and args.kv_cache_gib is None:
        args.kv_cache_gib = 3.0
    if args.estimate_setup_s is None:
        args.estimate_setup_s = 60.0 if cuda else 30.0
    if args.estimate_start_s is None:
        args.estimate_start_s = 150.0 if cuda else 60.0
    return args


PEER_MUST_MATCH = ("model", "top_k", "max_tokens", "objective_ms", "requests_per_step",
                   "zipf", "facts_per_user")


def read_peer_result(ap: argparse.ArgumentParser, args) -> None:
    """``args.peer_goodput`` and ``args.peer_source`` from ``--peer-result`` (or
    ``--peer-goodput``); a peer measured under other settings is refused."""
    args.peer_source = "given (--peer-goodput)" if args.peer_goodput else None
    if not args.peer_result:
        return
    if args.peer_goodput:
        ap.error("--peer-result or --peer-goodput, not both")
    try:
        peer = json.loads(Path(args.peer_result).read_text())
        if peer["summary"]["goodput_peer_rps"] is None:
            raise ValueError("its run measured no step (stopped by its deadline?)")
        args.peer_goodput = float(peer["summary"]["goodput_peer_rps"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        ap.error(f"--peer-result {args.peer_result}: no peer goodput in it ({exc})")
    ours = {"model": args.model, "top_k": args.top_k, "max_tokens": args.max_tokens,
            "objective_ms": args.objective_ms, "requests_per_step": args.requests,
            "zipf": args.zipf, "facts_per_user": args.facts}
    differ = [k for k in PEER_MUST_MATCH
              if ours[k] is not None and peer.get(k) is not None and peer[k] != ours[k]]
    if differ:
        ap.error(f"--peer-result {args.peer_result} ran with other settings: "
                 + ", ".join(f"{k} {peer[k]} (here {ours[k]})" for k in differ))
    args.peer_source = f"{args.peer_result}: {peer.get('command', '')}"
    # the peer never missed within its rates (its goodput a lower bound), or where it did
    own = peer["summary"].get("peer") or {}
    args.peer_lower_bound, args.peer_first_miss = bool(own.get("lower_bound")), own.get(
        "first_miss_rps")


def prompt_goodput_for(args, count: int) -> float | None:
    if not args.prompt_goodput:
        return None
    g = args.prompt_goodput
    return g[0] if len(g) == 1 else g[args.counts.index(count)]
