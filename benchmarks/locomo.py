"""LoCoMo answer quality: KV injection (per encoder window w) against the prompt baseline.

For one LoCoMo-format conversation: the user's memory is built with the pipeline
(turns -> facts with ``inferscale.facts.extractor.extract_facts``: ``--fact-mode raw`` makes every
turn one fact ``"[date] Speaker: text"``; ``mem0`` extracts facts with an LLM through an
OpenAI-compatible endpoint), encoded once per window ``w`` with the serving model and
published as one artifact per ``w``. Every question of categories 1-4 is then answered,
greedily, on ONE vLLM engine:

- ``prompt``: the Mem0-style baseline: the top-k facts as text in the prompt, full
  prefill (prefix caching on);
- ``kv_w{w}``: the same prompt token ids, the memory part injected from the ``w``
  artifact by the connector; only the query is prefilled.

Retrieval is done once per question (MiniLM, exact top-``max(ks)``), and top-k is its
first k facts, so every mode and every k answers from the same facts in the same order;
the prompt is ``Composer.compose([prefix, facts...], query)`` exactly as
``MemoryServer.prepare`` builds it. The query is :data:`QUERY_TEMPLATE` around the
question (LoCoMo's own "Short answer:" style; the same for every mode). Answers (first line of at most
``--max-tokens`` tokens) are scored with LoCoMo's token F1 (:mod:`benchmarks.qa_metrics`)
per category and overall; ``--judge-url`` adds an LLM judge.

Speed (2 shared CPU cores): one engine; per question the ks run in increasing order so
that each request finds its shorter-k prefix in vLLM's prefix cache (same salt), and
``--concurrency`` questions run at once so vLLM batches them; encodings are shared
across k. Each window encodes only the facts its questions retrieve at ``max(ks)``:
outputs are identical to encoding every fact (retrieval ran over all facts first, and
those are all the prompts use), and the offline cost drops. A window's encoding costs
about ``(w + 1) x 40`` forward tokens per fact, so ``--window-questions 50=M`` answers
window 50 on only M of the questions (the baseline is then also reported on those M).
A partial result is written after every phase.

    python benchmarks/locomo.py --conversation ../shared/data/locomo/conv-26.json \\
        --out benchmarks/results/locomo-cpu-smollm2.json

Needs ``nltk`` (Porter stemmer of the metric). Starts an engine: run as a script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferscale.settings import Settings, offline_environment  # noqa: E402

offline_environment()

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import torch  # noqa: E402

from benchmarks import qa_metrics  # noqa: E402

QUERY_TEMPLATE = "Question: {question} Short answer:"  # the same for every mode


def load_questions(conversation: str, categories=(1, 2, 3, 4),
                   max_questions: int | None = None) -> list[dict]:
    """The conversation's questions of ``categories``; ``max_questions`` keeps that many,
    evenly spaced over the file's order (so every category keeps its share)."""
    data = json.loads(Path(conversation).read_text())
    qa = [q for q in data.get("qa", []) if q.get("category") in categories]
    if max_questions and max_questions < len(qa):
        step = len(qa) / max_questions
        qa = [qa[int(i * step)] for i in range(max_questions)]
    return [{"id": i, "question": q["question"], "answer": str(q.get("answer", "")),
             "category": q["category"], "evidence": q.get("evidence", [])}
            for i, q in enumerate(qa)]


def build_facts(args, turns: pa.Table, tokenizer) -> tuple[pa.Table, dict]:
    """The pipeline's fact step for this user (raw or mem0 mode)."""
    from inferscale.facts.extractor import FactsConfig, extract_facts

    cfg = FactsConfig(mode=args.fact_mode, llm_base_url=args.llm_base_url,
                      llm_model=args.llm_model)
    t0 = time.perf_counter()
    (result,) = extract_facts(turns, tokenizer, cfg).values()
    return result.table, {"facts": result.table.num_rows, "turns": turns.num_rows,
                          "fact_mode": args.fact_mode,
                          "seconds": round(time.perf_counter() - t0, 1)}


def for_user(facts: pa.Table, user: str) -> pa.Table:
    """The same facts (same ids, texts, token ids, embeddings) owned by ``user``."""
    col = facts.schema.get_field_index("user")
    return facts.set_column(col, facts.schema.field(col), pa.array([user] * facts.num_rows))


