"""PNG plots from the benchmark result files (matplotlib, Agg backend).

- ``ttft-<name>.png`` per ``ttft-*.json``: engine TTFT and query-to-first-token against
  k for the prompt baseline and KV injection from the gpu and host tiers (and vLLM's
  own prefix cache as the floor);
- ``locomo-<name>.png`` per ``locomo-*.json``: pooled token F1 against k, the prompt
  baseline, no memory, and KV injection per window or variant (with many variants: the
  default and those closest to the baseline at their worst k; a mode answered on fewer
  questions is drawn dashed with its paired baseline dotted);
- ``load-<name>.png`` per ``load-*.json``: p99 TTFT (and p50, thin) against the arrival
  rate per mode, with the objective; a rate whose p99 is infinite (a request failed or
  did not finish) is drawn at the top edge;
- ``load-<name>-users.png`` per family of ``load-<name>-u<N>[-variant].json`` (the user
  counts of one run, ``benchmarks.load --user-counts``): p99 TTFT against the arrival
  rate, one colour per user count (and variant), solid for KV injection, dashed for the
  prompt baseline, black dotted for stock vLLM (``peer-<name>.json``,
  ``benchmarks.load --peer``), with the objective; a family is one run's files, so an
  earlier run of the same card and model keeps its own name (``load-h100-llama31-8b-run1-u<N>``);
- ``load-<name>-goodput-users.png`` per such family: goodput against the number of
  users for KV injection, the prompt mode (hollow where a file took it from another
  scenario, ``--prompt-once``, or another run, ``--prompt-goodput``: the legend says
  which) and stock vLLM (its one measurement, a line), a goodput
  that never missed drawn as an upward triangle (a lower bound).

A missing or unreadable result file is skipped with a message, never a crash.

    python -m benchmarks.plots                     # benchmarks/results -> benchmarks/figures
    python -m benchmarks.plots --results R --figures F

"""

from __future__ import annotations

import argparse
import json
import re
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


