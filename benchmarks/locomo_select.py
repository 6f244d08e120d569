"""Pick the default KV variant from a ``benchmarks/locomo.py`` result, by a fixed rule.

The rule (decided before the measurement): among the variants whose text tail is at
most ``--max-tail`` facts (the serving cost), the one whose pooled F1 minus the prompt
baseline's is largest at its worst k; ties go to the larger mean difference, then the
shorter tail and the smaller window. Prints ``name`` and the variant's encoder fields
as ``field=value,...`` (what ``locomo.py --base`` takes, window included).

    python benchmarks/locomo_select.py benchmarks/results/locomo-h200-variants.json

Callers: ``benchmarks/gpu/h200.sh`` (the grid phase runs the winner's family).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def select(result: dict, max_tail: int = 3) -> tuple[str, dict, dict]:
    """-> (variant name, its encoder fields, its score)."""
    s, ks = result["summary"], result["ks"]
    defaults = result.get("encoder_defaults", {})
    scored = []
    for name, fields in result["variants"].items():
        cfg = {**defaults, **fields}
        if cfg.get("text_tail", 0) > max_tail:
            continue
        diffs = [s.get(f"f1_{name}_k{k}") for k in ks]
        if any(d is None for d in diffs):
            continue
        diffs = [d - s[f"f1_prompt_k{k}"] for d, k in zip(diffs, ks)]
        score = {"min_diff": round(min(diffs), 4), "mean_diff": round(sum(diffs) / len(diffs), 4)}
        scored.append(((-min(diffs), -sum(diffs), cfg.get("text_tail", 0),
                        cfg.get("window", 0)), name, fields, score))
    if not scored:
        raise SystemExit("no complete variant within the tail limit in this result")
    _, name, fields, score = min(scored)
    return name, fields, score


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a locomo.py result JSON")
    ap.add_argument("--max-tail", type=int, default=3, help="longest text tail allowed")
    ap.add_argument("--fields", action="store_true",
                    help="print only the fields without the window (for --base)")
    ap.add_argument("--tail", action="store_true", help="print only the text tail")
    args = ap.parse_args(argv)
    result = json.loads(Path(args.result).read_text())
    name, fields, score = select(result, args.max_tail)
    if args.tail:
        print({**result.get("encoder_defaults", {}), **fields}.get("text_tail", 0))
    elif args.fields:
        print(",".join(f"{k}={v}" for k, v in fields.items() if k != "window"))
    else:
        print(name, ",".join(f"{k}={v}" for k, v in fields.items()), json.dumps(score))


if __name__ == "__main__":
    sys.exit(main())
