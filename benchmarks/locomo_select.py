"""Pick the default KV variant from a ``benchmarks.locomo`` result, by a fixed rule.

Two rules, both fixed before the measurements they were applied to:

- ``exact`` (issue 18): among the variants that keep the limiting case exact
  (``key_temperature`` 1, no ``key_calibration``: stored keys are the model's own) and
  whose text tail is at most ``--max-tail`` facts (the serving cost: each tail fact is
  prefilled per request), the one whose pooled F1 minus the prompt baseline's is largest
  at its worst k; ties go to the larger mean difference, then the shorter tail and the
  smaller window. ``--any-temperature`` drops the exactness condition.
- ``injection`` (issue 27): a variant qualifies when it injects at least
  :data:`SHARE_MIN` of the retrieved facts' tokens at every k >= :data:`SHARE_FROM_K`
  (pooled ``injected_share_<variant>_k<k>``), its pooled F1 is at least the prompt
  baseline's minus :data:`F1_MARGIN` at every k of :data:`RULE_KS`, and its continuation
  share is at most the baseline's plus :data:`CONTINUES_MARGIN`; of those, the one whose
  F1 minus the baseline's is largest at its worst k (ties: larger mean difference, larger
  smallest share, shorter tail, smaller window). Calibrated keys are allowed (the fp32
  limiting case is exact with calibration off). If none qualifies (issue 27's item 5),
  the pick is, among the variants that meet the two accuracy bounds, the one injecting
  the most (largest smallest share; ties: worst-k difference), and the result says
  ``rule_met: false``; if none meets them either, the largest worst-k difference.

    python -m benchmarks.locomo_select benchmarks/results/locomo-h200-variants.json
    python -m benchmarks.locomo_select RESULT --rule injection --apply  # record the pick

Prints ``name``, the variant's encoder fields (``field=value,...``) and its score;
``--fields`` the fields without the window (what ``benchmarks.locomo --base`` takes),
``--tail`` its text tail, ``--layout`` its layout as ``benchmarks.ttft`` flags. ``--apply`` writes
the pick into the result (``default_variant``, ``default_rule``, ``default_score``, and in
the summary ``f1_default_minus_prompt_min``, ``continues_default_minus_prompt`` and, where
the result has shares, ``injected_share_min_k10``) with this command.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.lib.locomo_report import SHARE_FROM_K, dumps
from benchmarks.lib.results import command_line

# the injection rule (issue 27), fixed before its measurement
RULE_KS = (5, 10, 20, 50)
SHARE_MIN = 0.9
F1_MARGIN = 0.01
CONTINUES_MARGIN = 0.02
LAYOUT_FLAGS = {"memory_order": "--memory-order", "text_tail": "--text-tail",
                "tail_max_k": "--tail-max-k"}


def _config(result: dict, fields: dict) -> dict:
    return {**{"text_tail": 0, "window": 0, "tail_max_k": 0, "key_temperature": 1.0,
               "key_calibration": "none"}, **result.get("encoder_defaults", {}), **fields}


def _diffs(result: dict, name: str, ks) -> list[float] | None:
    s = result["summary"]
    f1 = [s.get(f"f1_{name}_k{k}") for k in ks]
    if any(x is None for x in f1):
        return None
    return [_diff(s, name, k) for k in ks]


def _diff(s: dict, name: str, k: int) -> float:
    """Pooled F1 of ``name`` minus the prompt baseline's at ``k``: against the baseline
    of the part that answered it where the result was merged (benchmarks.locomo_merge)."""
    paired = s.get(f"f1_{name}_minus_prompt_k{k}")
    return paired if paired is not None else round(s[f"f1_{name}_k{k}"] - s[f"f1_prompt_k{k}"], 4)


def select(result: dict, max_tail: int = 5, exact: bool = True) -> tuple[str, dict, dict]:
    """The ``exact`` rule -> (variant name, its encoder fields, its score)."""
    scored = []
    for name, fields in result["variants"].items():
        cfg = _config(result, fields)
        if cfg["text_tail"] > max_tail:
            continue
        if exact and (float(cfg["key_temperature"]) != 1.0 or cfg["key_calibration"] != "none"):
            continue
        diffs = _diffs(result, name, result["ks"])
        if diffs is None:
            continue
        score = {"min_diff": round(min(diffs), 4),
                 "mean_diff": round(sum(diffs) / len(diffs), 4)}
        scored.append(((-min(diffs), -sum(diffs), cfg["text_tail"], cfg["window"]),
                       name, fields, score))
    if not scored:
        raise SystemExit("no complete variant meets the rule in this result")
    _, name, fields, score = min(scored)
    return name, fields, score


def share_min(result: dict, name: str) -> float | None:
    """The variant's smallest pooled injected share over k >= :data:`SHARE_FROM_K`."""
    shares = [result["summary"].get(f"injected_share_{name}_k{k}") for k in result["ks"]
              if k >= SHARE_FROM_K]
    return None if not shares or None in shares else min(shares)