def _save(plt, fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


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
    return _save(plt, fig, figures / f"{path.stem}.png")


def _locomo_label(mode: str, rows: list[dict], data: dict) -> str:
    if mode == "prompt":
        return "prompt baseline (facts as text)"
    if mode == "nomem":
        return "no memory"
    label = f"KV inject, w={rows[0]['window']}" if rows[0].get("window") is not None \
        else f"KV {mode}"
    return label + (" (default)" if mode == data.get("default_variant") else "")


def _locomo_modes(by_mode: dict[str, list[dict]], data: dict, most: int = 7) -> list[str]:
    """Every mode when few; else the baseline, no memory, the default and the variants
    whose worst-k difference to the baseline is smallest."""
    modes = sorted(by_mode, key=lambda m: (m != "prompt", m != "nomem", m))
    if len(modes) <= most:
        return modes
    base = {r["k"]: r["f1"] for r in by_mode.get("prompt", [])}

    def worst(m: str) -> float:
        return min((r["f1"] - base.get(r["k"], 0.0) for r in by_mode[m]), default=-1.0)
    kv = sorted((m for m in modes if m not in ("prompt", "nomem")), key=worst, reverse=True)
    keep = [m for m in ("prompt", "nomem", data.get("default_variant")) if m in by_mode]
    return keep + [m for m in kv if m not in keep][: most - len(keep)]


def plot_locomo(path: Path, figures: Path) -> Path | None:
    data = _load(path)
    if data is None:
        return None
    plt = _plt()
    by_mode: dict[str, list[dict]] = {}
    for r in data["rows"]:
        if r.get("scope", "pooled") == "pooled":
            by_mode.setdefault(r["mode"], []).append(r)
    total = max((r.get("questions", 0) for rows in by_mode.values() for r in rows), default=0)
    ks = sorted({r["k"] for rows in by_mode.values() for r in rows if r["k"]})
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for mode in _locomo_modes(by_mode, data):
        rows = sorted(by_mode[mode], key=lambda r: r["k"])
        label = _locomo_label(mode, rows, data)
        if mode == "nomem":
            ax.axhline(rows[0]["f1"], color="grey", linestyle=":", label=label)
            continue
        n = rows[0].get("questions", total)
        partial = n < total
        if partial:
            label += f" ({n} questions)"
        line = ax.plot([r["k"] for r in rows], [r["f1"] for r in rows],
                       "o--" if partial else "o-", label=label,
                       linewidth=2.4 if mode in ("prompt", data.get("default_variant")) else 1.4)
        if partial and all(r.get("f1_prompt_same_questions") is not None for r in rows):
            ax.plot([r["k"] for r in rows], [r["f1_prompt_same_questions"] for r in rows], ":",
                    color=line[0].get_color(), alpha=0.7,
                    label=f"prompt baseline on those {n}")
    ax.set_xscale("log")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.set_xlabel("k (facts retrieved)")
    ax.set_ylabel("LoCoMo token F1 (categories 1-4)")
    convs = ", ".join(data.get("conversations", {})) or data.get("conversation", path.stem)
    ax.set_title(f"{convs}: {total} questions, {data.get('model', '')}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, figures / f"{path.stem}.png")


LOAD_STYLE = {"prompt": ("prompt baseline", "o"), "kv": ("KV injection", "s")}
BOUND = {"a lower bound": ">= ", "an upper bound": "<= "}  # a ratio's *_is, as a prefix


def plot_load(path: Path, figures: Path) -> Path | None:
    data = _load(path)
    if data is None:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    objective = data.get("objective_ms")
    top = max([r["ttft_p99_ms"] or 0 for r in data["rows"]] + [objective or 0]) * 1.15
    for mode, (label, marker) in LOAD_STYLE.items():
        rows = sorted((r for r in data["rows"] if r["mode"] == mode), key=lambda r: r["rate"])
        if not rows:
            continue
        rates = [r["rate"] for r in rows]
        p99 = [r["ttft_p99_ms"] if r["ttft_p99_ms"] is not None else top for r in rows]
        line, = ax.plot(rates, p99, marker + "-", label=f"{label}, p99")
        p50 = [r["ttft_p50_ms"] if r["ttft_p50_ms"] is not None else top for r in rows]
        ax.plot(rates, p50, marker + ":", color=line.get_color(), lw=0.8, ms=3,
                label=f"{label}, p50")
    if objective:
        ax.axhline(objective, color="grey", ls="--", lw=1, label=f"objective {objective:g} ms")
    summary = data.get("summary") or {}
    ratio, above = summary.get("goodput_vs_prompt"), summary.get("goodput_vs_prompt_above")
    rates = sorted({r["rate"] for r in data["rows"]})
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.minorticks_off()
    ax.set_xlabel("arrival rate (requests/s, Poisson)")
    ax.set_ylabel("TTFT as the client sees it (ms)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    title = f"{path.stem}: {data.get('users')} users, k={data.get('top_k')}"
    if ratio is not None:
        bound = BOUND.get(summary.get("goodput_vs_prompt_is"), "")
        title += f", goodput vs prompt {bound}{ratio:g}"
    elif above is not None:
        title += f", goodput vs prompt > {above:g}"
    ax.set_title(title, fontsize=9)
    return _save(plt, fig, figures / f"{path.stem}.png")


SCENARIO_FILE = re.compile(r"^(?P<family>load-.+)-u(?P<users>\d+)(?P<variant>-[\w.-]+)?$")


def _scenarios(paths: list[Path]) -> list[tuple[int, str, dict]]:
    """(users, variant, result) of each readable scenario file, by users and variant."""
    series = []
    for path in paths:
        data = _load(path)
        m = SCENARIO_FILE.match(path.stem)
        if data is not None and m:
            series.append((int(m["users"]), m["variant"] or "", data))
    return sorted(series, key=lambda s: (s[0], s[1]))


def peer_of(family: str, results: Path, paths: list[Path] = ()) -> dict | None:
    """Stock vLLM's result beside a family's files (``peer-<name>.json`` for
    ``load-<name>``), else the one its files were run against (``--peer-result``: the
    file named in their ``peer_source``, when it is among ``results``), or None."""
    path = results / f"peer-{family.removeprefix('load-')}.json"
    if path.is_file():
        return _load(path)
    for p in paths:
        source = str(_load(p).get("peer_source") or "").split(":", 1)[0]
        named = results / Path(source).name if source.endswith(".json") else None
        if named is not None and named.is_file():
            return _load(named)
    return None


def goodput_series(series: list[tuple[int, str, dict]], peer: dict | None) -> dict:
    """What the goodput-against-users figure draws: per user count (files without a
    variant) KV's goodput and whether it is a lower bound, the prompt mode's and whether
    that file measured it itself; stock vLLM's goodput and whether it is a lower bound."""
    base = [(u, d) for u, v, d in series if not v]
    summ = [d.get("summary") or {} for _, d in base]
    peer_summary = (peer or {}).get("summary") or {}
    return {"users": [u for u, _ in base],
            "kv": [s.get("goodput_kv_rps") for s in summ],
            "kv_lower_bound": [bool((s.get("kv") or {}).get("lower_bound")) for s in summ],
            "prompt": [s.get("goodput_prompt_rps") for s in summ],
            "prompt_measured_here": [not (s.get("prompt") or {}).get("given") for s in summ],
            "prompt_from_another_run": ["another run" in str((s.get("prompt") or {}).get("given"))
                                        for s in summ],
            "peer": peer_summary.get("goodput_peer_rps"),
            "peer_lower_bound": bool((peer_summary.get("peer") or {}).get("lower_bound"))}


def plot_goodput_users(family: str, paths: list[Path], figures: Path,
                       peer: dict | None) -> Path | None:
    """Goodput against the number of users: KV injection, our prompt mode, stock vLLM."""
    g = goodput_series(_scenarios(paths), peer)
    if not g["users"]:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    users = g["users"]
    line, = ax.plot(users, [x or 0 for x in g["kv"]], "-", lw=1.8, label="KV injection")
    for u, x, low in zip(users, g["kv"], g["kv_lower_bound"]):
        ax.plot([u], [x or 0], "^" if low else "s", color=line.get_color(), ms=7)
    hollow = ("; hollow: measured in another run" if any(g["prompt_from_another_run"])
              else "; hollow: another scenario's" if not all(g["prompt_measured_here"]) else "")
    line, = ax.plot(users, [x or 0 for x in g["prompt"]], "--", lw=1.2,
                    label=f"our prompt mode (facts as text{hollow})")
    for u, x, here in zip(users, g["prompt"], g["prompt_measured_here"]):
        ax.plot([u], [x or 0], "o", color=line.get_color(), ms=6,
                markerfacecolor=line.get_color() if here else "none")
    if g["peer"] is not None:
        ax.axhline(g["peer"], color="black", ls=":", lw=1.4,
                   label=f"stock vLLM (vllm serve): {'>= ' * g['peer_lower_bound']}"
                         f"{g['peer']:g} rps")
    ax.set_xscale("log")
    ax.set_xticks(users, [f"{u:,}" for u in users])
    ax.minorticks_off()
    ax.set_xlabel("users (Zipf popularity; those the tiers do not hold start in storage)")
    ax.set_ylabel("goodput (requests/s at p99 TTFT within the objective)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    d = _scenarios(paths)[0][2]
    ax.set_title(f"{family}: {d.get('model', '')}, k={d.get('top_k')}, objective p99 <= "
                 f"{d.get('objective_ms'):g} ms (triangle: never missed)", fontsize=8)
    return _save(plt, fig, figures / f"{family}-goodput-users.png")


def plot_load_users(family: str, paths: list[Path], figures: Path,
                    peer: dict | None = None) -> Path | None:
    """p99 TTFT against the arrival rate per mode and user count (one run's files), and
    stock vLLM's (``peer``)."""
    series = _scenarios(paths)
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.4))
    objective = series[0][2].get("objective_ms")
    peer_rows = sorted((peer or {}).get("rows") or [], key=lambda r: r["rate"])
    top = max([r["ttft_p99_ms"] or 0 for _, _, d in series for r in d["rows"]]
              + [r["ttft_p99_ms"] or 0 for r in peer_rows] + [objective or 0]) * 1.15
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (users, variant, data) in enumerate(series):
        summary = data.get("summary") or {}
        versus = next(((summary[f"goodput_vs_{b}"], what, BOUND.get(
            summary.get(f"goodput_vs_{b}_is"), "")) for b, what in (
            ("peer", "stock vLLM"), ("prompt", "prompt")) if summary.get(f"goodput_vs_{b}")),
            None)
        for mode, (label, marker) in LOAD_STYLE.items():
            rows = sorted((r for r in data["rows"] if r["mode"] == mode), key=lambda r: r["rate"])
            if not rows:
                continue
            name = f"{users} users{variant.replace('-', ' ')}, {label}"
            if mode == "kv" and versus is not None:
                name += f" (goodput {versus[2]}x{versus[0]:g} vs {versus[1]})"
            ax.plot([r["rate"] for r in rows],
                    [r["ttft_p99_ms"] if r["ttft_p99_ms"] is not None else top for r in rows],
                    marker + ("-" if mode == "kv" else "--"), color=colours[i % len(colours)],
                    label=name, lw=1.6 if mode == "kv" else 1.0)
    if peer_rows:
        ax.plot([r["rate"] for r in peer_rows],
                [r["ttft_p99_ms"] if r["ttft_p99_ms"] is not None else top for r in peer_rows],
                "x:", color="black", lw=1.4, label=f"stock vLLM, {peer.get('users')} users' prompts")
    if objective:
        ax.axhline(objective, color="grey", ls=":", lw=1, label=f"objective {objective:g} ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arrival rate (requests/s, Poisson)")
    ax.set_ylabel("p99 TTFT as the client sees it (ms)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    d = series[0][2]
    ax.set_title(f"{family}: {d.get('model', '')}, k={d.get('top_k')}, "
                 f"{d.get('requests_per_step')} requests per step", fontsize=9)
    return _save(plt, fig, figures / f"{family}-users.png")


def make_all(results: Path, figures: Path) -> list[Path]:
    """Every plot whose result file exists; returns the files written."""
    figures.mkdir(parents=True, exist_ok=True)
    written = []
    for prefix, fn in (("ttft-", plot_ttft), ("locomo-", plot_locomo), ("load-", plot_load)):
        paths = sorted(results.glob(f"{prefix}*.json"))
        if not paths:
            print(f"no {prefix}*.json under {results}: skipped", file=sys.stderr)
        for path in paths:
            out = fn(path, figures)
            if out is not None:
                print(f"wrote {out}")
                written.append(out)
    families: dict[str, list[Path]] = {}
    for path in sorted(results.glob("load-*.json")):
        m = SCENARIO_FILE.match(path.stem)
        if m:
            families.setdefault(m["family"], []).append(path)
    for family, paths in families.items():
        peer = peer_of(family, results, paths)
        for out in (plot_load_users(family, paths, figures, peer),
                    plot_goodput_users(family, paths, figures, peer)):
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
