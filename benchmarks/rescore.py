"""One peer result from several peer runs of one machine, and load results scored on it.

The load benchmark's peer run (``benchmarks.load --peer``: stock ``vllm serve``) rises
through its rates until the first miss. When its lowest rate already misses, its goodput
is only known to be below that rate, every load result of the same run reports
``goodput_vs_peer`` None, and the peer is run again on the same machine at lower rates.
This merges those peer runs' steps into one peer result (their goodput by the same rule:
the highest rate met below the first missed; runs under other settings, another device
or with the same rate twice are refused) and recomputes each load result's summary from
its own rows against it (:func:`benchmarks.lib.load.goodput.summarize`, as the run does).
Nothing measured changes: the rows are copied as they are; each output records the
command and the files it came from (``merged_from`` / ``rescored``).

    python -m benchmarks.rescore --peers peer-a.json peer-b.json --peer-out peer.json \\
        --out-dir benchmarks/results load-u200.json load-u2000.json

Callers: this CLI; ``tests/benchmarks/test_rescore.py``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

from benchmarks.lib.load.goodput import summarize
from benchmarks.lib.load.setup import PEER_MUST_MATCH

SAME = (*PEER_MUST_MATCH, "device", "memory_dtype")


def checked(name: str, result: object) -> dict:
    """``result`` if it is a load result (a JSON object with a list of rows), else
    ValueError naming ``name``."""
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list) \
            or not all(isinstance(r, dict) for r in result["rows"]):
        raise ValueError(f"{name} is not a load result (no list of rows)")
    return result


def mismatches(a: dict, b: dict, keys: tuple[str, ...]) -> list[str]:
    """``key a-value vs b-value`` for each of ``keys`` the two results differ in."""
    return [f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def merge_peers(peers: list[tuple[str, dict]], command: str) -> dict:
    """One peer result from ``(name, result)`` peer runs of one device and settings: the
    first run's fields, every run's rows (by rate) and the summary of them all."""
    if not peers:
        raise ValueError("no peer results to merge")
    first_name, first = peers[0]
    rows: list[dict] = []
    for name, p in peers:
        checked(name, p)
        if "peer" not in (p.get("modes") or ()):
            raise ValueError(f"{name} is not a peer run (modes {p.get('modes')})")
        differ = mismatches(p, first, SAME)
        if (p.get("user_counts") or [])[:1] != (first.get("user_counts") or [])[:1]:
            differ.append("user_counts")  # the peer runs on the first count only
        if differ:
            raise ValueError(f"{name} ran under other settings than {first_name}: "
                             + ", ".join(differ))
        rows += [r for r in p["rows"] if r.get("mode") == "peer"]
    if not rows:
        raise ValueError("no peer steps in these runs")
    rates = [r["rate"] for r in rows]
    if len(set(rates)) != len(rates):
        raise ValueError(f"a rate ran twice in these peer runs ({sorted(rates)}): "
                         "which one counts is not for this tool to pick")
    rows.sort(key=lambda r: r["rate"])
    args = SimpleNamespace(modes=("peer",), objective_ms=first["objective_ms"])
    return {**first, "command": command, "rates": sorted(rates), "rows": rows,
            "summary": summarize(rows, args),
            "merged_from": [{"file": name, "command": p.get("command")} for name, p in peers]}


def rescore(load: dict, peer: dict, peer_name: str, command: str) -> dict:
    """``load`` (one user count's result) with its summary recomputed from its rows
    against ``peer`` (a peer result, e.g. :func:`merge_peers`'); the prompt baseline as
    the run had it."""
    differ = mismatches(peer, checked("the load result", load), (*PEER_MUST_MATCH, "device"))
    if differ:
        raise ValueError(f"the peer {peer_name} ran under other settings: " + ", ".join(differ))
    own = peer["summary"]["peer"]
    source = f"{peer_name}: {peer.get('command', '')}"
    args = SimpleNamespace(modes=tuple(load["modes"]), objective_ms=load["objective_ms"],
                           peer_goodput=own["goodput_rps"], peer_source=source,
                           peer_first_miss=own.get("first_miss_rps"),
                           peer_lower_bound=bool(own.get("lower_bound")))
    before = load.get("summary") or {}
    prompt = before.get("prompt") or {}
    given = prompt.get("given")
    prompt_source = given.removeprefix("measured in ") if isinstance(given, str) else None
    summary = summarize(load["rows"], args,
                        prompt["goodput_rps"] if given else None,
                        prompt_source or "another run (--prompt-goodput)")
    return {**load, "peer_goodput": own["goodput_rps"], "peer_source": source,
            "summary": summary,
            "rescored": {"command": command, "peer": peer_name,
                         "peer_goodput_before": before.get("goodput_peer_rps"),
                         "goodput_vs_peer_before": before.get("goodput_vs_peer")}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.rescore",
        description="Merge peer runs of one machine into one peer result and score load "
                    "results against it (their rows unchanged).")
    ap.add_argument("--peers", nargs="+", required=True, type=Path,
                    help="peer results (benchmarks.load --peer) of one device and settings")
    ap.add_argument("--peer-out", required=True, type=Path, help="the merged peer result")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="where the rescored load results go, under their own names "
                         "(required with load results; never the inputs' folder)")
    ap.add_argument("loads", nargs="*", type=Path, help="load results to score")
    args = ap.parse_args(argv)
    if args.loads and args.out_dir is None:
        ap.error("load results need --out-dir")
    for f in args.loads:
        if args.out_dir is not None and (args.out_dir / f.name).resolve() == f.resolve():
            ap.error(f"{f} would be overwritten: give another --out-dir")
    command = "python -m benchmarks.rescore " + shlex.join(sys.argv[1:] if argv is None
                                                           else argv)
    try:
        peers = [(p.name, json.loads(p.read_text())) for p in args.peers]
        peer = merge_peers(peers, command)
        loads = [(f.name, rescore(json.loads(f.read_text()), peer, args.peer_out.name,
                                  command)) for f in args.loads]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"rescore: {exc}", file=sys.stderr)
        return 2
    args.peer_out.write_text(json.dumps(peer, indent=2) + "\n")
    print(f"{args.peer_out}: peer goodput {peer['summary']['goodput_peer_rps']:g} rps "
          f"over rates {peer['rates']}")
    for name, result in loads:
        out = args.out_dir / name
        out.write_text(json.dumps(result, indent=2) + "\n")
        s = result["summary"]
        print(f"{out}: goodput_kv_rps {s['goodput_kv_rps']:g}, goodput_vs_peer "
              f"{s['goodput_vs_peer']} ({s.get('goodput_vs_peer_is')}), "
              f"kv_p99_ttft_at_peer_goodput_ms {s['kv_p99_ttft_at_peer_goodput_ms']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