def retrieve(facts: pa.Table, questions: list[dict], k: int) -> list[list[str]]:
    """Top-``k`` fact ids per question, best first (the serving path's exact top-k)."""
    from inferscale.serve.retrieval import Embedder, FactIndex

    emb = Embedder("embedded", device="cpu")
    q = emb.embed([item["question"] for item in questions])
    return FactIndex.from_table(facts, device="cpu").topk(q, min(k, facts.num_rows))


def spaced(n: int, m: int | None) -> list[int]:
    """``m`` evenly spaced indices of ``range(n)`` (all when ``m`` is None or >= n)."""
    if m is None or m >= n:
        return list(range(n))
    return [int(i * n / m) for i in range(m)]


def encode_window(args, loaded, turns: pa.Table, facts: pa.Table, user: str, root: Path,
                  w: int) -> tuple[str, dict]:
    """Encode ``facts`` with window ``w`` and publish them as user ``{user}-w{w}``."""
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.publish import Lineage, publish
    from inferscale.encode.encoder import EncoderConfig
    from inferscale.facts.extractor import facts_hash
    from inferscale.ingest.logs import turns_hash
    from benchmarks.memory_setup import encoded_memory

    cfg = EncoderConfig(window=w, dtype="float32", batch_tokens=args.batch_tokens)
    t0 = time.perf_counter()
    mem = encoded_memory(loaded.model, loaded.tokenizer, turns, facts, cfg, loaded.fingerprint)
    enc_s = time.perf_counter() - t0
    wuser = f"{user}-w{w}"
    wfacts = for_user(facts, wuser)
    res = publish(StoreConfig(str(root)), wuser, mem, wfacts,
                  Lineage(turns_hash(turns), facts_hash(wfacts, "bench")), embeddings=False)
    row = {"window": w, "facts": facts.num_rows, "encode_seconds": round(enc_s, 1),
           "forward_tokens_per_s": round(mem.stats["forward_tokens"] / enc_s, 1), **mem.stats}
    print(json.dumps({"encoded": row}), flush=True)
    return res.version, row


async def run_modes(args, loaded, root: Path, user: str, turns: pa.Table, facts: pa.Table,
                    questions: list[dict], top: list[list[str]], mode_questions: dict,
                    on_phase) -> None:
    """Every (mode, question, k) on one engine. A window's facts are encoded just before
    its phase (the engine idles meanwhile); ``on_phase(phase, answers)`` after each."""
    from inferscale.encode.compose import Composer
    from inferscale.serve.engine import EngineConfig, MemoryEngine, MemoryRef
    from inferscale.types import PREFIX_ID

    engine = await MemoryEngine(EngineConfig(
        model=str(loaded.checkpoint), model_fingerprint=loaded.fingerprint, dtype="float32",
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        artifact_root=str(root), gpu_budget_bytes=args.store_budget_gb << 30)).start()
    composer = Composer(loaded.tokenizer)
    token_ids = dict(zip(facts.column("fact_id").to_pylist(),
                         facts.column("token_ids").to_pylist()))
    token_ids[PREFIX_ID] = composer.prefix_ids()
    answers: dict[str, dict] = {}
    try:
        for mode, qids in mode_questions.items():
            phase: dict = {"mode": mode, "questions": len(qids)}
            w = None if mode == "prompt" else int(mode[len("kv_w"):])
            wuser = f"{user}-w{w}"
            if w is not None:
                used = sorted({f for i in qids for f in top[i]})
                wfacts = facts.filter(pc.is_in(facts["fact_id"], pa.array(used)))
                version, phase["encode"] = encode_window(args, loaded, turns, wfacts, user,
                                                         root, w)
                await engine.hydrate(wuser, version=version, tier="gpu")
            sem = asyncio.Semaphore(args.concurrency)
            fallbacks = 0

            async def chain(i: int) -> None:
                nonlocal fallbacks
                async with sem:
                    for k in args.ks:  # increasing: each k finds the shorter k's prefix cached
                        chunks = (PREFIX_ID, *top[i][:k])
                        ids, m = composer.compose([token_ids[c] for c in chunks],
                                                  QUERY_TEMPLATE.format(question=questions[i]["question"]))
                        ref = None if w is None else MemoryRef(wuser, version, chunks)
                        gen = await engine.generate(ids, ref, max_tokens=args.max_tokens)
                        if ref is not None and (gen.fallback or gen.injected_tokens == 0) \
                                and gen.cached_tokens < m:
                            fallbacks += 1
                        answers[f"{mode}|{i}|{k}"] = {
                            "text": gen.text, "memory_tokens": m, "prompt_tokens": len(ids),
                            "injected": gen.injected_tokens, "cached": gen.cached_tokens,
                            "fallback": gen.fallback}

            await engine.llm.reset_prefix_cache()
            before = engine.prompt_token_counters()
            t0 = time.perf_counter()
            await asyncio.gather(*(chain(i) for i in qids))
            after = engine.prompt_token_counters()
            phase.update(answer_seconds=round(time.perf_counter() - t0, 1),
                         requests=len(qids) * len(args.ks), kv_fallbacks=fallbacks,
                         prompt_tokens={s: after[s] - before[s] for s in after})
            print(json.dumps({"phase": phase}), flush=True)
            if w is not None:
                await engine.evict(wuser)
            on_phase(phase, answers)
    finally:
        engine.shutdown()


