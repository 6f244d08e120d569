"""LoCoMo answer quality: KV-injection variants against the prompt baseline, on any
LoCoMo-format conversations, per conversation and pooled.

For each conversation file (``--conversation a.json b.json ...``), the user's memory is
built the pipeline's way: every turn one fact ``"[date] Speaker: text"`` (raw fact mode,
:func:`inferscale.facts.table.raw_facts`; ``--fact-mode mem0`` extracts facts through
Mem0 and an OpenAI-compatible LLM instead), embedded with MiniLM. Every question of
categories 1-4 (no sampling unless ``--max-questions``) is then answered greedily on ONE
vLLM engine, in these modes:

- ``prompt``: the Mem0-style baseline, the top-k facts as text (best first), full prefill;
- ``nomem``: the same question with no facts (what the model knows without memory);
- every KV variant: the memory encoded with that variant's encoder config, published
  as an artifact, hydrated, and injected by the connector; the request is laid out by
  the variant's composer settings (``memory_order``, ``text_tail``: facts re-prefilled
  as text before the question) exactly as ``MemoryServer.prepare`` does.

Variants: ``--windows 0 5 20 50`` adds ``kv_w{w}`` (the pipeline's default encoder config
at window ``w``); ``--variant NAME:field=value,...`` adds any encoder config (fields of
``inferscale.encode.identity.EncoderConfig``: ``context``, ``window``, ``key_temperature``,
``key_calibration``, ``memory_order``, ``text_tail``, ``tail_max_k``);
``--variants-file FILE [--section NAME]`` adds a file's (:mod:`benchmarks.lib.locomo_variants`);
``--part I/N`` runs only the I-th of N slices of them (a sweep longer than one device
call; :mod:`benchmarks.locomo_merge` joins the parts). Retrieval runs once per question (exact top-``max(ks)``) and top-k is its first k facts,
so every mode and k answers from the same facts.

Scores: LoCoMo's token F1 of the first line (:mod:`benchmarks.lib.qa_metrics`) per mode, k
and category; the paired bootstrap 95% interval of (mode - prompt) at each k; the share
of answers that continue the transcript (they begin like a memory line or a speaker
label); the injected share of the retrieved facts' tokens; evidence recall of the shared
retrieval. Per conversation and pooled over all (:mod:`benchmarks.lib.locomo_report`).
``--select-default --rule exact|injection`` picks the default by
:mod:`benchmarks.locomo_select`'s fixed rule.

    python -m benchmarks.locomo --conversation ../shared/data/locomo/conv-26.json \\
        ../shared/data/locomo/conv-30.json --out benchmarks/results/locomo-cpu-smollm2.json

Needs ``nltk`` (Porter stemmer). Starts an engine: run as a script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from inferscale.settings import Settings, offline_environment

offline_environment()

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import torch  # noqa: E402

from benchmarks.datasets import locomo  # noqa: E402
from benchmarks.lib import locomo_report  # noqa: E402
from benchmarks.lib.locomo_variants import (  # noqa: E402
    Variant, encoding_key, parse_variant, part_of, read_specs)
from benchmarks.lib.results import command_line  # noqa: E402

QUERY_TEMPLATE = "Question: {question} Short answer:"  # the same for every mode


def build_facts(args, turns: pa.Table, tokenizer, embedder) -> pa.Table:
    """The pipeline's fact step for this user (raw: no LLM; mem0: Mem0 + an LLM)."""
    if args.fact_mode == "raw":
        from benchmarks.lib.memory import vectors
        from inferscale.facts.table import raw_facts

        return raw_facts(turns, tokenizer, vectors(embedder))
    from inferscale.facts.extractor import FactsConfig, extract_facts

    cfg = FactsConfig(mode="mem0", llm_base_url=args.llm_base_url, llm_model=args.llm_model)
    (result,) = extract_facts(turns, tokenizer, cfg).values()
    return result.table


def for_user(facts: pa.Table, user: str) -> pa.Table:
    """The same facts (same ids, texts, token ids, embeddings) owned by ``user``."""
    col = facts.schema.get_field_index("user")
    return facts.set_column(col, facts.schema.field(col), pa.array([user] * facts.num_rows))


