"""TTFT of KV injection against the Mem0-style prompt baseline, one engine, one run.

For each ``k`` and each query (LoCoMo questions over one conversation whose turns are
the user's facts), on the same vLLM engine with the InferScale connector:

- ``prompt``: the baseline — same retrieval, facts as text (the same token ids), full
  prefill, prefix caching on (its instruction prefix is warm, as in steady state);
- ``inject_gpu`` / ``inject_host``: memory KV injected from the gpu / host tier;
- ``cached``: the same request with its memory already in vLLM's prefix cache — the
  floor any memory system can reach. The memory's blocks are cached by a request with
  the same memory and another question, so none of this query's tokens hit the cache:
  the floor computes the query like the other modes (at most the last partial block of
  memory, less than one block, is injected);
- ``q2ft``: query-to-first-token of the injected path: embed + retrieve + compose + TTFT;
- ``ref_gpu`` / ``ref_host`` (with ``--reference-dtype``): the same memory stored in the
  reference dtype, injected from each tier, in the same run (fp8 memory against bf16).

``--kv-dtype`` is the stored KV dtype of the measured memory (default: the engine's);
the engine itself runs in bf16 on CUDA (float32 on the CPU) whatever the memory's dtype.

Engine TTFT is measured from submitting the request to its first token (``max_tokens=1``).
vLLM's prefix cache is reset before every uncached measurement, so no k or query feeds
another; the order of the four modes rotates from query to query. An injecting mode's row
also gives the injection's host time and GPU (kernel) time per request, read from the
workers between requests (``<mode>_host_ms``, ``<mode>_kernel_ms``). Medians per k; the
summary is taken at the largest k, plus ``speedup_vs_prompt_k<k>`` at every k. The
artifacts carry the layout of ``--memory-order``, ``--text-tail`` and ``--tail-max-k``
(the encoder defaults unless given), as the server lays requests out.

    python -m benchmarks.ttft --model embedded --out benchmarks/results/ttft-cpu-smollm2.json
    python -m benchmarks.ttft --model llama-3.1-8b-shape --out .../ttft-h200-llama31-8b.json
    python -m benchmarks.ttft --model qwen3-14b-shape --tensor-parallel-size 2 \
        --out .../ttft-h200x2-qwen3-14b.json   # two GPUs: each rank injects its KV heads
    python -m benchmarks.ttft --model llama-3.1-8b-shape --kv-dtype float8_e4m3fn \
        --reference-dtype bfloat16 --out .../ttft-h200-llama31-8b-fp8.json  # fp8 memory
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from inferscale.settings import Settings, offline_environment

offline_environment()

import torch  # noqa: E402

from benchmarks.datasets import locomo  # noqa: E402
from benchmarks.lib.prompts import load_user, prepare  # noqa: E402
from benchmarks.lib.results import command_line, write_result  # noqa: E402
from benchmarks.lib.shapes import SHAPES, dummy_checkpoint  # noqa: E402
from inferscale.encode.identity import EncoderConfig  # noqa: E402
from inferscale.types import KVGeometry  # noqa: E402

MODES = ("prompt", "inject_gpu", "cached", "inject_host")
REF_MODES = ("ref_gpu", "ref_host")  # --reference-dtype


async def measure(args) -> dict:
    from transformers import AutoTokenizer

    from benchmarks.lib.memory import encoded_memory, publish_memory, random_memory, turn_facts
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.compose import Composer
    from inferscale.models import dummy_fingerprint, load_model, resolve_checkpoint
    from inferscale.serve.engine import EngineConfig, MemoryEngine
    from inferscale.serve.retrieval import Embedder
    from inferscale.serve.server import ServerConfig, build_server

    cuda = torch.cuda.is_available()
    home = Settings().home
    work = Path(args.workdir or tempfile.mkdtemp(prefix="inferscale-ttft-"))
    embedder = Embedder(args.embedder, device="cuda" if cuda else "cpu",
                        dtype=torch.float16 if cuda else None)
    turns = locomo.turns(args.conversation)
    users = {"gpu": "bench-gpu", "host": "bench-host"}
    dtypes = {"gpu": args.kv_dtype, "host": args.kv_dtype}  # the stored KV dtype per user
    if args.reference_dtype:
        users.update(ref_gpu="bench-gpu-ref", ref_host="bench-host-ref")
        dtypes.update(ref_gpu=args.reference_dtype, ref_host=args.reference_dtype)
    modes = MODES + (REF_MODES if args.reference_dtype else ())
    # the composer settings the artifacts carry (what the server lays out per request)
    layout = {"memory_order": args.memory_order, "text_tail": args.text_tail,
              **({"tail_max_k": args.tail_max_k} if args.tail_max_k else {})}
    t0 = time.perf_counter()
    if args.model in SHAPES:
        tok_dir = args.tokenizer or str(resolve_checkpoint("embedded", home))
        ckpt = dummy_checkpoint(args.model, tok_dir, work / args.model)
        fp = dummy_fingerprint(ckpt)
        tok = AutoTokenizer.from_pretrained(ckpt)
        shape = KVGeometry.of_config(SHAPES[args.model])
        versions = {}
        for tier, user in users.items():
            facts = turn_facts(turns, user, tok, embedder)
            versions[tier] = publish_memory(work / "artifacts", user, turns, facts,
                                            random_memory(facts, tok, shape,
                                                          getattr(torch, dtypes[tier]), fp,
                                                          layout=layout))
        engine_cfg = dict(model=str(ckpt), load_format="dummy",
                          dtype="bfloat16" if cuda else "float32")
        kv_note = "random KV (dummy weights)"
    else:
        loaded = load_model(args.model, home, device="cpu", dtype="float32")
        ckpt, fp, tok = loaded.checkpoint, loaded.fingerprint, loaded.tokenizer
        enc_cfg = EncoderConfig(window=args.window, dtype="float32", **layout)
        versions = {}
        for tier, user in users.items():
            facts = turn_facts(turns, user, tok, embedder)
            mem = encoded_memory(loaded.model, tok, turns, facts, enc_cfg, fp)
            if dtypes[tier] != "float32":  # the float32 encoding, stored in that dtype
                mem = mem.stored_as(dtypes[tier])
            versions[tier] = publish_memory(work / "artifacts", user, turns, facts, mem)
        del loaded
        engine_cfg = dict(model=str(ckpt), dtype="float32")
        kv_note = f"encoded by the model, window {args.window}, float32"
    setup_s = time.perf_counter() - t0

    engine = await MemoryEngine(EngineConfig.of(
        model_fingerprint=fp, artifact_root=str(work / "artifacts"),
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        enforce_eager=args.eager, block_size=args.block_size,
        tensor_parallel_size=args.tensor_parallel_size, **engine_cfg)).start()
    store = StoreConfig(str(work / "artifacts"))
    kv = build_server(engine, tok, embedder, store, ServerConfig(mode="kv"))
    prompt = build_server(engine, tok, embedder, store, ServerConfig(mode="prompt"))
    for tier, user in users.items():
        await kv.hydrate(user, version=versions[tier], tier=tier.removeprefix("ref_"))
        load_user(prompt, user, versions[tier])
    qs = [q["question"] for q in locomo.questions(args.conversation)][:args.queries + 1]
    llm = engine.llm
    other_query = Composer(tok).query_ids("What did they talk about last time?")

    async def ttft(server, user, q, k, reset=True, warm_prefix=False):
        if reset:
            await llm.reset_prefix_cache()
        if warm_prefix:  # the baseline's shared instruction prefix, cached as in steady state
            ids, _, _ = prepare(server, None, q, k)
            await engine.generate(ids, max_tokens=1)
        t = time.perf_counter()
        ids, ref, info = prepare(server, user, q, k)
        prep = time.perf_counter() - t
        gen = await engine.generate(ids, ref, max_tokens=1)
        return {"ttft_ms": gen.ttft_s * 1e3, "q2ft_ms": (prep + gen.ttft_s) * 1e3,
                "memory_tokens": info.get("memory_tokens", 0), "prompt_tokens": len(ids),
                "tail_tokens": info.get("text_tail_tokens", 0),
                "injected": gen.reply.injected_tokens, "cached": gen.cached_tokens,
                "embed_ms": info["timings_ms"].get("embed", 0.0),
                "retrieve_ms": info["timings_ms"].get("retrieve", 0.0)}

    async def measure_mode(mode, q, k):
        if mode == "prompt":
            return await ttft(prompt, users["gpu"], q, k, warm_prefix=True)
        if mode == "cached":  # the same request, its memory (only) in the prefix cache
            await llm.reset_prefix_cache()
            ids, ref, info = prepare(kv, users["gpu"], q, k)
            m = info["memory_tokens"]
            # cache the memory's blocks under another question: no block of this
            # request's own query can hit, so the floor computes the query like the others
            await engine.generate(ids[:m] + other_query, ref, max_tokens=1)
            return await ttft(kv, users["gpu"], q, k, reset=False)
        return await ttft(kv, users[mode.removeprefix("inject_")], q, k)

    async def injection_counters() -> tuple[float, float]:
        """(host seconds, GPU seconds) the workers spent injecting so far (rank 0)."""
        w = (await engine.worker_metrics())[0]
        return w["inject_seconds"], w["kernel"]["sum"]

    async def measure(mode, q, k):
        """One sample; an injecting mode's also with the injection's host and GPU time
        (read between samples, outside the timed request)."""
        if mode in ("prompt", "cached"):
            return await measure_mode(mode, q, k)
        host0, gpu0 = await injection_counters()
        sample = await measure_mode(mode, q, k)
        host1, gpu1 = await injection_counters()
        return {**sample, "host_ms": (host1 - host0) * 1e3,
                "kernel_ms": (gpu1 - gpu0) * 1e3}

    # what the loads write, checked against an independent computation (known layouts)
    verify = {}
    for tier, user in users.items():
        await engine.verify_next()
        await llm.reset_prefix_cache()
        ids, ref, _ = prepare(kv, user, qs[0], max(args.ks))
        out = await engine.generate(ids, ref, max_tokens=1)
        verify[tier] = {**await engine.verify_last_load(), "injected": out.reply.injected_tokens}
    print(json.dumps({"verify": verify}), flush=True)
    # warm-up: kernels, allocator, both paths
    for _ in range(2):
        await ttft(kv, users["gpu"], qs[0], max(args.ks))
        await ttft(prompt, users["gpu"], qs[0], max(args.ks), warm_prefix=True)
    rows = []
    for k in args.ks:
        samples: dict[str, list[dict]] = {m: [] for m in modes}
        for i, q in enumerate(qs[1:]):
            # the modes' order rotates per query, so no mode always follows the long
            # prompt prefill (the request right after it measured up to 35 ms slower on CPU)
            r = i % len(modes)
            for mode in modes[r:] + modes[:r]:
                samples[mode].append(await measure(mode, q, k))
        med = {m: {f: statistics.median(s[f] for s in v) for f in v[0]}
               for m, v in samples.items()}
        row = {
            "k": k, "queries": len(qs) - 1,
            "memory_tokens": med["inject_gpu"]["memory_tokens"],
            "injected_tokens": med["inject_gpu"]["injected"],
            "text_tail_tokens": med["inject_gpu"]["tail_tokens"],
            "prompt_tokens": med["prompt"]["prompt_tokens"],
            "inject_prompt_tokens": med["inject_gpu"]["prompt_tokens"],
            "prompt_ttft_ms": med["prompt"]["ttft_ms"],
            "inject_gpu_ttft_ms": med["inject_gpu"]["ttft_ms"],
            "inject_host_ttft_ms": med["inject_host"]["ttft_ms"],
            "cached_ttft_ms": med["cached"]["ttft_ms"],
            "prompt_q2ft_ms": med["prompt"]["q2ft_ms"],
            "inject_gpu_q2ft_ms": med["inject_gpu"]["q2ft_ms"],
            "inject_host_q2ft_ms": med["inject_host"]["q2ft_ms"],
            **{f"{m}_{f}": med[m][f] for m in med if m.startswith(("inject_", "ref_"))
               for f in ("host_ms", "kernel_ms")},
            "embed_ms": med["inject_gpu"]["embed_ms"],
            "retrieve_ms": med["inject_gpu"]["retrieve_ms"],
        }
        if args.reference_dtype:
            row.update(ref_gpu_ttft_ms=med["ref_gpu"]["ttft_ms"],
                       ref_host_ttft_ms=med["ref_host"]["ttft_ms"],
                       ref_injected_tokens=med["ref_gpu"]["injected"])
        row = {a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    status = await engine.status()
    engine.shutdown()
    top = rows[-1]
    reference = {}
    if args.reference_dtype:  # the same summary for the reference dtype's memory
        reference = {
            "reference_dtype": args.reference_dtype,
            "ref_engine_ttft_vs_cached": round(top["ref_gpu_ttft_ms"] / top["cached_ttft_ms"], 3),
            "ref_host_tier_extra_ms": round(top["ref_host_ttft_ms"] - top["ref_gpu_ttft_ms"], 3),
            "gpu_ttft_vs_ref": round(top["inject_gpu_ttft_ms"] / top["ref_gpu_ttft_ms"], 3)}
    return {
        "device": (torch.cuda.get_device_name() if cuda else platform.processor() or "cpu")
        + f" (torch {torch.__version__}, vllm {__import__('vllm').__version__})",
        "model": args.model, "kv": kv_note, "engine": "eager" if args.eager else "compiled",
        "tensor_parallel_size": args.tensor_parallel_size,
        "layout": layout, "kv_dtype": args.kv_dtype, "reference_dtype": args.reference_dtype,
        "setup_seconds": round(setup_s, 1), "verify": verify, "rows": rows,
        "loaded_tokens_total": status["loaded_tokens"],
        "inject_ms_mean": round(status["inject_ms_mean"], 3),
        "summary": {
            "k": top["k"],
            "engine_ttft_vs_cached": round(top["inject_gpu_ttft_ms"] / top["cached_ttft_ms"], 3),
            "q2ft_vs_engine_ttft": round(top["inject_gpu_q2ft_ms"] / top["inject_gpu_ttft_ms"], 3),
            "host_tier_extra_ms": round(top["inject_host_ttft_ms"] - top["inject_gpu_ttft_ms"], 3),
            "speedup_vs_prompt": round(top["prompt_ttft_ms"] / top["inject_gpu_ttft_ms"], 3),
            "kv_dtype": args.kv_dtype, **reference,
            **{f"speedup_vs_prompt_k{r['k']}":
               round(r["prompt_ttft_ms"] / r["inject_gpu_ttft_ms"], 3) for r in rows},
        },
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded",
                    help=f"'embedded', an HF checkpoint dir, or one of {sorted(SHAPES)}")
    ap.add_argument("--conversation", default="../shared/data/locomo/conv-26.json")
    ap.add_argument("--ks", type=int, nargs="+", default=[5, 10, 20, 50])
    ap.add_argument("--queries", type=int, default=20,
                    help="per k; medians of fewer swing by 10-20%% on a noisy 2-core machine")
    ap.add_argument("--window", type=int, default=0, help="encoder window (real models)")
    ap.add_argument("--text-tail", type=int, default=EncoderConfig.text_tail,
                    help="facts prefilled as text after the injected ones (the artifact's "
                         "layout; default: the encoder default)")
    ap.add_argument("--tail-max-k", type=int, default=EncoderConfig.tail_max_k,
                    help="the text tail only when at most this many facts are retrieved "
                         "(0: at every k; default: the encoder default)")
    ap.add_argument("--memory-order", default=EncoderConfig.memory_order,
                    help="order of the injected facts (relevance, relevance_last, "
                         "chronological; default: the encoder default)")
    ap.add_argument("--kv-dtype", default=None,
                    help="stored KV dtype of the memory (bfloat16, float32, float8_e4m3fn; "
                         "default: the engine's, bf16 on CUDA, float32 on the CPU)")
    ap.add_argument("--reference-dtype", default=None,
                    help="also inject the same memory stored in this dtype (ref_gpu, "
                         "ref_host), in the same run")
    ap.add_argument("--embedder", default="embedded", help="sentence-transformers dir")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir for the -shape models")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=None,
                    help="eager engine (default: eager on CPU, compiled on CUDA)")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="vLLM tensor parallelism (one GPU per rank; must divide the "
                         "model's KV heads)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    args.eager = (not cuda) if args.eager is None else args.eager
    args.kv_dtype = args.kv_dtype or ("bfloat16" if cuda else "float32")
    args.gpu_memory_utilization = args.gpu_memory_utilization or (0.85 if cuda else 0.5)
    result = asyncio.run(measure(args))
    return write_result({"command": command_line(__spec__.name, argv), **result}, args.out)


if __name__ == "__main__":
    main()
