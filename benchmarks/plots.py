"""PNG plots from the benchmark result files (matplotlib, Agg backend).

- ``ttft-<name>.png`` per ``ttft-*.json``: engine TTFT and query-to-first-token against
  k for the prompt baseline and KV injection from the gpu and host tiers (and vLLM's
  own prefix cache as the floor);
- ``locomo-<name>.png`` per ``locomo-*.json``: token F1 against k, the prompt baseline
  and KV injection per window w (a window answered on fewer questions is drawn dashed
  with its paired baseline dotted).

A missing or unreadable result file is skipped with a message, never a crash.

    python benchmarks/plots.py                     # benchmarks/results -> benchmarks/figures
    python benchmarks/plots.py --results R --figures F

Callers: this CLI; ``tests/test_bench_plots.py`` (synthetic result files).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

TTFT_SERIES = [  # (label, ttft key, q2ft key, style)
    ("prompt baseline", "prompt_ttft_ms", "prompt_q2ft_ms", "o-"),
    ("KV inject (gpu tier)", "inject_gpu_ttft_ms", "inject_gpu_q2ft_ms", "s-"),
    ("KV inject (host tier)", "inject_host_ttft_ms", "inject_host_q2ft_ms", "^-"),
    ("prefix-cache hit (floor)", "cached_ttft_ms", None, "x:"),
]


def _load(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"skipping {path}: {exc}", file=sys.stderr)
        return None
    if not isinstance(data, dict) or not data.get("rows"):
        print(f"skipping {path}: no rows", file=sys.stderr)
        return None
    return data


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft(path: Path, figures: Path) -> Path | None:
    data = _load(path)
    if data is None:
        return None
    plt = _plt()
    rows = sorted(data["rows"], key=lambda r: r["k"])
    ks = [r["k"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, which, title in ((axes[0], 1, "engine TTFT"), (axes[1], 2, "query to first token")):
        for label, ttft_key, q2ft_key, style in TTFT_SERIES:
            key = ttft_key if which == 1 else q2ft_key
            if key and all(key in r for r in rows):
                ax.plot(ks, [r[key] for r in rows], style, label=label)
        ax.set_xlabel("k (facts retrieved)")
        ax.set_title(title)
        ax.set_xscale("log")
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("milliseconds (median)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{path.stem}: {data.get('model', '')} — {data.get('device', '')}"[:110],
                 fontsize=9)
    fig.tight_layout()
    out = figures / f"{path.stem}.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_locomo(path: Path, figures: Path) -> Path | None:
    data = _load(path)
    if data is None:
        return None
    plt = _plt()
    by_mode: dict[str, list[dict]] = {}
    for r in data["rows"]:
        by_mode.setdefault(r["mode"], []).append(r)
    total = max((r.get("questions", 0) for r in data["rows"]), default=0)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for mode, rows in sorted(by_mode.items(), key=lambda kv: (kv[0] != "prompt", kv[0])):
        rows = sorted(rows, key=lambda r: r["k"])
        ks = [r["k"] for r in rows]
        n = rows[0].get("questions", total)
        partial = n < total
        label = "prompt baseline" if mode == "prompt" else f"KV inject, w={rows[0]['window']}"
        if partial:
            label += f" ({n} questions)"
        line = ax.plot(ks, [r["f1"] for r in rows], "o--" if partial else "o-", label=label,
                       linewidth=2.2 if mode == "prompt" else 1.5)
        if partial and all(r.get("f1_prompt_same_questions") is not None for r in rows):
            ax.plot(ks, [r["f1_prompt_same_questions"] for r in rows], ":",
                    color=line[0].get_color(), alpha=0.7,
                    label=f"prompt baseline on those {n}")
    ks = sorted({r["k"] for r in data["rows"]})
    ax.set_xscale("log")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k (facts retrieved)")
    ax.set_ylabel("LoCoMo token F1 (categories 1-4)")
    ax.set_title(f"{data.get('conversation', path.stem)}: {total} questions, "
                 f"{data.get('model', '')}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = figures / f"{path.stem}.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def make_all(results: Path, figures: Path) -> list[Path]:
    """Every plot whose result file exists; returns the files written."""
    figures.mkdir(parents=True, exist_ok=True)
    written = []
    for prefix, fn in (("ttft-", plot_ttft), ("locomo-", plot_locomo)):
        paths = sorted(results.glob(f"{prefix}*.json"))
        if not paths:
            print(f"no {prefix}*.json under {results}: skipped", file=sys.stderr)
        for path in paths:
            out = fn(path, figures)
            if out is not None:
                print(f"wrote {out}")
                written.append(out)
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=HERE / "results")
    ap.add_argument("--figures", type=Path, default=HERE / "figures")
    args = ap.parse_args(argv)
    return make_all(args.results, args.figures)


if __name__ == "__main__":
    main()
