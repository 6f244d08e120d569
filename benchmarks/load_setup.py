"""The load benchmark's setup (``benchmarks/load.py``): its command line, and the memory it
serves (every user published once, for the largest user count) with the server's config.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.load_plan import GIB
from benchmarks.shapes import SHAPES
from inferscale.settings import Settings


def build_memory(args, work: Path, embedder, users: int) -> dict:
    """Publish ``users`` users -> ``{"server": the server's config, "groups",
    "questions": conversation -> questions, "shares": user -> conversation shares,
    "versions": user -> {"version", "slab_bytes"}}``."""
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
    groups = lu.make_groups(len(pool), args.groups or users, args.facts, users)
    embeddings = embedder.embed([t.text for t in pool]).float().cpu().numpy()
    if args.model in SHAPES:
        cfg = SHAPES[args.model]
        shape = (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"])

        def memory_of(group, fids):
            return lu.group_memory(group, fids, None, tok, pool, fp, shape,
                                   text_tail=args.text_tail)
    else:
        t = time.perf_counter()
        encoded = lu.encode_pool(loaded.model, tok, pool, groups, fp, "bfloat16",
                                 text_tail=args.text_tail)
        print(f"encoded {len(encoded.chunks) - 1} turns at w=0 "
              f"in {time.perf_counter() - t:.0f} s", flush=True)
        del loaded

        def memory_of(group, fids):
            return lu.group_memory(group, fids, encoded, tok, pool, fp)
    versions = lu.publish_users(store, groups, pool, embeddings, memory_of,
                                progress=lambda m: print(m, flush=True))
    engine.update(
        model_fingerprint=fp, artifact_root=store.root, max_model_len=args.max_model_len,
        enforce_eager=not cuda if args.eager is None else args.eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=int(args.kv_cache_gib * GIB) if args.kv_cache_gib else None,
        gpu_budget_bytes=int(args.gpu_budget_gib * GIB),
        host_budget_bytes=int(args.host_budget_gib * GIB),
        # room for reloads of whole users (2.7 GB each at the Llama shape) beside the
        # requests' reads of single facts, and for those facts on the device
        staging_bytes=int(args.staging_gib * GIB),
        device_staging_bytes=int(args.device_staging_gib * GIB),
        direct_io=args.storage_direct_io)  # reads from storage bypass the page cache
    from benchmarks.load_server import free_port

    server = {"engine": engine, "tokenizer": str(ckpt), "embedder": args.embedder,
              "top_k": args.top_k, "model_name": "load", "port": free_port()}
    return {"server": server, "groups": groups, "versions": versions,
            "questions": lu.locomo_questions(args.conversations),
            "shares": {u: lu.shares(g, pool) for g in groups for u in g.users}}


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
    a("--storage-seconds", type=float, default=3.0,
      help="the storage bandwidth measurement: seconds per read pattern (at most)")
    a("--storage-gib", type=float, default=2.0,
      help="... and GiB per read pattern (at most)")
    a("--storage-threads", type=int, default=8,
      help="... and concurrent random 8 MiB reads (the connector's fetch_workers)")
    a("--gpu-memory-utilization", type=float, default=None)
    a("--kv-cache-gib", type=float, default=None,
      help="vLLM's KV cache (default: CPU 3 GiB; CUDA: by utilization)")
    a("--max-model-len", type=int, default=4096)
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
      help="start no step that could end after this many seconds of the run")
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
      help="setup allowance in the estimate (default: 240 s on CUDA, 120 s on CPU)")
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
    if len(args.counts) > 1 and args.out and "{users}" not in args.out:
        ap.error("several --user-counts need '{users}' in --out")
    if args.prompt_goodput and len(args.prompt_goodput) not in (1, len(args.counts)):
        ap.error("--prompt-goodput: one value, or one per user count")
    if ("prompt" not in args.modes and args.kv_rates == "adaptive"
            and not args.prompt_goodput):
        ap.error("--modes kv with adaptive KV rates needs --prompt-goodput")
    args.requests = args.requests or (400 if cuda else 50)
    args.warmup_requests = (args.warmup_requests if args.warmup_requests is not None
                            else 64 if cuda else 6)
    args.warmup_rate = args.warmup_rate or (64.0 if cuda else 0.5)
    args.warmup_lengths = cuda if args.warmup_lengths is None else args.warmup_lengths
    args.profile_users = args.profile_users or [min(args.counts)]
    args.gpu_memory_utilization = args.gpu_memory_utilization or (0.85 if cuda else 0.5)
    if not cuda and args.kv_cache_gib is None:
        args.kv_cache_gib = 3.0
    if args.estimate_setup_s is None:
        args.estimate_setup_s = 240.0 if cuda else 120.0
    return args


def prompt_goodput_for(args, count: int) -> float | None:
    if not args.prompt_goodput:
        return None
    g = args.prompt_goodput
    return g[0] if len(g) == 1 else g[args.counts.index(count)]
