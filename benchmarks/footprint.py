"""Storage footprint of one conversation's memory per model, and offline encoding time.

For each conversation and model, one artifact is really published (to a temporary
directory) and its sizes are read back: ``kv.arrow`` (the KV slab, bf16, and its offsets
table), ``facts.arrow`` (texts, token ids and embeddings) and the LanceDB fact table
(embeddings for retrieval). Every turn is one fact (``"Speaker: text"``,
``benchmarks.memory_setup.turn_facts``), tokenized with the SmolLM2 tokenizer for every
model (no other tokenizer is available offline; a model's own tokenizer changes the
token count by its compression ratio, and the KV size in proportion).

- SmolLM2-135M (the embedded model): its real encoding (window ``--window``);
- Llama-3.1-8B, Qwen2.5-7B, Mistral-7B, Qwen3-14B (``benchmarks.shapes``): random K/V of
  the model's shape (``memory_setup.random_memory``), which has exactly the real size.

Each row checks the arithmetic: slab bytes = tokens x layers x kv_heads x head_dim x 2
(K and V) x 2 bytes. The offline encoding time per conversation against the window
comes from ``benchmarks/results/encode-*.json`` (written by ``benchmarks/encode.py``).

    python benchmarks/footprint.py --out benchmarks/results/footprint.json

Callers: this CLI; ``tests/test_bench_footprint.py`` (the arithmetic on a tiny shape).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferscale.settings import Settings, offline_environment  # noqa: E402

offline_environment()

import torch  # noqa: E402

from benchmarks.shapes import SHAPES, kv_shape  # noqa: E402
from storage_schemas import kv as kv_schema  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ["smollm2-135m", "llama-3.1-8b-shape", "qwen2.5-7b-shape", "mistral-7b-shape",
          "qwen3-14b-shape"]


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
    row["total_bytes"] = (row["kv_file_bytes"] + row["facts_file_bytes"]
                          + (row["lancedb_bytes"] or 0))
    row["kv_share_of_total"] = round(row["kv_file_bytes"] / row["total_bytes"], 4)
    return row


def conversation_rows(conversation: str, models: list[str], window: int, work: Path,
                      lancedb: bool) -> list[dict]:
    from benchmarks.memory_setup import encoded_memory, load_turns, random_memory, turn_facts
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.publish import Lineage, publish
    from inferscale.encode.identity import EncoderConfig
    from inferscale.models import dummy_fingerprint, load_model
    from inferscale.ingest.logs import turns_hash
    from inferscale.serve.retrieval import Embedder
    from benchmarks.shapes import write_dummy_checkpoint

    home = Settings().home
    smol = load_model("embedded", home, device="cpu", dtype="float32")
    tok = smol.tokenizer
    embedder = Embedder("embedded", device="cpu")
    turns = load_turns(conversation)
    name = Path(conversation).stem
    rows = []
    for model in models:
        root = work / model / "artifacts"
        store = StoreConfig(str(root))
        user = name
        facts = turn_facts(turns, user, tok, embedder)
        t0 = time.perf_counter()
        if model == "smollm2-135m":
            shape = kv_shape(json.loads((Path(smol.checkpoint) / "config.json").read_text()))
            mem = encoded_memory(smol.model, tok, turns, facts,
                                 EncoderConfig(window=window, dtype="bfloat16"), smol.fingerprint)
            kv_note = f"real encoding, window {window}"
        else:
            shape = kv_shape(SHAPES[model])
            fp = dummy_fingerprint(write_dummy_checkpoint(model, smol.checkpoint, work / "ckpt" / model))
            mem = random_memory(facts, tok, shape, torch.bfloat16, fp)
            kv_note = "random K/V of the model's shape"
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = publish(store, user, mem, facts, Lineage(turns_hash(turns), f"footprint-{model}"),
                      embeddings=lancedb)
        publish_s = time.perf_counter() - t0
        del mem
        row = {"conversation": name, "model": model, "kv": kv_note,
               **measure(store, user, res.manifest.model_fingerprint, res.version, shape),
               "build_seconds": round(build_s, 1), "publish_seconds": round(publish_s, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        shutil.rmtree(work / model, ignore_errors=True)
    return rows


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
    lines = ["| conversation | model | facts | tokens | KV / token | KV store | fact table "
             "| of which embeddings | LanceDB | total |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lance = f"{r['lancedb_bytes'] / mib:.2f} MiB" if r["lancedb_bytes"] else "-"
        lines.append(
            f"| {r['conversation']} | {r['model']} | {r['facts']} | {r['tokens']} "
            f"| {r['kv_bytes_per_token'] / 1024:.1f} KiB | {r['kv_file_bytes'] / mib:.1f} MiB "
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
    ap.add_argument("--no-lancedb", action="store_true", help="skip the LanceDB fact table")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="inferscale-footprint-"))
    rows = []
    for conv in args.conversations:
        rows += conversation_rows(conv, args.models, args.window, work, not args.no_lancedb)
    encode = encode_times()
    table = markdown(rows, encode)
    print(table)
    summary = {f"{r['conversation']}_{r['model']}_kv_mib": round(r["kv_file_bytes"] / (1 << 20), 1)
               for r in rows}
    summary["all_slabs_match_shape"] = all(r["slab_matches_shape"] for r in rows)
    result = {
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
        "device": f"{platform.processor() or 'cpu'} (torch {torch.__version__})",
        "tokenizer": "SmolLM2 (stand-in for every model)", "kv_dtype": "bfloat16",
        "rows": rows, "encode_time": encode, "markdown": table,
        "summary": {**summary, "wall_seconds": round(time.perf_counter() - t0, 1)},
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
