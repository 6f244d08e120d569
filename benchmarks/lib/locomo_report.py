"""Scores and tables of ``benchmarks.locomo``: F1 per mode, k and category, paired
bootstrap intervals against the prompt baseline, transcript-continuation shares, the
injected share of the retrieved facts' tokens and evidence recall, per conversation and
pooled.

Callers: ``benchmarks.locomo`` (after every phase), ``benchmarks.locomo_select``.
"""

from __future__ import annotations

import json
import platform
from typing import Any, Iterable, Sequence

from benchmarks.lib import qa_metrics

SHARE_FROM_K = 10  # injected_share_min_k10: the default's smallest share over k >= this


def dumps(result: dict) -> str:
    """The result as JSON text: indented, but one line per answer record (compact and
    still diffable; a run holds tens of thousands of them)."""
    head = {k: v for k, v in result.items() if k != "records"}
    text = json.dumps(head, indent=1)
    if "records" not in result:
        return text + "\n"
    lines = ",\n".join(json.dumps(r, separators=(",", ":")) for r in result["records"])
    return text[:-2] + ',\n "records": [\n' + lines + "\n ]\n}\n"


def device_line(device: str) -> str:
    import torch

    try:
        import vllm
        engine = f"vllm {vllm.__version__}"
    except ImportError:  # the report is also built where no engine is installed
        engine = "no vllm"
    if device.startswith("cuda") and torch.cuda.is_available():
        where = torch.cuda.get_device_name(torch.device(device))
    else:
        where = f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads"
    return f"{where} (torch {torch.__version__}, {engine})"