def select_injection(result: dict) -> tuple[str, dict, dict]:
    """The ``injection`` rule -> (variant name, its encoder fields, its score)."""
    s = result["summary"]
    missing = [k for k in RULE_KS if k not in result["ks"]]
    if missing:
        raise SystemExit(f"the injection rule needs k = {list(RULE_KS)}; "
                         f"the result lacks {missing}")
    rows = []
    for name, fields in result["variants"].items():
        cfg = _config(result, fields)
        diffs, share = _diffs(result, name, RULE_KS), share_min(result, name)
        if diffs is None or share is None or f"continues_{name}" not in s:
            continue
        cont = round(s[f"continues_{name}"] - s["continues_prompt"], 4)
        meets = {"share": share >= SHARE_MIN, "f1": min(diffs) >= -F1_MARGIN,
                 "continues": cont <= CONTINUES_MARGIN}
        score = {"min_diff": min(diffs), "mean_diff": round(sum(diffs) / len(diffs), 4),
                 "injected_share_min": share, "continues_minus_prompt": cont, "meets": meets}
        rows.append((name, fields, score, cfg))
    if not rows:
        raise SystemExit("no complete variant with injected shares in this result")

    def best(cands, key):
        name, fields, score, _ = min(cands, key=key)
        return name, fields, score

    def by_diff(r):
        return (-r[2]["min_diff"], -r[2]["mean_diff"], -r[2]["injected_share_min"],
                r[3]["text_tail"], r[3]["window"])

    full = [r for r in rows if all(r[2]["meets"].values())]
    if full:
        name, fields, score = best(full, by_diff)
        return name, fields, {**score, "rule_met": True}
    accurate = [r for r in rows if r[2]["meets"]["f1"] and r[2]["meets"]["continues"]]
    if accurate:
        name, fields, score = best(accurate, lambda r: (-r[2]["injected_share_min"],) + by_diff(r))
        return name, fields, {**score, "rule_met": False, "fallback": "most injected accurate"}
    name, fields, score = best(rows, by_diff)
    return name, fields, {**score, "rule_met": False, "fallback": "no variant is accurate"}


def apply(result: dict, name: str, rule: str) -> dict:
    """Record ``name`` as the result's default: the pooled summary's comparison keys."""
    s, ks = result["summary"], result["ks"]
    diffs = [_diff(s, name, k) for k in ks]
    s["f1_default_minus_prompt_min"] = round(min(diffs), 4)
    s["continues_default_minus_prompt"] = round(
        s[f"continues_{name}"] - s["continues_prompt"], 4)
    share = share_min(result, name)
    if share is not None:
        s["injected_share_min_k10"] = share
    if result.get("default_variant") and result["default_variant"] != name:
        result.setdefault("earlier_defaults", []).append(
            {k: result.get(k) for k in ("default_variant", "default_rule", "default_score")})
    result["default_variant"] = name
    result["default_rule"] = rule
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a benchmarks.locomo result JSON")
    ap.add_argument("--rule", choices=["exact", "injection"], default="exact",
                    help="which fixed rule (see the module docstring)")
    ap.add_argument("--max-tail", type=int, default=5,
                    help="exact rule: longest text tail allowed (facts prefilled per request)")
    ap.add_argument("--any-temperature", action="store_true",
                    help="exact rule: also variants whose stored keys are scaled (not exact)")
    ap.add_argument("--fields", action="store_true",
                    help="print only the fields without the window (for --base)")
    ap.add_argument("--tail", action="store_true", help="print only the text tail")
    ap.add_argument("--layout", action="store_true",
                    help="print only the layout, as benchmarks.ttft flags")
    ap.add_argument("--apply", action="store_true", help="record the pick in the result file")
    args = ap.parse_args(argv)
    path = Path(args.result)
    result = json.loads(path.read_text())
    if args.rule == "injection":
        name, fields, score = select_injection(result)
    else:
        name, fields, score = select(result, args.max_tail, not args.any_temperature)
    if args.apply:
        apply(result, name, command_line(__spec__.name, argv))
        result["default_score"] = score
        path.write_text(dumps(result))
    cfg = _config(result, fields)
    if args.tail:
        print(cfg["text_tail"])
    elif args.layout:
        print(" ".join(f"{flag} {cfg[f]}" for f, flag in LAYOUT_FLAGS.items()))
    elif args.fields:
        print(",".join(f"{k}={v}" for k, v in fields.items() if k != "window"))
    else:
        print(name, ",".join(f"{k}={v}" for k, v in fields.items()), json.dumps(score))


if __name__ == "__main__":
    sys.exit(main())
