"""Encoding throughput against plain batched prefill of the same model, same device.

Every turn of a LoCoMo conversation is taken as one fact; for each window ``w`` the
whole conversation is encoded (instruction prefix + one fact per turn, each with its
``w`` preceding turns) and, in the same run, the identical padded batches are run
through the model's plain causal prefill (no capture, no mask, nothing kept). The ratio
``prefill_seconds / encode_seconds`` is the share of plain prefill throughput the
encoder keeps. Encode and prefill alternate batch by batch, so both see the same machine
state; ``--prefill-every N`` runs the plain prefill on every N-th batch only (the ratio
then compares those batches' encode and prefill times; the conversation time is always
the encoding of every batch).

    python -m benchmarks.encode --model embedded --device cpu --prefill-every 4 \
        --out benchmarks/results/encode-cpu.json
    python -m benchmarks.encode --model llama-3.1-8b-shape --device cuda \
        --out benchmarks/results/encode-h200.json   # random weights, bf16

``llama-3.1-8b-shape`` builds Llama-3.1-8B's architecture with random weights
(transformers ``from_config``) and, having no Llama-3 tokenizer offline, tokenizes with
the embedded SmolLM2 tokenizer (ids fit Llama's vocabulary; only shapes matter here).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from inferscale.settings import Settings, offline_environment

offline_environment()

from benchmarks.datasets import locomo  # noqa: E402
from benchmarks.lib.results import command_line, write_result  # noqa: E402
from benchmarks.lib.shapes import SHAPES, hf_config  # noqa: E402
from inferscale.compose import Composer  # noqa: E402
from inferscale.encode.batches import Segment, build_batch, plan_batches  # noqa: E402
from inferscale.encode.capture import encode_segments  # noqa: E402
from inferscale.encode.encoder import FactSpec, TurnText, window_segments  # noqa: E402
from inferscale.encode.identity import EncoderConfig  # noqa: E402
from inferscale.types import PREFIX_ID  # noqa: E402


def load(model_name: str, device: str, dtype: str, tokenizer_path: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inferscale.models import load_model, resolve_checkpoint

    home = Settings().home
    if model_name in SHAPES:
        tok_dir = tokenizer_path or str(resolve_checkpoint("embedded", home))
        tok = AutoTokenizer.from_pretrained(tok_dir)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                hf_config(model_name), dtype=getattr(torch, dtype)).eval()
        return model, tok, f"{model_name} (random weights)"
    loaded = load_model(model_name, home, device=device, dtype=dtype)
    return loaded.model, loaded.tokenizer, str(loaded.checkpoint)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def plain_prefill(model, segments, batch_tokens: int, pad_id: int, device: str) -> float:
    """The same padded batches through the decoder with its own causal attention."""
    decoder = getattr(model, model.base_model_prefix)
    sync(device)
    start = time.perf_counter()
    for batch in plan_batches(segments, batch_tokens):
        inputs = build_batch([segments[i] for i in batch], pad_id, torch.device(device),
                             next(model.parameters()).dtype)
        decoder(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"],
                use_cache=False)
    sync(device)
    return time.perf_counter() - start


def timed_encode(model, segments, cfg: EncoderConfig, pad_id: int, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in encode_segments(model, segments, out_dtype=cfg.torch_dtype,
                             batch_tokens=cfg.batch_tokens, pad_id=pad_id):
        pass
    sync(device)
    return time.perf_counter() - start


def measure(model, segments, cfg: EncoderConfig, pad_id: int, device: str,
             prefill_every: int) -> dict:
    """Encode every batch; plain-prefill every ``prefill_every``-th batch right after its
    encoding. Returns total encode seconds and the sampled batches' encode/prefill seconds."""
    batches = plan_batches(segments, cfg.batch_tokens)
    total = sampled_enc = sampled_pre = 0.0
    sampled_tokens = 0
    for j, batch in enumerate(batches):
        segs = [segments[i] for i in batch]  # one batch: re-planning it gives the same batch
        enc = timed_encode(model, segs, cfg, pad_id, device)
        total += enc
        if j % prefill_every == 0:
            sampled_pre += plain_prefill(model, segs, cfg.batch_tokens, pad_id, device)
            sampled_enc += enc
            sampled_tokens += sum(s.length for s in segs)
    return {"encode_seconds": total, "batches": len(batches),
            "prefill_batches": len(range(0, len(batches), prefill_every)),
            "sampled_tokens": sampled_tokens, "sampled_encode_seconds": sampled_enc,
            "sampled_prefill_seconds": sampled_pre}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded",
                    help=f"'embedded', an HF checkpoint, or one of {sorted(SHAPES)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="model dtype (default: float32 on CPU, "
                    "bfloat16 on CUDA)")
    ap.add_argument("--kv-dtype", default="bfloat16", help="stored K/V dtype")
    ap.add_argument("--conversation", default="../shared/data/locomo/conv-26.json")
    ap.add_argument("--windows", type=int, nargs="+", default=[0, 5, 20, 50])
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="padded tokens per pass (default 8192 CPU, 65536 CUDA)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir for the -shape models")
    ap.add_argument("--max-turns", type=int, default=None, help="only the first N turns "
                    "(quick checks; results then cover part of the conversation)")
    ap.add_argument("--prefill-every", type=int, default=1, help="plain prefill on every "
                    "N-th batch only (the ratio's sample; 1 = every batch)")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args(argv)
    if args.prefill_every < 1:
        ap.error("--prefill-every must be >= 1")
    cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    batch_tokens = args.batch_tokens or (65536 if cuda else 8192)

    model, tok, model_desc = load(args.model, args.device, dtype, args.tokenizer)
    turns_table = locomo.turns(args.conversation)
    turns = [TurnText(s, t) for s, t in zip(turns_table.column("speaker").to_pylist(),
                                            turns_table.column("text").to_pylist())]
    turns = turns[:args.max_turns] if args.max_turns else turns
    facts = [FactSpec(f"t{i}", t.text, i) for i, t in enumerate(turns)]
    composer = Composer(tok)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    # warm-up: kernels, allocator
    warm = window_segments(turns, facts[:8], composer, EncoderConfig(window=2))
    timed_encode(model, warm, EncoderConfig(batch_tokens=batch_tokens), pad_id, args.device)
    plain_prefill(model, warm, batch_tokens, pad_id, args.device)

    rows = []
    for w in args.windows:
        cfg = EncoderConfig(window=w, dtype=args.kv_dtype, batch_tokens=batch_tokens)
        segments = [Segment((), ((PREFIX_ID, tuple(composer.prefix_ids())),))]
        segments += window_segments(turns, facts, composer, cfg)
        forward_tokens = sum(s.length for s in segments)
        fact_tokens = sum(len(ids) for s in segments for _, ids in s.chunks)
        m = measure(model, segments, cfg, pad_id, args.device, args.prefill_every)
        enc_s, pre_s = m["sampled_encode_seconds"], m["sampled_prefill_seconds"]
        row = {
            "window": w, "facts": len(facts), "fact_tokens": fact_tokens,
            "forward_tokens": forward_tokens, "encode_seconds": round(m["encode_seconds"], 3),
            "encode_tokens_per_s": round(forward_tokens / m["encode_seconds"], 1),
            "batches": m["batches"], "prefill_batches": m["prefill_batches"],
            "sampled_tokens": m["sampled_tokens"],
            "sampled_encode_seconds": round(enc_s, 3), "prefill_seconds": round(pre_s, 3),
            "prefill_tokens_per_s": round(m["sampled_tokens"] / pre_s, 1),
            "encode_vs_prefill_throughput": round(pre_s / enc_s, 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    w50 = next((r for r in rows if r["window"] == 50), rows[-1])
    result = {
        "command": command_line(__spec__.name, argv),
        "device": (torch.cuda.get_device_name() if cuda else platform.processor() or "cpu")
        + f" ({args.device}, torch {torch.__version__})",
        "model": model_desc, "model_dtype": dtype, "kv_dtype": args.kv_dtype,
        "batch_tokens": batch_tokens, "prefill_every": args.prefill_every,
        "conversation": Path(args.conversation).name,
        "rows": rows,
        "summary": {
            "w50_conversation_seconds": w50["encode_seconds"],
            "encode_vs_prefill_throughput": w50["encode_vs_prefill_throughput"],
        },
    }
    return write_result(result, args.out)


if __name__ == "__main__":
    main()
