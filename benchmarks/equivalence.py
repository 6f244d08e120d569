"""Equivalence of injected KV and prompt prefill on the real engine, per dtype.

Three users with small hand-written memories (a short conversation each; every turn is
one fact, ``"Speaker: text"``), a factual-recall and an open-ended query each. For every
dtype (model weights, engine and stored KV in that dtype) the user's whole memory is
composed in stored order, ``[prefix | fact_1 .. fact_n | query]``, and answered greedily:

- ``prefill``: the same prompt ids, prefilled by vLLM (no memory named, no salt);
- ``limiting``: the memory injected from KV encoded in the limiting case (each fact with
  the whole memory before it as its window: exactly a joint prefill's KV,
  :func:`inferscale.encode.encoder.encode_limiting`);
- ``window``: the memory injected from the ordinary encoding (each fact with its own
  ``--window`` preceding turns, ``inferscale.encode.encoder.encode_facts``).

With ``--memory-dtype float8_e4m3fn`` both encodings are also published stored in that
dtype (the same encoding, quantized) and answered on the same engine; those answers are
compared with the engine-dtype memory's answers of the same encoding
(``limiting_float8_e4m3fn_vs_memory``, ``window_float8_e4m3fn_vs_memory``): fp8 memory
against bf16 memory, on the bf16 engine, as greedy outputs.

Each injected answer is compared with the prefill answer: ``token_identical``;
``equivalent`` (not identical, but the same normalized first line, or mentioning the
same key facts of the query); ``differs``. Factual accuracy: a factual answer is right
when it contains one of the expected strings. vLLM's prefix cache is reset before every
request, so nothing is shared between the modes.

On CPU, ``bfloat16`` is emulated (slow): keep the memories small. On CUDA the same
command measures the GPU columns; ``cuda-bfloat16`` on the H200 was not run (no device
time left) and is recorded as such in the CPU result.

    python -m benchmarks.equivalence --out benchmarks/results/equivalence-cpu.json

``--model random-llama`` writes a small Llama with random weights (4 KV heads,
``benchmarks.lib.shapes.RANDOM_LLAMA``, the SmolLM2 tokenizer) for tensor parallelism
(``--tensor-parallel-size 2``): its answers are meaningless, but token identity with
prefill (the limiting case) is exactly as demanding.

Starts engines: run as a script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from inferscale.settings import Settings, offline_environment

offline_environment()

import torch  # noqa: E402

from benchmarks.lib.memory import vectors  # noqa: E402
from benchmarks.lib.qa_metrics import first_line, normalize_answer  # noqa: E402
from benchmarks.lib.results import command_line  # noqa: E402
from inferscale.encode.identity import EncoderConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# user -> turns (speaker, text), and two queries: (kind, question, key facts). A factual
# answer is right when it contains one of its keys; for both kinds, "equivalent" means
# mentioning the same keys as the prefill answer.
USERS: dict[str, dict] = {
    "ada": {
        "turns": [
            ("Ada", "I finally adopted a cat last weekend, a grey tabby."),
            ("Friend", "That's lovely! What did you name her?"),
            ("Ada", "Her name is Pixel, after my first computer."),
            ("Friend", "Ha, fitting for a programmer. Still at the bank?"),
            ("Ada", "No, I left the bank in May. I now work at a robotics startup in Lyon."),
            ("Friend", "Lyon! Do you like living there?"),
            ("Ada", "I love it. I cycle to work along the Rhone every morning."),
            ("Friend", "Any plans for the holidays?"),
            ("Ada", "I'm flying to Osaka in December to see my brother Ken."),
        ],
        "queries": [
            ("factual", "What is the name of Ada's cat?", ["Pixel"]),
            ("open", "Describe Ada's life these days.",
             ["Pixel", "cat", "robotics", "Lyon", "cycl", "Osaka", "Ken"]),
        ],
    },
    "bruno": {
        "turns": [
            ("Bruno", "I signed up for the Berlin marathon in September."),
            ("Coach", "Great goal. What's your target time?"),
            ("Bruno", "I want to finish under four hours."),
            ("Coach", "Any injuries I should know about?"),
            ("Bruno", "My left knee hurts after long runs, so I see a physio on Tuesdays."),
            ("Coach", "What do you eat before a long run?"),
            ("Bruno", "Porridge with bananas, always. I can't stand gels."),
            ("Coach", "And who supports you?"),
            ("Bruno", "My wife Clara rides her bike next to me on Sundays."),
        ],
        "queries": [
            ("factual", "Which marathon is Bruno running?", ["Berlin"]),
            ("open", "How is Bruno preparing for his race?",
             ["four hours", "knee", "physio", "porridge", "banana", "Clara", "bike"]),
        ],
    },
    "chen": {
        "turns": [
            ("Chen", "We moved into a house with a small garden in April."),
            ("Neighbor", "Welcome! What are you growing?"),
            ("Chen", "Mostly tomatoes and basil; my daughter Mei planted sunflowers."),
            ("Neighbor", "How old is Mei now?"),
            ("Chen", "She just turned seven and she wants to be a vet."),
            ("Neighbor", "Do you cook with what you grow?"),
            ("Chen", "Yes, I make pesto every Friday with the basil."),
            ("Neighbor", "Sounds delicious. Any pets?"),
            ("Chen", "A tortoise called Captain who is older than me."),
        ],
        "queries": [
            ("factual", "How old is Chen's daughter?", ["seven", "7"]),
            ("open", "What do you know about Chen's family and home?",
             ["garden", "tomato", "basil", "Mei", "sunflower", "seven", "vet", "pesto",
              "Captain", "tortoise"]),
        ],
    },
}


def mentioned(text: str, keys: list[str]) -> frozenset[str]:
    low = text.lower()
    return frozenset(k for k in keys if k.lower() in low)


def compare(injected: str, prefill: str, inj_ids: list[int], pre_ids: list[int],
            keys: list[str]) -> str:
    """token_identical / equivalent / differs (see the module docstring)."""
    if inj_ids == pre_ids:
        return "token_identical"
    if normalize_answer(first_line(injected)) == normalize_answer(first_line(prefill)):
        return "equivalent"
    if mentioned(injected, keys) == mentioned(prefill, keys) and mentioned(prefill, keys):
        return "equivalent"
    return "differs"


def build_users(model, tok, fp: str, embedder, dtype: torch.dtype, window: int, root: Path,
                memory_dtype: str | None = None) -> dict[str, dict]:
    """Publish every user twice (limiting, window), and twice more stored in
    ``memory_dtype`` when given -> per user: versions and its table."""
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.publish import Lineage, publish
    from inferscale.compose import Composer
    from inferscale.encode.encoder import FactSpec, TurnText, encode_facts, encode_limiting
    from inferscale.encode.identity import EncodingIdentity
    from inferscale.facts.table import facts_table

    store = StoreConfig(str(root))
    composer = Composer(tok)
    dname = str(dtype).removeprefix("torch.")
    out = {}
    for user, spec in USERS.items():
        texts = [f"{s}: {t}" for s, t in spec["turns"]]
        sources = [{"turn_id": f"t{i}", "turn_index": i} for i in range(len(texts))]
        emb = vectors(embedder)(texts)
        lim_user, win_user = f"{user}-limiting", f"{user}-w{window}"
        table = facts_table(lim_user, list(zip(sources, texts)), emb, tok)
        mem = encode_limiting(model, composer.prefix_ids(), list(zip(
            table.column("fact_id").to_pylist(), table.column("token_ids").to_pylist())),
            fp, dtype)
        lim = publish(store, lim_user, mem, table, Lineage(f"eq-{user}", f"lim-{dname}"),
                      embeddings=False).version
        wtable = facts_table(win_user, list(zip(sources, texts)), emb, tok)
        turns = [TurnText(s, t) for s, t in spec["turns"]]
        specs = [FactSpec(fid, text, i, tuple(ids)) for i, (fid, text, ids) in enumerate(zip(
            wtable.column("fact_id").to_pylist(), texts, wtable.column("token_ids").to_pylist()))]
        wmem = encode_facts(model, tok, turns, specs, EncodingIdentity.of_model(
            EncoderConfig(window=window, dtype=dname), fp, model), progress=False)
        win = publish(store, win_user, wmem, wtable, Lineage(f"eq-{user}", f"w{window}-{dname}"),
                      embeddings=False).version
        out[user] = {"table": table, "wtable": wtable, "limiting": (lim_user, lim),
                     "window": (win_user, win)}
        if memory_dtype:  # the same encodings, stored in memory_dtype
            for enc, name, m, t in (("limiting", lim_user, mem, table),
                                    ("window", win_user, wmem, wtable)):
                other = f"{name}-{memory_dtype.replace('_', '-')}"
                t = t.set_column(t.schema.get_field_index("user"), "user",
                                 [[other] * t.num_rows])
                out[user][f"{enc}_{memory_dtype}"] = (other, publish(
                    store, other, m.stored_as(memory_dtype), t,
                    Lineage(f"eq-{user}", f"{enc}-{dname}-{memory_dtype}"),
                    embeddings=False).version)
        assert composer.prefix_ids() == list(mem.chunks[0].token_ids)
    return out


async def run_dtype(args, dtype_name: str, device: str) -> dict:
    """One engine in ``dtype_name``: every user's queries, three ways."""
    from inferscale.compose import Composer
    from inferscale.models import load_model
    from inferscale.serve.engine import EngineConfig, MemoryEngine
    from inferscale.serve.retrieval import Embedder
    from inferscale.types import PREFIX_ID
    from inferscale.vllm_plugin.metadata import MemoryRef

    dtype = getattr(torch, dtype_name)
    root = Path(tempfile.mkdtemp(prefix=f"inferscale-eq-{dtype_name}-")) / "artifacts"
    model = args.model
    if model == "random-llama":
        from benchmarks.lib.shapes import RANDOM_LLAMA
        from inferscale.models import embedded_checkpoint, write_random_checkpoint

        model = str(write_random_checkpoint(RANDOM_LLAMA, embedded_checkpoint(Settings().home),
                                            root.parent / "random-llama"))
    loaded = load_model(model, Settings().home, device=device, dtype=dtype_name)
    embedder = Embedder(Settings().embedder, device=device)
    t0 = time.perf_counter()
    users = build_users(loaded.model, loaded.tokenizer, loaded.fingerprint, embedder, dtype,
                        args.window, root, args.memory_dtype)
    extra = [f"limiting_{args.memory_dtype}", f"window_{args.memory_dtype}"] \
        if args.memory_dtype else []
    encode_s = time.perf_counter() - t0
    cuda = device.startswith("cuda")
    engine = await MemoryEngine(EngineConfig.of(
        model=str(loaded.checkpoint), model_fingerprint=loaded.fingerprint, dtype=dtype_name,
        gpu_memory_utilization=args.gpu_memory_utilization or (0.5 if cuda else 0.15),
        max_model_len=2048, enforce_eager=not cuda, artifact_root=str(root),
        tensor_parallel_size=args.tensor_parallel_size)).start()
    tok = loaded.tokenizer
    composer = Composer(tok)
    del loaded
    rows = []
    t0 = time.perf_counter()
    try:
        for user, u in users.items():
            for enc in ("limiting", "window", *extra):
                await engine.hydrate(u[enc][0], version=u[enc][1], tier="gpu")
            for kind, question, keys in USERS[user]["queries"]:
                # the whole memory in stored order: [prefix | fact_1 .. fact_n | query]
                memory = [composer.prefix_ids()] + u["table"].column("token_ids").to_pylist()
                ids = composer.compose(memory, question)[0]
                chunks = (PREFIX_ID, *u["table"].column("fact_id").to_pylist())
                await engine.llm.reset_prefix_cache()
                pre = await engine.generate(ids, None, max_tokens=args.max_tokens)
                row = {"user": user, "kind": kind, "question": question,
                       "prompt_tokens": len(ids), "prefill": pre.text.strip(),
                       "prefill_correct": bool(mentioned(pre.text, keys)) if kind == "factual"
                       else None}
                # the two encodings, then each other stored dtype against its base's memory
                for enc in ("limiting", "window", *extra):
                    base = enc.split("_")[0]
                    name, version = u[enc]
                    wchunks = chunks if base == "limiting" else (
                        chunks[0], *u["wtable"].column("fact_id").to_pylist())
                    await engine.llm.reset_prefix_cache()
                    inj = await engine.generate(ids, MemoryRef(name, version, wchunks),
                                                max_tokens=args.max_tokens)
                    row[enc] = inj.text.strip()
                    row[f"{enc}_injected_tokens"] = inj.reply.injected_tokens
                    row[f"{enc}_fallback"] = inj.reply.fallback and inj.reply.fallback.detail
                    if enc != base:
                        row[f"{enc}_vs_memory"] = compare(inj.text, row[base], inj.token_ids,
                                                          row[f"_{base}_ids"], keys)
                    row[f"{enc}_vs_prefill"] = compare(inj.text, pre.text, inj.token_ids,
                                                       pre.token_ids, keys)
                    row[f"{enc}_correct"] = (bool(mentioned(inj.text, keys))
                                             if kind == "factual" else None)
                    row[f"_{enc}_ids"] = inj.token_ids
                for enc in ("limiting", "window", *extra):
                    del row[f"_{enc}_ids"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        engine.shutdown()
    return {"rows": rows, "encode_seconds": round(encode_s, 1),
            "answer_seconds": round(time.perf_counter() - t0, 1)}


def tally(rows: list[dict]) -> dict:
    out = {}
    kinds = ("token_identical", "equivalent", "differs")
    for enc in [e.removesuffix("_vs_prefill") for e in rows[0] if e.endswith("_vs_prefill")]:
        counts = {c: sum(r[f"{enc}_vs_prefill"] == c for r in rows) for c in kinds}
        fact = [r for r in rows if r["kind"] == "factual"]
        out[enc] = {**counts, "queries": len(rows),
                    "factual_correct": sum(r[f"{enc}_correct"] for r in fact),
                    "fallbacks": sum(r[f"{enc}_fallback"] is not None for r in rows)}
        if f"{enc}_vs_memory" in rows[0]:  # another stored dtype against the engine's
            out[enc]["vs_memory"] = {c: sum(r[f"{enc}_vs_memory"] == c for r in rows)
                                     for c in kinds}
    fact = [r for r in rows if r["kind"] == "factual"]
    out["prefill"] = {"factual_correct": sum(r["prefill_correct"] for r in fact),
                      "factual_queries": len(fact)}
    return out


def run_isolated(args, name: str) -> dict:
    """One dtype in its own process (a fresh engine and device state; a failure there is
    recorded, not fatal to the other dtypes)."""
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one.json"
        cmd = [sys.executable, "-m", __spec__.name, "--dtypes", name,
               *(["--memory-dtype", args.memory_dtype] if args.memory_dtype else []),
               "--device", args.device, "--window", str(args.window),
               "--max-tokens", str(args.max_tokens), "--model", args.model, "--out", str(out),
               "--tensor-parallel-size", str(args.tensor_parallel_size)]
        if args.gpu_memory_utilization:
            cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr)[-3000:]
            print(tail, file=sys.stderr)
            return {"status": "failed", "returncode": proc.returncode, "log_tail": tail}
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded",
                    help="'embedded', an HF checkpoint dir, or 'random-llama' (random weights, "
                         "4 KV heads: for tensor parallelism)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="vLLM tensor parallelism of the engine (must divide the KV heads)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    help="model, engine and KV dtypes to compare (each in its own process "
                         "when several are given)")
    ap.add_argument("--memory-dtype", default=None,
                    help="also serve both encodings stored in this dtype (float8_e4m3fn) "
                         "and compare with the engine-dtype memory's answers")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the encoder and the engine run")
    ap.add_argument("--window", type=int, default=5, help="window of the ordinary encoding")
    ap.add_argument("--max-tokens", type=int, default=48, help="answer length (greedy)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="vLLM's share of GPU memory (CPU: of host RAM)")
    ap.add_argument("--out", default=None, help="result JSON")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    columns, details = {}, {}
    for name in args.dtypes:
        col = f"{kind}-{name}"
        if len(args.dtypes) > 1:
            one = run_isolated(args, name)
            if one.get("status") == "failed":
                columns[col] = one
                continue
            columns[col], details[col] = one["columns"][col], one["rows"][col]
            continue
        res = asyncio.run(run_dtype(args, name, args.device))
        columns[col] = {**tally(res["rows"]), "encode_seconds": res["encode_seconds"],
                        "answer_seconds": res["answer_seconds"]}
        details[col] = res["rows"]
    device = (torch.cuda.get_device_name() if kind == "cuda"
              else f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads")
    summary = {}
    for col, c in columns.items():
        if "queries" in c.get("limiting", {}):
            for enc in ("limiting", "window"):
                summary[f"{col}_{enc}_identical"] = c[enc]["token_identical"]
                summary[f"{col}_{enc}_equivalent"] = c[enc]["equivalent"]
                summary[f"{col}_{enc}_differs"] = c[enc]["differs"]
            for enc, got in c.items():
                if isinstance(got, dict) and "vs_memory" in got:
                    for kind, n in got["vs_memory"].items():
                        summary[f"{col}_{enc}_vs_memory_{kind}"] = n
            if col.endswith("float32"):
                summary["fp32_limiting_identical_share"] = round(
                    c["limiting"]["token_identical"] / c["limiting"]["queries"], 4)
    result = {
        "command": command_line(__spec__.name, argv),
        "device": f"{device} (torch {torch.__version__}, vllm {__import__('vllm').__version__})",
        "model": args.model, "window": args.window, "max_tokens": args.max_tokens,
        "memory_dtype": args.memory_dtype,
        "tensor_parallel_size": args.tensor_parallel_size,
        "encoder_defaults": EncoderConfig().to_dict(),
        "users": len(USERS), "queries": sum(len(u["queries"]) for u in USERS.values()),
        "columns": columns, "rows": details,
        "summary": {**summary, "wall_seconds": round(time.perf_counter() - t0, 1)},
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"]))
    return result


if __name__ == "__main__":
    main()