@dataclass
class Conversation:
    """One conversation's user, turns, facts, questions and shared retrieval."""

    name: str
    user: str
    turns: pa.Table
    facts: pa.Table
    questions: list[dict]
    top: list[list[str]]  # per question: fact ids, best first (top max(ks))
    speakers: list[str]


def prepare(args, path: str, loaded, embedder) -> Conversation:
    from inferscale.serve.retrieval import FactIndex

    turns = locomo.turns(path)
    facts = build_facts(args, turns, loaded.tokenizer, embedder)
    questions = locomo.questions(path, max_questions=args.max_questions)
    q = embedder.embed([item["question"] for item in questions])
    top = FactIndex.from_table(facts, device=embedder.device).topk(
        q, min(max(args.ks), facts.num_rows))
    source = dict(zip(facts.column("fact_id").to_pylist(),
                      facts.column("source_turn_id").to_pylist()))
    for item, t in zip(questions, top):
        item["top_sources"] = [source[f] for f in t]
    return Conversation(Path(path).stem, turns.column("user")[0].as_py(), turns, facts,
                        questions, top, sorted(set(turns.column("speaker").to_pylist())))


_last_encoding: dict = {}  # conversation -> (encoding key, EncodedMemory)


def encode_variant(args, loaded, conv: Conversation, variant: Variant, root: Path):
    """Encode the facts the questions retrieve with ``variant`` and publish them as user
    ``{user}-{variant}``: (user, version, encoder config, stats)."""
    from dataclasses import replace

    from benchmarks.lib.memory import encoded_memory, kv_errors, publish_memory

    used = sorted({f for t in conv.top for f in t})
    facts = conv.facts.filter(pc.is_in(conv.facts["fact_id"], pa.array(used)))
    cfg = variant.encoder_config(dtype=args.kv_dtype, batch_tokens=args.batch_tokens)
    key = encoding_key(cfg)
    t0 = time.perf_counter()
    if _last_encoding.get(conv.name, (None,))[0] != key:  # one encoding kept per conversation
        _last_encoding[conv.name] = (key, encoded_memory(  # in the engine's (compute) dtype
            loaded.model, loaded.tokenizer, conv.turns, facts, replace(cfg, dtype=args.kv_dtype),
            loaded.fingerprint))
    mem = _last_encoding[conv.name][1]
    errors = {}
    if cfg.dtype != args.kv_dtype:
        errors = {"kv_rel_rms_error": kv_errors(mem)}  # bf16 and both fp8 scale rules
        mem = mem.stored_as(cfg.dtype)
    mem = replace(mem, encoder_config=cfg.to_dict())  # the model's geometry kept
    seconds = time.perf_counter() - t0
    vuser = f"{conv.user}-{variant.name}".replace("_", "-")
    version = publish_memory(root, vuser, conv.turns, for_user(facts, vuser), mem)
    return vuser, version, cfg, {"facts": facts.num_rows, "encode_seconds": round(seconds, 1),
                                 **mem.stats, **errors}


async def answer_all(args, engine, composer, token_ids: dict, conv: Conversation,
                     mode: str, ref_of=None) -> dict:
    """Answer every question of ``conv`` at every k in ``mode``; records keyed by (q, k).

    ``ref_of(ranked) -> (injected, tail, MemoryRef)`` lays out a KV mode's request."""
    from inferscale.types import PREFIX_ID

    prefix = token_ids[PREFIX_ID]
    sem = asyncio.Semaphore(args.concurrency)
    out: dict = {}

    async def chain(i: int) -> None:
        question = QUERY_TEMPLATE.format(question=conv.questions[i]["question"])
        async with sem:
            for k in ([0] if mode == "nomem" else args.ks):  # increasing: prefix-cache reuse
                ranked = conv.top[i][:k]
                ref, tail, injected = None, [], []
                if mode == "nomem":
                    memory = [prefix]
                elif mode == "prompt":
                    memory = [prefix] + [token_ids[f] for f in ranked]
                else:
                    injected, tail, ref = ref_of(ranked)
                    memory = [prefix] + [token_ids[f] for f in injected]
                ids, m = composer.compose(memory, question, [token_ids[f] for f in tail])
                gen = await engine.generate(ids, ref, max_tokens=args.max_tokens)
                out[(i, k)] = {"text": gen.text, "memory_tokens": m, "prompt_tokens": len(ids),
                               "tail_tokens": sum(len(token_ids[f]) for f in tail),
                               "fact_tokens": sum(len(token_ids[f]) for f in ranked),
                               "injected_fact_tokens": sum(len(token_ids[f]) for f in injected),
                               "injected": gen.reply.injected_tokens,
                               "cached": gen.cached_tokens,
                               "fallback": gen.reply.fallback and gen.reply.fallback.detail}

    await asyncio.gather(*(chain(i) for i in range(len(conv.questions))))
    return out


