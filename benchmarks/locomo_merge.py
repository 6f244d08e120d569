"""Join ``benchmarks.locomo`` results of one sweep run in parts (a run cut short, the
variants it did not reach run again with ``--variant`` flags) into one result.

Every part answers the same questions with its own prompt and no-memory baselines, and
a bf16 engine answering 128 requests at once is not bitwise repeatable, so two parts'
baselines differ slightly (the pooled prompt F1 by up to ~0.002 at a k). A variant is
therefore only ever compared with the baseline of the part that answered it: its rows,
paired intervals and continuation share come from that part, and the merged summary
gives its paired F1 difference as ``f1_<variant>_minus_prompt_k<k>`` (what
``benchmarks.locomo_select`` uses where present). The first part's baselines stand for
the result (rows, plots); each part's baseline F1 is kept in ``parts`` with the largest
spread between parts (``prompt_f1_spread``). The records of the variants taken and of
every part's baselines stay, tagged ``part`` (a variant a part left unfinished is
dropped there).
A variant complete in several parts is taken from the first; ``complete`` is true when
every variant the first part planned (``planned_variants`` of a ``--part`` run, else its
variants) is complete in some part.

    python -m benchmarks.locomo_merge cut-short.json rest.json --out merged.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.lib.locomo_report import dumps
from benchmarks.lib.results import command_line

BASELINES = ("prompt", "nomem")
# what must agree between parts for their answers to be comparable
SAME = ("model", "fact_mode", "query_template", "max_tokens", "greedy", "kv_dtype",
        "compiled", "ks", "encoder_defaults")


def complete_variants(result: dict) -> list[str]:
    """The variants of ``result`` with a pooled row at every k."""
    have = {(r["mode"], r["k"]) for r in result["rows"]}
    return [v for v in result["variants"] if all((v, k) in have for k in result["ks"])]


def _check(first: dict, other: dict, i: int) -> None:
    for key in SAME:
        if first.get(key) != other.get(key):
            raise SystemExit(f"part {i} differs in {key!r}: {other.get(key)!r} "
                             f"vs {first.get(key)!r}")
    qa, qb = first.get("questions_list"), other.get("questions_list")
    if qa != qb:
        raise SystemExit(f"part {i} answers other questions")
    for base in BASELINES:
        if base not in {r["mode"] for r in other["rows"]}:
            raise SystemExit(f"part {i} has no {base} baseline to pair its variants with")


def _variant_keys(summary: dict, name: str) -> dict:
    """The summary keys of variant ``name`` (f1, intervals, shares, continuation)."""
    out = {}
    for key, value in summary.items():
        if key == f"continues_{name}" or key.startswith((f"f1_{name}_k", f"injected_share_{name}_k",
                                                         f"ci_{name}_minus_prompt_k")):
            out[key] = value
    return out


def _paired_diffs(summary: dict, name: str, ks: list[int]) -> dict:
    return {f"f1_{name}_minus_prompt_k{k}": round(summary[f"f1_{name}_k{k}"]
                                                  - summary[f"f1_prompt_k{k}"], 4) for k in ks}


def merge(parts: list[dict], command: str | None = None) -> dict:
    """``parts`` (first: the one whose baselines stand for the result) -> one result."""
    if len(parts) < 2:
        raise SystemExit("nothing to merge: give at least two results")
    first = parts[0]
    for i, other in enumerate(parts[1:], 1):
        _check(first, other, i)
    ks = first["ks"]
    out = {k: v for k, v in first.items()
           if k not in ("rows", "summary", "records", "conversations", "phases", "variants",
                        "complete", "wall_seconds", "command", "part", "planned_variants")}
    out["variants"], out["rows"], out["records"], out["phases"] = {}, [], [], []
    out["conversations"] = {name: {**{k: v for k, v in conv.items()
                                      if k not in ("rows", "summary")}, "rows": [],
                                   "summary": {}}
                            for name, conv in first["conversations"].items()}
    summary = {k: v for k, v in first["summary"].items()
               if k == "questions" or k.startswith("evidence_recall") or k == "f1_nomem"
               or k in ("continues_prompt", "continues_nomem")
               or k.startswith(("f1_prompt_k", "injected_share_prompt_k"))}
    for name, conv in first["conversations"].items():
        out["conversations"][name]["summary"] = {
            k: v for k, v in conv["summary"].items() if k in summary}
    out["rows"] = [r for r in first["rows"] if r["mode"] in BASELINES]
    for name, conv in first["conversations"].items():
        out["conversations"][name]["rows"] = [r for r in conv["rows"] if r["mode"] in BASELINES]
    out["parts"], taken = [], set()
    for i, part in enumerate(parts):
        mine = [v for v in complete_variants(part) if v not in taken]
        taken.update(mine)
        prompt = {k: part["summary"][f"f1_prompt_k{k}"] for k in ks}
        out["parts"].append({"command": part.get("command"), "wall_seconds":
                             part.get("wall_seconds"), "complete": part.get("complete"),
                             "variants": mine, "prompt_f1": prompt,
                             "nomem_f1": part["summary"].get("f1_nomem")})
        for v in mine:
            out["variants"][v] = part["variants"][v]
            summary.update(_variant_keys(part["summary"], v))
            summary.update(_paired_diffs(part["summary"], v, ks))
            out["rows"] += [{**r, "part": i} for r in part["rows"] if r["mode"] == v]
            for name, conv in part["conversations"].items():
                mc = out["conversations"][name]
                mc["summary"].update(_variant_keys(conv["summary"], v))
                mc["summary"].update(_paired_diffs(conv["summary"], v, ks))
                mc["rows"] += [{**r, "part": i} for r in conv["rows"] if r["mode"] == v]
        out["records"] += [{**r, "part": i} for r in part["records"]
                           if r["mode"] in mine or r["mode"] in BASELINES]
        out["phases"] += [{**p, "part": i} for p in part.get("phases", [])
                          if p.get("mode") in mine or p.get("mode") in BASELINES]
    summary["prompt_f1_spread"] = round(max(
        max(p["prompt_f1"][k] for p in out["parts"]) - min(p["prompt_f1"][k] for p in out["parts"])
        for k in ks), 4)
    planned = list(first.get("planned_variants") or first["variants"])
    out["planned_variants"] = planned
    out["complete"] = all(v in taken for v in planned)
    out["summary"] = summary
    out["wall_seconds"] = round(sum(p.get("wall_seconds") or 0 for p in parts), 1)
    if command:
        out["command"] = command  # each part's own is in ``parts``
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="+", help="benchmarks.locomo results, the first's "
                    "baselines standing for the merged result")
    ap.add_argument("--out", required=True, help="the merged result JSON")
    args = ap.parse_args(argv)
    parts = [json.loads(Path(p).read_text()) for p in args.parts]
    merged = merge(parts, command_line(__spec__.name, argv))
    Path(args.out).write_text(dumps(merged))
    print(json.dumps({"variants": len(merged["variants"]), "complete": merged["complete"],
                      "prompt_f1_spread": merged["summary"]["prompt_f1_spread"],
                      "parts": [len(p["variants"]) for p in merged["parts"]]}))


if __name__ == "__main__":
    sys.exit(main())
