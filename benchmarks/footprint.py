"""Storage footprint of one conversation's memory per model, and offline encoding time.

For each conversation and model, one artifact is really published (to a temporary
directory) and its sizes are read back: ``kv.arrow`` (the KV slab, bf16, and its offsets
table), ``facts.arrow`` (texts, token ids and embeddings) and the LanceDB fact table
(embeddings for retrieval). Every turn is one fact (``"Speaker: text"``,
``benchmarks.lib.memory.turn_facts``), tokenized with the SmolLM2 tokenizer for every
model (no other tokenizer is available offline; a model's own tokenizer changes the
token count by its compression ratio, and the KV size in proportion).

- SmolLM2-135M (the embedded model): its real encoding (window ``--window``, float32,
  stored in each ``--dtypes``), or random K/V of its shape with ``--random-kv`` (the
  sizes do not depend on the values; the CPU encoding takes minutes per conversation);
- Llama-3.1-8B, Qwen2.5-7B, Mistral-7B, Qwen3-14B (``benchmarks.lib.shapes``): random
  K/V of the model's shape (``benchmarks.lib.memory.random_memory``), which has exactly
  the real size.

Every (conversation, model) is published once per stored dtype (``--dtypes``: bf16 and
fp8 by default). Each row checks the arithmetic: slab bytes = tokens x layers x kv_heads
x head_dim x 2 (K and V) x bytes per element, and reports what one user takes resident
on a CUDA worker (``resident_bytes``: the slab as kept, fp8 with its scales, from the
manifest alone: ``inferscale.hydrate.slab.slab_nbytes``) and per fact. The summary's
``fp8_bytes_vs_bf16`` is the largest fp8/bf16 ratio of resident bytes over every
(conversation, model). The offline encoding time per conversation against the window
comes from ``benchmarks/results/encode-*.json`` (written by ``benchmarks.encode``).

    python -m benchmarks.footprint --out benchmarks/results/footprint.json

Callers: this CLI; ``tests/benchmarks/test_footprint.py`` (the arithmetic on a tiny shape).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from inferscale.settings import Settings, offline_environment

offline_environment()

import torch  # noqa: E402

from benchmarks.datasets import locomo  # noqa: E402
from benchmarks.lib.results import command_line  # noqa: E402
from benchmarks.lib.shapes import SHAPES, dummy_checkpoint  # noqa: E402
from inferscale.types import KVGeometry  # noqa: E402
from storage_schemas import kv as kv_schema  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ["smollm2-135m", "llama-3.1-8b-shape", "qwen2.5-7b-shape", "mistral-7b-shape",
          "qwen3-14b-shape"]


DTYPES = ["bfloat16", "float8_e4m3fn"]


def kv_bytes_per_token(shape: tuple[int, int, int], dtype: str = "bfloat16") -> int:
    """K and V of one token over all layers: layers x kv_heads x head_dim x 2 x bytes."""
    layers, heads, head_dim = shape
    return layers * heads * head_dim * 2 * kv_schema.ITEMSIZE[dtype]


def dir_bytes(path: str | Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total


def measure(store, user: str, model_fp: str, version: str, shape: tuple[int, int, int],
            dtype: str = "bfloat16") -> dict:
    """Sizes of a published version read from its manifest (and LanceDB folder, if any),
    with the slab checked against the shape arithmetic."""
    from inferscale.artifacts.blobs import Location
    from inferscale.artifacts.read import read_facts, read_manifest
    from inferscale.hydrate.slab import slab_nbytes

    m = read_manifest(store, user, model_fp, version)
    facts = read_facts(store, user, model_fp, version)
    tokens = m.counts["tokens"]
    per_token = kv_bytes_per_token(shape, dtype)
    lance = Path(Location(store, user, model_fp).lance_uri)
    emb_col = facts.column("embedding")
    row = {
        "facts": m.counts["facts"], "tokens": tokens, "kv_dtype": m.kv["dtype"],
        "layers": shape[0], "kv_heads": shape[1], "head_dim": shape[2],
        "kv_bytes_per_token": per_token,
        "kv_file_bytes": m.files["kv.arrow"].bytes, "kv_slab_bytes": m.kv["slab_bytes"],
        "kv_slab_expected_bytes": tokens * per_token,
        "facts_file_bytes": m.files["facts.arrow"].bytes,
        "embeddings_bytes": emb_col.nbytes,
        "embedding_dim": emb_col.type.list_size,
        "lancedb_bytes": dir_bytes(lance) if lance.exists() else None,
    }
    row["slab_matches_shape"] = row["kv_slab_bytes"] == row["kv_slab_expected_bytes"]
    # one user resident on a CUDA worker (fp8 stays fp8 there, its scales beside it), and
    # per fact: its rows and scales (the prefix chunk left out)
    row["resident_bytes"] = slab_nbytes(m)
    prefix_tokens = tokens - sum(len(t) for t in facts.column("token_ids").to_pylist())
    scale_bytes = (row["resident_bytes"] - row["kv_slab_bytes"]) // max(1, m.counts["chunks"])
    row["scale_bytes_per_chunk"] = scale_bytes
    row["bytes_per_fact"] = round((row["resident_bytes"] - prefix_tokens * per_token
                                   - scale_bytes) / max(1, m.counts["facts"]), 1)
    row["total_bytes"] = (row["kv_file_bytes"] + row["facts_file_bytes"]
                          + (row["lancedb_bytes"] or 0))
    row["kv_share_of_total"] = round(row["kv_file_bytes"] / row["total_bytes"], 4)
    return row


def conversation_rows(conversation: str, models: list[str], window: int, work: Path,
                      lancedb: bool, dtypes: list[str] = DTYPES,
                      random_kv: bool = False) -> list[dict]:
    from benchmarks.lib.memory import encoded_memory, random_memory, turn_facts
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.publish import Lineage, publish
    from inferscale.encode.identity import EncoderConfig
    from inferscale.ingest.logs import turns_hash
    from inferscale.models import checkpoint_geometry, dummy_fingerprint, load_model
    from inferscale.serve.retrieval import Embedder

    home = Settings().home
    smol = load_model("embedded", home, device="cpu", dtype="float32")
    tok = smol.tokenizer
    embedder = Embedder("embedded", device="cpu")
    turns = locomo.turns(conversation)
    name = Path(conversation).stem
    rows = []
    for model in models:
        user = name
        facts = turn_facts(turns, user, tok, embedder)
        encoded = None
        for dtype in dtypes:
            root = work / model / "artifacts"
            store = StoreConfig(str(root))
            t0 = time.perf_counter()
            if model == "smollm2-135m" and not random_kv:  # encoded once, stored per dtype
                shape = checkpoint_geometry(smol.checkpoint)
                if encoded is None:
                    encoded = encoded_memory(smol.model, tok, turns, facts, EncoderConfig(
                        window=window, dtype="float32"), smol.fingerprint)
                mem = encoded.stored_as(dtype)
                kv_note = f"real encoding, window {window}"
            elif model == "smollm2-135m":  # its geometry, random values
                shape = checkpoint_geometry(smol.checkpoint)
                mem = random_memory(facts, tok, shape, getattr(torch, dtype), smol.fingerprint)
                kv_note = "random K/V of the model's shape"
            else:
                shape = KVGeometry.of_config(SHAPES[model])
                fp = dummy_fingerprint(dummy_checkpoint(model, smol.checkpoint,
                                                        work / "ckpt" / model))
                mem = random_memory(facts, tok, shape, getattr(torch, dtype), fp)
                kv_note = "random K/V of the model's shape"
            build_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            res = publish(store, user, mem, facts, Lineage(turns_hash(turns),
                                                           f"footprint-{model}"),
                          embeddings=lancedb)
            publish_s = time.perf_counter() - t0
            del mem
            row = {"conversation": name, "model": model, "kv": kv_note,
                   **measure(store, user, res.manifest.model_fingerprint, res.version, shape,
                             dtype),
                   "build_seconds": round(build_s, 1), "publish_seconds": round(publish_s, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(work / model, ignore_errors=True)
        del encoded
    return rows


def fp8_ratios(rows: list[dict]) -> dict:
    """Per (conversation, model), fp8 against bf16: resident bytes and bytes per fact."""
    by = {(r["conversation"], r["model"], r["kv_dtype"]): r for r in rows}
    out = {}
    for (conv, model, dtype), r in by.items():
        bf16 = by.get((conv, model, "bfloat16"))
        if dtype == "float8_e4m3fn" and bf16:
            out[f"{conv}_{model}"] = {
                "resident": round(r["resident_bytes"] / bf16["resident_bytes"], 4),
                "per_fact": round(r["bytes_per_fact"] / bf16["bytes_per_fact"], 4)}
    return out


def encode_times(results: Path = RESULTS) -> dict:
    """Offline encoding time per conversation against the window, from encode-*.json."""
    out = {}
    for path in sorted(results.glob("encode-*.json")):
        data = json.loads(path.read_text())
        out[path.name] = {
            "device": data.get("device"), "model": data.get("model"),
            "conversation": data.get("conversation"),
            "rows": [{k: r.get(k) for k in ("window", "facts", "forward_tokens",
                                            "encode_seconds", "encode_tokens_per_s")}
                     for r in data.get("rows", [])]}
    return out


def markdown(rows: list[dict], encode: dict) -> str:
    """README tables: footprint per conversation and model; encoding time against w."""
    mib = 1 << 20
    lines = ["| conversation | model | KV dtype | facts | tokens | KV / token | KV store "
             "| resident | per fact | fact table | of which embeddings | LanceDB | total |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lance = f"{r['lancedb_bytes'] / mib:.2f} MiB" if r["lancedb_bytes"] else "-"
        lines.append(
            f"| {r['conversation']} | {r['model']} | {r['kv_dtype']} | {r['facts']} "
            f"| {r['tokens']} "
            f"| {r['kv_bytes_per_token'] / 1024:.1f} KiB | {r['kv_file_bytes'] / mib:.1f} MiB "
            f"| {r['resident_bytes'] / mib:.1f} MiB | {r['bytes_per_fact'] / 1024:.0f} KiB "
            f"| {r['facts_file_bytes'] / mib:.2f} MiB | {r['embeddings_bytes'] / mib:.2f} MiB "
            f"| {lance} | {r['total_bytes'] / mib:.1f} MiB |")
    if encode:
        lines += ["", "| source | model | " + " | ".join(
            f"w={r['window']}" for r in next(iter(encode.values()))["rows"]) + " |"]
        lines.append("| --- | --- |" + " --- |" * len(next(iter(encode.values()))["rows"]))
        for name, e in encode.items():
            cells = [f"{r['encode_seconds']:.1f} s" for r in e["rows"]]
            lines.append(f"| {name} | {e['model']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", nargs="+", default=[
        "../shared/data/locomo/conv-26.json", "../shared/data/locomo/conv-30.json"])
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--window", type=int, default=0,
                    help="SmolLM2's encoding window (the size does not depend on it)")
    ap.add_argument("--dtypes", nargs="+", default=DTYPES, choices=DTYPES,
                    help="stored KV dtypes, each published for every conversation and model")
    ap.add_argument("--random-kv", action="store_true",
                    help="random K/V of SmolLM2's shape too (no CPU encoding; same sizes)")
    ap.add_argument("--no-lancedb", action="store_true", help="skip the LanceDB fact table")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="inferscale-footprint-"))
    rows = []
    for conv in args.conversations:
        rows += conversation_rows(conv, args.models, args.window, work, not args.no_lancedb,
                                  args.dtypes, args.random_kv)
    encode = encode_times()
    table = markdown(rows, encode)
    print(table)
    summary = {f"{r['conversation']}_{r['model']}_{r['kv_dtype']}_kv_mib":
               round(r["kv_file_bytes"] / (1 << 20), 1) for r in rows}
    summary["all_slabs_match_shape"] = all(r["slab_matches_shape"] for r in rows)
    ratios = fp8_ratios(rows)
    if ratios:  # the worst case over every (conversation, model)
        summary["fp8_bytes_vs_bf16"] = max(v["resident"] for v in ratios.values())
        summary["fp8_bytes_per_fact_vs_bf16"] = max(v["per_fact"] for v in ratios.values())
    result = {
        "command": command_line(__spec__.name, argv),
        "device": f"{platform.processor() or 'cpu'} (torch {torch.__version__})",
        "tokenizer": "SmolLM2 (stand-in for every model)", "kv_dtypes": args.dtypes,
        "rows": rows, "fp8_vs_bf16": ratios, "encode_time": encode, "markdown": table,
        "summary": {**summary, "wall_seconds": round(time.perf_counter() - t0, 1)},
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