async def run(args, loaded, convs: list[Conversation], variants: list[Variant], root: Path,
              on_phase) -> None:
    """Every (conversation, mode, question, k) on one engine. A variant's facts are
    encoded just before its phase; ``on_phase(conv, mode, phase, answers)`` after each."""
    from inferscale.compose import Composer, memory_layout
    from inferscale.serve.engine import EngineConfig, MemoryEngine
    from inferscale.vllm_plugin.metadata import MemoryRef
    from inferscale.types import PREFIX_ID

    engine = await MemoryEngine(EngineConfig.of(
        model=str(loaded.checkpoint), model_fingerprint=loaded.fingerprint,
        dtype=args.kv_dtype, enforce_eager=not args.compile,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        artifact_root=str(root), gpu_budget_bytes=args.store_budget_gb << 30)).start()
    composer = Composer(loaded.tokenizer)
    tables = {c.name: (dict(zip(c.facts.column("fact_id").to_pylist(),
                                c.facts.column("token_ids").to_pylist()))
                       | {PREFIX_ID: composer.prefix_ids()},
                       dict(zip(c.facts.column("fact_id").to_pylist(),
                                c.facts.column("source_index").to_pylist()))) for c in convs}

    async def phase_of(conv: Conversation, mode: str, hydrated) -> None:
        token_ids, source = tables[conv.name]
        phase: dict = {"conversation": conv.name, "mode": mode}
        ref_of = None
        if hydrated is not None:
            vuser, version, cfg, phase["encode"] = hydrated

            def layout(ranked):
                injected, tail = memory_layout(ranked, cfg.memory_order, cfg.text_tail, source,
                                               cfg.tail_max_k)
                return injected, tail, MemoryRef(vuser, version, (PREFIX_ID, *injected))
            ref_of = layout
        t0 = time.perf_counter()
        answers = await answer_all(args, engine, composer, token_ids, conv, mode, ref_of)
        phase.update(answer_seconds=round(time.perf_counter() - t0, 1), requests=len(answers))
        if ref_of is not None:
            phase["kv_fallbacks"] = sum(1 for a in answers.values()
                                        if a["injected"] == 0 and a["cached"] < a["memory_tokens"])
        print(json.dumps({"phase": phase}), flush=True)
        on_phase(conv, mode, phase, answers)

    try:
        # mode by mode, every conversation at once: an interrupted run loses whole modes
        baselines = [] if args.skip_baselines else ["prompt", "nomem"]
        for mode in [*baselines, *[v.name for v in variants]]:
            hydrated = {c.name: None for c in convs}
            if mode not in ("prompt", "nomem"):
                variant = next(v for v in variants if v.name == mode)
                for conv in convs:
                    hydrated[conv.name] = encode_variant(args, loaded, conv, variant, root)
                    await engine.hydrate(hydrated[conv.name][0], version=hydrated[conv.name][1],
                                         tier="gpu")
            await engine.llm.reset_prefix_cache()
            await asyncio.gather(*(phase_of(c, mode, hydrated[c.name]) for c in convs))
            for h in hydrated.values():
                if h is not None:
                    await engine.evict(h[0])
    finally:
        engine.shutdown()


