"""Pick the default KV variant from a ``benchmarks/locomo.py`` result, by a fixed rule.

The rule: among the variants that keep the limiting case exact (``key_temperature`` 1:
stored keys are the model's own) and whose text tail is at most ``--max-tail`` facts
(the serving cost: each tail fact is prefilled per request), the one whose pooled F1
minus the prompt baseline's is largest at its worst k; ties go to the larger mean
difference, then the shorter tail and the smaller window. ``--any-temperature`` drops
the exactness condition.

    python benchmarks/locomo_select.py benchmarks/results/locomo-h200-variants.json
    python benchmarks/locomo_select.py RESULT --apply   # record the pick in RESULT

Prints ``name``, the variant's encoder fields (``field=value,...``) and its score;
``--fields`` the fields without the window (what ``locomo.py --base`` takes), ``--tail``
its text tail. ``--apply`` writes the pick into the result (``default_variant``,
``f1_default_minus_prompt_min``, ``continues_default_minus_prompt``) with this command.

Callers: ``benchmarks/locomo.py --select-default``, ``benchmarks/gpu/h200.sh``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import command_line  # noqa: E402
from benchmarks.locomo_report import dumps  # noqa: E402


def select(result: dict, max_tail: int = 5, exact: bool = True) -> tuple[str, dict, dict]:
    """-> (variant name, its encoder fields, its score)."""
    s, ks = result["summary"], result["ks"]
    defaults = result.get("encoder_defaults", {})
    scored = []
    for name, fields in result["variants"].items():
        cfg = {**defaults, **fields}
        if cfg.get("text_tail", 0) > max_tail:
            continue
        if exact and float(cfg.get("key_temperature", 1.0)) != 1.0:
            continue
        f1 = [s.get(f"f1_{name}_k{k}") for k in ks]
        if any(x is None for x in f1):
            continue
        diffs = [x - s[f"f1_prompt_k{k}"] for x, k in zip(f1, ks)]
        score = {"min_diff": round(min(diffs), 4),
                 "mean_diff": round(sum(diffs) / len(diffs), 4)}
        scored.append(((-min(diffs), -sum(diffs), cfg.get("text_tail", 0),
                        cfg.get("window", 0)), name, fields, score))
    if not scored:
        raise SystemExit("no complete variant meets the rule in this result")
    _, name, fields, score = min(scored)
    return name, fields, score


def apply(result: dict, name: str, rule: str) -> dict:
    """Record ``name`` as the result's default: the pooled summary's comparison keys."""
    s, ks = result["summary"], result["ks"]
    diffs = [s[f"f1_{name}_k{k}"] - s[f"f1_prompt_k{k}"] for k in ks]
    s["f1_default_minus_prompt_min"] = round(min(diffs), 4)
    s["continues_default_minus_prompt"] = round(
        s[f"continues_{name}"] - s["continues_prompt"], 4)
    if result.get("default_variant") and result["default_variant"] != name:
        result.setdefault("earlier_defaults", []).append(
            {k: result.get(k) for k in ("default_variant", "default_rule", "default_score")})
    result["default_variant"] = name
    result["default_rule"] = rule
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a locomo.py result JSON")
    ap.add_argument("--max-tail", type=int, default=5,
                    help="longest text tail allowed (facts prefilled per request)")
    ap.add_argument("--any-temperature", action="store_true",
                    help="also variants whose stored keys are scaled (not exact)")
    ap.add_argument("--fields", action="store_true",
                    help="print only the fields without the window (for --base)")
    ap.add_argument("--tail", action="store_true", help="print only the text tail")
    ap.add_argument("--apply", action="store_true", help="record the pick in the result file")
    args = ap.parse_args(argv)
    path = Path(args.result)
    result = json.loads(path.read_text())
    name, fields, score = select(result, args.max_tail, not args.any_temperature)
    if args.apply:
        apply(result, name, command_line(argv))
        result["default_score"] = score
        path.write_text(dumps(result))
    if args.tail:
        print({**result.get("encoder_defaults", {}), **fields}.get("text_tail", 0))
    elif args.fields:
        print(",".join(f"{k}={v}" for k, v in fields.items() if k != "window"))
    else:
        print(name, ",".join(f"{k}={v}" for k, v in fields.items()), json.dumps(score))


if __name__ == "__main__":
    sys.exit(main())