def _mean(xs: Sequence[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def score_answers(convs: Iterable[Any], answers: dict) -> list[dict]:
    """One record per answer: conversation, mode, k, question, prediction, F1, whether it
    continues the transcript, and the request's token counts."""
    by_name = {c.name: c for c in convs}
    records = []
    for (name, mode, i, k), a in sorted(answers.items(), key=lambda x: (x[0][0], x[0][1],
                                                                         x[0][3], x[0][2])):
        conv = by_name[name]
        q = conv.questions[i]
        pred = qa_metrics.first_line(a["text"])
        records.append({
            "conversation": name, "mode": mode, "k": k, "q": i, "category": q["category"],
            "prediction": pred,
            "f1": round(qa_metrics.locomo_f1(pred, q["answer"], q["category"]), 4),
            "continues": qa_metrics.continues_transcript(a["text"], conv.speakers),
            "memory_tokens": a["memory_tokens"], "tail_tokens": a["tail_tokens"],
            "fact_tokens": a.get("fact_tokens", 0),
            "injected_fact_tokens": a.get("injected_fact_tokens", 0),
            "injected": a["injected"], "fallback": a["fallback"]})
    return records


def _rows(scope: str, records: list[dict], modes: list[str], ks: list[int],
          expected: int) -> list[dict]:
    """Rows per (mode, k) of ``records`` (one scope: a conversation, or all pooled); a
    cell with fewer than ``expected`` answers (an interrupted run) has no row."""
    cell: dict[tuple[str, int], dict[tuple[str, int], dict]] = {}
    for r in records:
        cell.setdefault((r["mode"], r["k"]), {})[(r["conversation"], r["q"])] = r
    rows = []
    for mode in ["prompt", "nomem", *modes]:
        for k in ([0] if mode == "nomem" else ks):
            got = cell.get((mode, k))
            if not got or len(got) < expected:
                continue
            recs = list(got.values())
            s = qa_metrics.summarize((r["category"], r["f1"]) for r in recs)
            row = {"scope": scope, "mode": mode, "k": k, "questions": s["n"],
                   "f1": s["overall"],
                   **{f"f1_{c}": v["mean"] for c, v in s["by_category"].items()},
                   "continues": _mean([float(r["continues"]) for r in recs]),
                   "memory_tokens": _mean([r["memory_tokens"] for r in recs]),
                   "tail_tokens": _mean([r["tail_tokens"] for r in recs]),
                   "injected_share": _share(recs)}
            base = cell.get(("prompt", k))
            if mode not in ("prompt", "nomem") and base and set(base) >= set(got):
                keys = sorted(got)
                row["vs_prompt"] = qa_metrics.paired_bootstrap(
                    [got[x]["f1"] for x in keys], [base[x]["f1"] for x in keys])
                row["fallbacks"] = sum(1 for r in recs if r["injected"] == 0)
            rows.append(row)
    return rows


def _share(recs: list[dict]) -> float | None:
    """The retrieved facts' tokens the layout injects (the rest are prefilled as text),
    pooled over the answers: None where no fact was retrieved (no memory)."""
    total = sum(r.get("fact_tokens", 0) for r in recs)
    return round(sum(r.get("injected_fact_tokens", 0) for r in recs) / total, 4) if total else None


def _summary(rows: list[dict], modes: list[str], ks: list[int], default: str | None,
             convs: Sequence[Any]) -> dict:
    out: dict[str, Any] = {"questions": sum(len(c.questions) for c in convs)}
    by = {(r["mode"], r["k"]): r for r in rows}
    for (mode, k), r in by.items():
        out["f1_nomem" if mode == "nomem" else f"f1_{mode}_k{k}"] = r["f1"]
        if "vs_prompt" in r:
            out[f"ci_{mode}_minus_prompt_k{k}"] = [r["vs_prompt"]["lo"], r["vs_prompt"]["hi"]]
        if r.get("injected_share") is not None:
            out[f"injected_share_{mode}_k{k}"] = r["injected_share"]
    for mode in ["prompt", "nomem", *modes]:
        shares = [r["continues"] for (m, _), r in by.items() if m == mode]
        if shares:
            out[f"continues_{mode}"] = _mean(shares)
    for k in ks:
        hits = [len(set(q["evidence"]) & set(q["top_sources"][:k])) / len(set(q["evidence"]))
                for c in convs for q in c.questions if q["evidence"]]
        out[f"evidence_recall_k{k}"] = _mean(hits)
    if default and all((default, k) in by and ("prompt", k) in by for k in ks):
        diffs = [by[(default, k)]["f1"] - by[("prompt", k)]["f1"] for k in ks]
        out["f1_default_minus_prompt_min"] = round(min(diffs), 4)
        out["continues_default_minus_prompt"] = round(
            out[f"continues_{default}"] - out["continues_prompt"], 4)
        shares = [out.get(f"injected_share_{default}_k{k}") for k in ks if k >= SHARE_FROM_K]
        if shares and None not in shares:
            out["injected_share_min_k10"] = min(shares)
    return out


def compare(records: list[dict], a: str, b: str, ks: list[int]) -> dict:
    """Mode ``a`` against mode ``b`` on the same questions (e.g. fp8 memory against bf16
    memory): per k the F1 difference, its paired bootstrap 95% interval and the share of
    identical predictions; ``f1_{a}_minus_{b}_min`` is the worst k. Empty while a k lacks
    either mode's answers."""
    cell: dict[tuple[str, int], dict] = {}
    for r in records:
        cell.setdefault((r["mode"], r["k"]), {})[(r["conversation"], r["q"])] = r
    out: dict[str, Any] = {}
    diffs = []
    for k in ks:
        x, y = cell.get((a, k), {}), cell.get((b, k), {})
        keys = sorted(set(x) & set(y))
        if not keys or len(keys) < max(len(x), len(y)):
            return {}
        ci = qa_metrics.paired_bootstrap([x[q]["f1"] for q in keys], [y[q]["f1"] for q in keys])
        out[f"f1_{a}_minus_{b}_k{k}"] = ci["mean"]
        out[f"ci_{a}_minus_{b}_k{k}"] = [ci["lo"], ci["hi"]]
        out[f"same_prediction_{a}_{b}_k{k}"] = round(
            sum(x[q]["prediction"] == y[q]["prediction"] for q in keys) / len(keys), 4)
        diffs.append(ci["mean"])
    out[f"f1_{a}_minus_{b}_min"] = round(min(diffs), 4)
    return out


def report(meta: dict, convs: Sequence[Any], answers: dict, modes: list[str], ks: list[int],
           default: str | None) -> dict:
    """The whole result: rows and summaries per conversation and pooled, every answer
    (and, with ``meta["compare"] = [a, b]``, mode a against mode b in the summaries)."""
    records = score_answers(convs, answers)
    pooled = _rows("pooled", records, modes, ks, sum(len(c.questions) for c in convs))
    per_conv = {}
    for c in convs:
        rows = _rows(c.name, [r for r in records if r["conversation"] == c.name], modes, ks,
                     len(c.questions))
        per_conv[c.name] = {"facts": c.facts.num_rows, "questions": len(c.questions),
                            "rows": rows, "summary": _summary(rows, modes, ks, default, [c])}
    summary = _summary(pooled, modes, ks, default, convs)
    if meta.get("compare"):
        a, b = meta["compare"]
        summary.update(compare(records, a, b, ks))
        for c in convs:
            per_conv[c.name]["summary"].update(compare(
                [r for r in records if r["conversation"] == c.name], a, b, ks))
    return {
        **meta,
        "conversations": per_conv,
        "rows": pooled,
        "summary": summary,
        "records": records,
        "questions_list": {c.name: [{k: q[k] for k in ("id", "question", "answer", "category")}
                                    for q in c.questions] for c in convs},
    }