def _save(res: dict, out: str | None, complete: bool, wall: float) -> dict:
    res.update(complete=complete, wall_seconds=wall)
    res["summary"]["wall_seconds"] = wall
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(locomo_report.dumps(res))
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversation", nargs="+",
                    default=["../shared/data/locomo/conv-26.json"],
                    help="LoCoMo-format JSON files (each one user)")
    ap.add_argument("--model", default="embedded", help="'embedded' or an HF checkpoint dir")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the encoder and the embedder run")
    ap.add_argument("--kv-dtype", default=None,
                    help="engine, encoder and stored KV dtype (default: bfloat16 on CUDA, "
                         "float32 on CPU)")
    ap.add_argument("--compile", action="store_true",
                    help="compiled engine with CUDA graphs (default: eager)")
    ap.add_argument("--fact-mode", choices=["raw", "mem0"], default="raw",
                    help="raw: every turn one fact (no LLM); mem0: extract with an LLM")
    ap.add_argument("--llm-base-url", default=None, help="OpenAI-compatible endpoint (mem0)")
    ap.add_argument("--llm-model", default=None, help="model name at --llm-base-url (mem0)")
    ap.add_argument("--windows", type=int, nargs="*", default=[0, 5, 20, 50],
                    help="add kv_w{w}: the default encoder config at window w")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=V,...",
                    help="add a KV variant with these encoder-config fields (repeatable)")
    ap.add_argument("--variants-file", default=None,
                    help="a file of --variant specs, one per line (# comments, [section])")
    ap.add_argument("--section", default=None,
                    help="only the specs under this [section] header of --variants-file")
    ap.add_argument("--base", default=None, metavar="FIELD=V,...",
                    help="encoder-config fields of the kv_w{w} modes besides the window "
                         "(default: the pipeline's defaults)")
    ap.add_argument("--default-variant", default=None,
                    help="the variant the summary compares with the prompt baseline "
                         "(f1_default_minus_prompt_min)")
    ap.add_argument("--compare", nargs=2, default=None, metavar=("A", "B"),
                    help="also compare mode A with mode B (paired, per k): summary "
                         "f1_A_minus_B_min, ci_A_minus_B_k{k}, same_prediction_A_B_k{k}")
    ap.add_argument("--skip-baselines", action="store_true",
                    help="answer only the KV variants (no prompt baseline, no nomem)")
    ap.add_argument("--part", default=None, metavar="I/N",
                    help="only the I-th of N contiguous slices of the variants (in the order "
                         "they run), for a sweep longer than one call; join the parts' "
                         "results with benchmarks.locomo_merge")
    ap.add_argument("--select-default", action="store_true",
                    help="after the run, pick the default variant by the fixed rule of "
                         "benchmarks.locomo_select and compare it with the baseline")
    ap.add_argument("--rule", choices=["exact", "injection"], default="exact",
                    help="--select-default's rule (benchmarks.locomo_select)")
    ap.add_argument("--max-tail", type=int, default=5,
                    help="longest text tail the exact rule may pick (serving cost)")
    ap.add_argument("--ks", type=int, nargs="+", default=[5, 10, 20, 50],
                    help="numbers of retrieved facts")
    ap.add_argument("--max-questions", type=int, default=None,
                    help="an evenly spaced subset of each conversation's questions")
    ap.add_argument("--max-tokens", type=int, default=16, help="answer length (greedy)")
    ap.add_argument("--concurrency", type=int, default=16, help="questions in flight")
    ap.add_argument("--batch-tokens", type=int, default=None, help="encoder pass size")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2,
                    help="vLLM's share of GPU memory (on CPU: of host RAM)")
    ap.add_argument("--max-model-len", type=int, default=4096, help="vLLM's context length")
    ap.add_argument("--store-budget-gb", type=int, default=8, help="connector store budget")
    ap.add_argument("--workdir", default=None, help="artifact directory (default: a temp dir)")
    ap.add_argument("--out", default=None, help="result JSON (written after every phase)")
    ap.add_argument("--grid-out", default=None,
                    help="also write the baseline, no memory and the kv_w{w} grid alone here")
    args = ap.parse_args(argv)
    args.ks = sorted(args.ks)
    cuda = args.device.startswith("cuda")
    args.kv_dtype = args.kv_dtype or ("bfloat16" if cuda else "float32")
    args.batch_tokens = args.batch_tokens or (65536 if cuda else 8192)
    base = parse_variant(f"base:{args.base}").fields if args.base else ()
    if any(key == "window" for key, _ in base):
        ap.error("--base sets every field but the window")
    variants = [Variant(f"kv_w{w}", (*base, ("window", w))) for w in args.windows]
    specs = list(args.variant)
    if args.variants_file:
        specs += read_specs(Path(args.variants_file).read_text(), args.section)
    variants += [parse_variant(s) for s in specs]
    # variants sharing an encoding run back to back (it is encoded once for them)
    variants.sort(key=lambda v: encoding_key(v.encoder_config()))
    if len({v.name for v in variants}) != len(variants):
        ap.error("variant names must be unique")
    planned = [v.name for v in variants]
    if args.part:
        if args.select_default:
            ap.error("--part: select the default on the merged result (benchmarks.locomo_merge)")
        try:
            variants = part_of(variants, args.part)
        except ValueError as e:
            ap.error(str(e))
    if args.default_variant and args.default_variant not in {v.name for v in variants}:
        ap.error(f"--default-variant {args.default_variant!r} is not a variant")
    if args.compare and not set(args.compare) <= {v.name for v in variants} | {"prompt"}:
        ap.error(f"--compare {args.compare}: both must be variants (or prompt)")
    if args.skip_baselines and (args.select_default or args.default_variant or (
            args.compare and "prompt" in args.compare)):
        ap.error("--skip-baselines leaves nothing to compare a default with")
    t_start = time.perf_counter()
    command = command_line(__spec__.name, argv)

    from inferscale.encode.identity import EncoderConfig
    from inferscale.models import load_model
    from inferscale.serve.retrieval import Embedder

    loaded = load_model(args.model, Settings().home, device=args.device, dtype=args.kv_dtype)
    embedder = Embedder(Settings().embedder, device=args.device)
    convs = [prepare(args, path, loaded, embedder) for path in args.conversation]
    root = Path(args.workdir or tempfile.mkdtemp(prefix="inferscale-locomo-")) / "artifacts"
    print(json.dumps({"conversations": {c.name: {"facts": c.facts.num_rows,
                                                  "questions": len(c.questions)}
                                         for c in convs},
                      "setup_seconds": round(time.perf_counter() - t_start, 1)}), flush=True)
    phases: list[dict] = []
    answers: dict = {}
    meta = {
        "command": command, "model": args.model, "fact_mode": args.fact_mode,
        "device": locomo_report.device_line(args.device),
        "query_template": QUERY_TEMPLATE, "max_tokens": args.max_tokens, "greedy": True,
        "kv_dtype": args.kv_dtype, "compiled": args.compile, "ks": args.ks,
        "variants": {v.name: dict(v.fields) for v in variants},
        **({"part": args.part, "planned_variants": planned} if args.part else {}),
        "encoder_defaults": EncoderConfig().to_dict(),
        "default_variant": args.default_variant, "phases": phases, "compare": args.compare,
    }

    grid = [f"kv_w{w}" for w in args.windows]

    def write(complete: bool) -> dict:
        wall = round(time.perf_counter() - t_start, 1)
        res = locomo_report.report(meta, convs, answers, [v.name for v in variants], args.ks,
                                   args.default_variant)
        if args.grid_out:  # the same run, restricted to the baseline and the window grid
            kept = {key: a for key, a in answers.items() if key[1] in ("prompt", "nomem", *grid)}
            sub = locomo_report.report({**meta, "default_variant": None, "variants": {
                m: meta["variants"][m] for m in grid}}, convs, kept, grid, args.ks, None)
            _save(sub, args.grid_out, complete, wall)
        return _save(res, args.out, complete, wall)

    def on_phase(conv, mode, phase, got) -> None:
        phases.append(phase)
        for (i, k), a in got.items():
            answers[(conv.name, mode, i, k)] = a
        write(complete=False)  # a partial result survives an interruption

    asyncio.run(run(args, loaded, convs, variants, root, on_phase))
    res = write(complete=True)
    if args.select_default:
        from benchmarks.locomo_select import select, select_injection

        if args.rule == "injection":
            (name, _, score), rule = select_injection(res), "--rule injection"
        else:
            (name, _, score), rule = select(res, args.max_tail), f"--max-tail {args.max_tail}"
        meta.update(default_variant=name, default_rule=f"benchmarks.locomo_select {rule}",
                    default_score=score)
        args.default_variant = name
        res = write(complete=True)
    print(json.dumps(res["summary"]))
    return res


if __name__ == "__main__":
    main()
