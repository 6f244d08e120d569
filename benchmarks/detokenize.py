"""The event loop's detokenization work per request: vLLM's whole-prompt priming against
the server's short-suffix one (``inferscale.serve.detokenize``).

Builds a memory-sized prompt (``--prompt-tokens`` ids of the embedded conversations,
SmolLM2's real tokenizer) and decodes ``--outputs`` generated ids per request, ``--requests`` times,
three ways of output: ids that each add text, ids that add none (past the tokenizer's
vocabulary, as the ``-shape`` models' dummy weights emit), and a mix. Each way is timed
with the stream primed as vLLM 0.26 / 0.32 prime it (the whole prompt) and as the server
does now; the texts are checked equal. The figures are CPU time on the serving process's
event loop, GIL held.

    python -m benchmarks.detokenize --out benchmarks/results/detokenize-cpu.json

Callers: this CLI; ``tests/benchmarks/test_detokenize.py`` (tiny sizes).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from benchmarks.lib.results import command_line, cpu_device, write_result
from inferscale.serve.detokenize import TextStream, backend_of

SAMPLES = Path(__file__).resolve().parents[1] / "inferscale" / "samples" / "conversations.jsonl"


def prompt_ids(backend, n: int) -> list[int]:
    """``n`` ids of conversation text (the embedded samples, repeated as needed)."""
    ids = backend.encode(SAMPLES.read_text()).ids
    while len(ids) < n:
        ids += ids
    return ids[:n]


def vllm_text(backend, prompt: list[int], outputs: list[int]) -> str:
    """As vLLM's ``FastIncrementalDetokenizer``: primed with the whole prompt."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    return "".join(stream.step(backend, t) or "" for t in outputs)


def server_text(backend, prompt: list[int], outputs: list[int]) -> str:
    """As the server now: primed with a short suffix, a step per id."""
    stream = TextStream(backend, prompt)
    return "".join(stream.step([t]) for t in outputs)


def outputs_of(kind: str, n: int, vocab: int, rng: random.Random) -> list[int]:
    text = [rng.randrange(1000, vocab) for _ in range(n)]
    none = [rng.randrange(vocab, 128256) for _ in range(n)]
    return {"text": text, "no_text": none,
            "mixed": [rng.choice(pair) for pair in zip(text, none)]}[kind]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=2700)
    ap.add_argument("--outputs", type=int, default=32, help="generated ids per request")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if min(args.prompt_tokens, args.outputs, args.requests) < 1:
        ap.error("--prompt-tokens, --outputs and --requests must be >= 1")
    from transformers import AutoTokenizer

    from inferscale.models import resolve_checkpoint
    from inferscale.settings import Settings, offline_environment

    offline_environment()
    tok = AutoTokenizer.from_pretrained(resolve_checkpoint("embedded", Settings().home))
    backend = backend_of(tok)
    prompt = prompt_ids(backend, args.prompt_tokens)
    rng = random.Random(0)
    rows = []
    for kind in ("text", "no_text", "mixed"):
        requests = [outputs_of(kind, args.outputs, backend.get_vocab_size(), rng)
                    for _ in range(args.requests)]
        row = {"outputs": kind}
        for name, fn in (("vllm_whole_prompt", vllm_text), ("server_suffix", server_text)):
            times, texts = [], []
            for outs in requests:
                t0 = time.perf_counter()
                texts.append(fn(backend, prompt, outs))
                times.append(time.perf_counter() - t0)
            row[f"{name}_ms_per_request_median"] = round(statistics.median(times) * 1e3, 3)
            row[f"{name}_texts"] = texts
        row["same_text"] = row.pop("vllm_whole_prompt_texts") == row.pop("server_suffix_texts")
        row["ratio"] = round(row["vllm_whole_prompt_ms_per_request_median"]
                             / max(row["server_suffix_ms_per_request_median"], 1e-6), 1)
        rows.append(row)
        print(row, flush=True)
    summary = {f"{r['outputs']}_{k}": r[k] for r in rows
               for k in ("vllm_whole_prompt_ms_per_request_median",
                         "server_suffix_ms_per_request_median", "ratio")}
    summary["same_text"] = all(r["same_text"] for r in rows)
    return write_result({"command": command_line(__spec__.name, argv), "device": cpu_device(),
                         "prompt_tokens": args.prompt_tokens, "outputs": args.outputs,
                         "requests": args.requests, "rows": rows, "summary": summary}, args.out)


if __name__ == "__main__":
    main()
