"""Incremental re-encoding against a full encode of the same inputs, same machine, same run.

A LoCoMo conversation (every turn one fact, as raw fact mode makes them) is encoded and
published without its last session(s) (version 1); then the last session is appended and
version 2 is made twice: incrementally (``inferscale.pipeline.steps.encode_user_kv`` with version
1 as ``previous``: the K/V of every fact whose content key is there is read from its slab,
only the rest goes through the model) and from scratch into a second store. Reported per
path: encode seconds (the incremental one includes reading and verifying version 1's
slab), forward tokens, facts reused and encoded, publish seconds; and whether both
versions are byte-identical (same version id, same file checksums, same kv.arrow bytes).

``--batched-sample N`` also measures what batch invariance costs: the last N facts
encoded one pass per fact (what the encoder does) and packed into padded batches of
``--batch-tokens`` (how it encoded before), batch by batch in alternation, with the
number of facts whose K/V bits differ between the two.

    python -m benchmarks.incremental --window 20 --batched-sample 60 \
        --out benchmarks/results/incremental-cpu.json

``--first-session S`` starts the conversation at session S (a shorter run; the appended
share of turns grows).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from inferscale.settings import Settings, offline_environment

offline_environment()

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402

from benchmarks.datasets import locomo  # noqa: E402
from benchmarks.lib.results import command_line, write_result  # noqa: E402
from inferscale.artifacts.blobs import Location  # noqa: E402
from inferscale.artifacts.layout import KV_FILE  # noqa: E402
from inferscale.artifacts.publish import Lineage, publish  # noqa: E402
from inferscale.artifacts.read import data_path  # noqa: E402
from inferscale.compose import Composer  # noqa: E402
from inferscale.encode.batches import plan_batches  # noqa: E402
from inferscale.encode.capture import encode_segments  # noqa: E402
from inferscale.encode.encoder import window_segments  # noqa: E402
from inferscale.encode.identity import EncoderConfig  # noqa: E402
from inferscale.facts.extractor import facts_hash  # noqa: E402
from inferscale.facts.table import raw_facts  # noqa: E402
from inferscale.ingest.logs import turns_hash  # noqa: E402
from inferscale.pipeline.config import PipelineConfig  # noqa: E402
from inferscale.pipeline.steps import (  # noqa: E402
    encode_user_kv, serving_model, turns_and_facts,
)

EMB = 4  # embeddings play no part here; the facts table needs some


def timed_encode(cfg: PipelineConfig, user: str, turns: pa.Table, facts: pa.Table,
                 previous: str | None = None):
    start = time.perf_counter()
    encoded = encode_user_kv(cfg, user, turns, facts, cfg.identity(serving_model(cfg).fingerprint),
                             previous, progress=True)
    return encoded, time.perf_counter() - start


def timed_publish(cfg: PipelineConfig, user: str, turns: pa.Table, facts: pa.Table, encoded):
    start = time.perf_counter()
    res = publish(cfg.store(), user, encoded, facts,
                  Lineage(turns_hash(turns), facts_hash(facts, "bench")), embeddings=False)
    return res, time.perf_counter() - start


def row(path: str, encoded, enc_s: float, res, pub_s: float) -> dict:
    s = encoded.stats
    return {"path": path, "facts": s["facts"], "encoded": s["encoded"], "reused": s["reused"],
            "forward_tokens": s["forward_tokens"], "encode_seconds": round(enc_s, 3),
            "publish_seconds": round(pub_s, 3), "version": res.version,
            "kv_bytes": res.manifest.files[KV_FILE].bytes}


def batched_cost(cfg: PipelineConfig, turns: pa.Table, facts: pa.Table, n: int,
                 batch_tokens: int) -> dict:
    """The last ``n`` facts (full windows), one segment each, planned into padded batches
    of ``batch_tokens``; each batch is encoded batched and its segments one pass each,
    the two alternating which goes first, so both see the same machine state. Returns
    seconds of both and how many facts' K/V bits differ."""
    model = serving_model(cfg)
    turn_texts, specs = turns_and_facts(turns, facts)
    composer = Composer(model.tokenizer, cfg.encoder.instruction)
    segments = window_segments(turn_texts, specs[-n:], composer, cfg.encoder)
    pad_id = model.tokenizer.pad_token_id or 0
    seconds = {"alone": 0.0, "batched": 0.0}
    differ = 0
    batches = plan_batches(segments, batch_tokens)
    for j, batch in enumerate(batches):
        segs = [segments[i] for i in batch]
        got = {}
        for mode in (("alone", "batched") if j % 2 == 0 else ("batched", "alone")):
            start = time.perf_counter()
            got[mode] = {c.chunk_id: c for c in encode_segments(
                model.model, segs, out_dtype=cfg.encoder.torch_dtype, pad_id=pad_id,
                batch_tokens=None if mode == "alone" else batch_tokens)}
            seconds[mode] += time.perf_counter() - start
        differ += sum(not torch.equal(a.kv, got["batched"][cid].kv)
                      for cid, a in got["alone"].items())
    return {"facts": n, "forward_tokens": sum(s.length for s in segments),
            "batch_tokens": batch_tokens, "batches": len(batches),
            "alone_seconds": round(seconds["alone"], 3),
            "batched_seconds": round(seconds["batched"], 3),
            "alone_vs_batched_seconds": round(seconds["alone"] / seconds["batched"], 3),
            "facts_with_different_bits": differ}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded", help="'embedded' or an HF checkpoint")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="model dtype (default: float32 on CPU, "
                    "bfloat16 on CUDA)")
    ap.add_argument("--kv-dtype", default="bfloat16", help="stored K/V dtype")
    ap.add_argument("--conversation", default="../shared/data/locomo/conv-26.json")
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--append-sessions", type=int, default=1,
                    help="how many of the last sessions make the appended part")
    ap.add_argument("--first-session", type=int, default=None,
                    help="start the conversation at this session number (shorter run)")
    ap.add_argument("--batched-sample", type=int, default=0,
                    help="facts for the batch-invariance cost measurement (0: skip)")
    ap.add_argument("--batch-tokens", type=int, default=8192,
                    help="padded tokens per batch on the batched side of that measurement")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's; part of the content keys)")
    ap.add_argument("--store", default=None, help="artifact root (default: a temporary dir)")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args(argv)
    if args.append_sessions < 1:
        ap.error("--append-sessions must be >= 1")
    cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()

    turns = locomo.turns(args.conversation).sort_by("turn_index")
    user = turns["user"][0].as_py()
    sessions = list(dict.fromkeys(turns.column("session").to_pylist()))  # in order
    if args.first_session is not None:
        keep = [s for s in sessions if int(s) >= args.first_session]
        turns = turns.filter(pc.is_in(turns["session"], pa.array(keep)))
        sessions = keep
    appended = sessions[-args.append_sessions:]
    if len(appended) == len(sessions):
        ap.error("nothing left before the appended sessions")
    base = turns.filter(pc.invert(pc.is_in(turns["session"], pa.array(appended))))

    with tempfile.TemporaryDirectory(prefix="inferscale-incremental-") as tmp:
        root = Path(args.store or tmp)
        settings = Settings()
        cfg = PipelineConfig(
            home=settings.home, model=args.model, device=args.device, model_dtype=dtype,
            encoder=EncoderConfig(window=args.window, dtype=args.kv_dtype),
            artifact_root=str(root / "incremental"), storage_options={})
        scratch = replace(cfg, artifact_root=str(root / "scratch"))
        model = serving_model(cfg)
        facts_all = raw_facts(turns, model.tokenizer, lambda texts: [[0.0] * EMB] * len(texts),
                              max_tokens=cfg.encoder.max_fact_tokens)
        facts_base = facts_all.filter(pc.is_in(facts_all["source_turn_id"],
                                               base["turn_id"]))
        # warm-up (kernels, allocator), then version 1: the conversation without its end
        encode_user_kv(cfg, user, base.slice(0, 4), facts_base.slice(0, 4),
                       cfg.identity(model.fingerprint))
        enc1, enc1_s = timed_encode(cfg, user, base, facts_base)
        v1, pub1_s = timed_publish(cfg, user, base, facts_base, enc1)
        print(f"version 1: {row('base', enc1, enc1_s, v1, pub1_s)}", flush=True)
        # version 2 from scratch, then incrementally from version 1
        full, full_s = timed_encode(scratch, user, turns, facts_all)
        ref, ref_pub_s = timed_publish(scratch, user, turns, facts_all, full)
        print(f"full: {row('full', full, full_s, ref, ref_pub_s)}", flush=True)
        inc, inc_s = timed_encode(cfg, user, turns, facts_all, previous=v1.version)
        v2, pub2_s = timed_publish(cfg, user, turns, facts_all, inc)
        print(f"incremental: {row('incremental', inc, inc_s, v2, pub2_s)}", flush=True)
        a, b = Location(cfg.store(), user, model.fingerprint), \
            Location(scratch.store(), user, model.fingerprint)
        sums = [{n: (f.bytes, f.xxh3_128) for n, f in m.files.items()}  # names differ
                for m in (v2.manifest, ref.manifest)]
        identical = (v2.version == ref.version and sums[0] == sums[1]
                     and a.blobs.read_bytes(data_path(a, v2.manifest, KV_FILE))
                     == b.blobs.read_bytes(data_path(b, ref.manifest, KV_FILE)))
        cost = (batched_cost(cfg, turns, facts_all, args.batched_sample, args.batch_tokens)
                if args.batched_sample else None)

    rows = [row("base", enc1, enc1_s, v1, pub1_s), row("full", full, full_s, ref, ref_pub_s),
            row("incremental", inc, inc_s, v2, pub2_s)]
    result = {
        "command": command_line(__spec__.name, argv),
        "device": (torch.cuda.get_device_name() if cuda else platform.processor() or "cpu")
        + f" ({args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads)",
        "model": str(model.checkpoint), "model_dtype": dtype, "kv_dtype": args.kv_dtype,
        "window": args.window, "conversation": Path(args.conversation).name,
        "sessions": sessions, "appended_sessions": appended,
        "turns": turns.num_rows, "appended_turns": turns.num_rows - base.num_rows,
        "load_average": {"start": [round(x, 2) for x in load_start],
                         "end": [round(x, 2) for x in os.getloadavg()]},
        "rows": rows,
        "batch_invariance_cost": cost,
        "summary": {
            "appended_share_of_turns": round(1 - base.num_rows / turns.num_rows, 4),
            "incremental_vs_full_seconds": round(inc_s / full_s, 4),
            "incremental_vs_full_forward_tokens": round(
                inc.stats["forward_tokens"] / full.stats["forward_tokens"], 4),
            "byte_identical": identical,
            **({"alone_vs_batched_seconds": cost["alone_vs_batched_seconds"]} if cost else {}),
        },
    }
    return write_result(result, args.out)


if __name__ == "__main__":
    main()