def score(args, questions: list[dict], top: list[list[str]], answers: dict,
          mode_questions: dict) -> tuple[list[dict], dict, list[dict]]:
    """Rows per (mode, k): F1 overall and per category on the mode's questions, and the
    prompt baseline's F1 on the same questions (paired); per-answer records."""
    f1s: dict[tuple[str, int, int], float] = {}
    records = []
    for key, a in answers.items():
        mode, i, k = key.split("|")
        q = questions[int(i)]
        pred = qa_metrics.first_line(a["text"])
        f1s[(mode, int(i), int(k))] = qa_metrics.locomo_f1(pred, q["answer"], q["category"])
        records.append({"mode": mode, "k": int(k), "q": int(i), "prediction": pred,
                        "f1": round(f1s[(mode, int(i), int(k))], 4)})
    rows, summary = [], {}
    for mode, qids in mode_questions.items():
        for k in args.ks:
            if any((mode, i, k) not in f1s for i in qids):
                continue
            s = qa_metrics.summarize((questions[i]["category"], f1s[(mode, i, k)]) for i in qids)
            row = {"mode": mode, "window": None if mode == "prompt" else int(mode[4:]), "k": k,
                   "questions": s["n"], "f1": s["overall"],
                   **{f"f1_{c}": v["mean"] for c, v in s["by_category"].items()}}
            if mode != "prompt" and all(("prompt", i, k) in f1s for i in qids):
                row["f1_prompt_same_questions"] = qa_metrics.summarize(
                    (questions[i]["category"], f1s[("prompt", i, k)]) for i in qids)["overall"]
                if len(qids) < len(mode_questions["prompt"]):
                    summary[f"f1_prompt_k{k}_on_{mode}_questions"] = row["f1_prompt_same_questions"]
            rows.append(row)
            summary[f"f1_{mode}_k{k}"] = s["overall"]
    for k in args.ks:  # evidence recall of the shared retrieval: were the needed turns there?
        hits = [len(set(q["evidence"]) & {q_src for q_src in q["top_sources"][:k]})
                / len(set(q["evidence"])) for q in questions if q["evidence"]]
        summary[f"evidence_recall_k{k}"] = round(sum(hits) / len(hits), 4) if hits else None
    return rows, summary, records


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversation", default="../shared/data/locomo/conv-26.json")
    ap.add_argument("--model", default="embedded", help="'embedded' or an HF checkpoint dir")
    ap.add_argument("--fact-mode", choices=["raw", "mem0"], default="raw")
    ap.add_argument("--llm-base-url", default=None, help="OpenAI-compatible endpoint (mem0)")
    ap.add_argument("--llm-model", default=None, help="model name at --llm-base-url")
    ap.add_argument("--windows", type=int, nargs="+", default=[0, 5, 20, 50])
    ap.add_argument("--ks", type=int, nargs="+", default=[5, 10, 20, 50])
    ap.add_argument("--max-questions", type=int, default=None,
                    help="evenly spaced subset of the category 1-4 questions")
    ap.add_argument("--window-questions", nargs="*", default=[], metavar="W=M",
                    help="answer window W on only M (evenly spaced) of the questions: its "
                         "encoding cost grows with W; the baseline is reported on the same M")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16, help="questions in flight")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="encoder pass size")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--store-budget-gb", type=int, default=8, help="connector store budget")
    ap.add_argument("--judge-url", default=None, help="OpenAI-compatible judge endpoint")
    ap.add_argument("--judge-model", default=None)
    ap.add_argument("--judge-key", default="EMPTY")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.ks = sorted(args.ks)
    if args.judge_url and not args.judge_model:
        ap.error("--judge-url needs --judge-model")
    limits = {}
    for spec in args.window_questions:
        w, _, m = spec.partition("=")
        if not (w.isdigit() and m.isdigit()) or int(w) not in args.windows:
            ap.error(f"--window-questions takes W=M with W among --windows, got {spec!r}")
        limits[int(w)] = int(m)
    t_start = time.perf_counter()
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])

    from benchmarks.memory_setup import load_turns
    from inferscale.encode.models import load_model

    questions = load_questions(args.conversation, max_questions=args.max_questions)
    loaded = load_model(args.model, Settings().home, device="cpu", dtype="float32")
    turns = load_turns(args.conversation)
    user = turns.column("user")[0].as_py()
    facts, fact_info = build_facts(args, turns, loaded.tokenizer)
    top = retrieve(facts, questions, max(args.ks))
    source = dict(zip(facts.column("fact_id").to_pylist(),
                      facts.column("source_turn_id").to_pylist()))
    for q, t in zip(questions, top):
        q["top_sources"] = [source[f] for f in t]
    mode_questions = {"prompt": list(range(len(questions)))}
    for w in args.windows:
        mode_questions[f"kv_w{w}"] = spaced(len(questions), limits.get(w))
    root = Path(args.workdir or tempfile.mkdtemp(prefix="inferscale-locomo-")) / "artifacts"
    setup_s = time.perf_counter() - t_start
    print(json.dumps({"facts": fact_info, "questions": len(questions),
                      "setup_seconds": round(setup_s, 1)}), flush=True)
    phases: list[dict] = []

    def result(answers: dict, complete: bool) -> dict:
        rows, summary, records = score(args, questions, top, answers, mode_questions)
        wall = time.perf_counter() - t_start
        return {
            "command": command,
            "device": f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads "
                      f"(torch {torch.__version__}, vllm {__import__('vllm').__version__})",
            "complete": complete, "model": args.model,
            "conversation": Path(args.conversation).name, "facts": fact_info,
            "questions": len(questions), "questions_available": len(
                load_questions(args.conversation)),
            "questions_per_mode": {m: len(v) for m, v in mode_questions.items()},
            "query_template": QUERY_TEMPLATE, "max_tokens": args.max_tokens, "greedy": True,
            "kv_dtype": "float32", "windows": args.windows, "ks": args.ks,
            "setup_seconds": round(setup_s, 1), "phases": phases,
            "wall_seconds": round(wall, 1),
            "rows": rows, "summary": {**summary, "wall_seconds": round(wall, 1)},
            "records": records,
            "questions_list": [{k: q[k] for k in ("id", "question", "answer", "category")}
                               for q in questions],
        }

    def write(res: dict) -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")

    def on_phase(phase: dict, answers: dict) -> None:
        phases.append(phase)
        write(result(answers, complete=False))  # a partial result survives an interruption

    answers: dict = {}
    asyncio.run(run_modes(args, loaded, root, user, turns, facts, questions, top,
                          mode_questions, lambda p, a: (answers.update(a), on_phase(p, a))))
    res = result(answers, complete=True)
    if args.judge_url:
        cfg = qa_metrics.JudgeConfig(args.judge_url, args.judge_model, args.judge_key)
        verdicts = qa_metrics.judge(
            [{"question": questions[r["q"]]["question"], "reference": questions[r["q"]]["answer"],
              "prediction": r["prediction"]} for r in res["records"]], cfg)
        for r, v in zip(res["records"], verdicts):
            r["judge"] = v
        res["judge"] = {"url": args.judge_url, "model": args.judge_model}
        for row in res["rows"]:
            qids = set(mode_questions[row["mode"]])
            vs = [r["judge"] for r in res["records"] if r["mode"] == row["mode"]
                  and r["k"] == row["k"] and r["q"] in qids and r["judge"] is not None]
            row["judge_accuracy"] = round(sum(vs) / len(vs), 4) if vs else None
            res["summary"][f"judge_{row['mode']}_k{row['k']}"] = row["judge_accuracy"]
    write(res)
    print(json.dumps(res["summary"]))
    return res


if __name__ == "__main__":
    main()
