"""What the injection-step benchmarks feed the library's step: a gpu-tier resident of
synthetic facts, the retrievals a step loads from it, and their shared size flags.

Used by ``benchmarks.inject_host_cost`` (host work on the CPU) and
``benchmarks.inject_kernel`` (the whole step on CUDA), so both time the same inputs.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from inferscale.hydrate.resident import Resident
from inferscale.types import PREFIX_ID

FP8 = torch.float8_e4m3fn


def resident(facts: int, tokens: int, prefix: int, dtype: torch.dtype, L: int, H: int,
             D: int, device: torch.device | None = None, seed: int = 0) -> Resident:
    """A GPU-tier resident of ``facts`` facts of ``tokens`` +- 8 tokens after a prefix.
    ``device`` None: the slab is a broadcast view (its shape only, no byte of it read);
    else random values there (``[T, 2, L, H, D]`` token-major, as a CUDA store places
    it). fp8: per-chunk scales ``[C, 2, L, H]`` float32 on the host, as a store keeps
    them."""
    rng = np.random.default_rng(seed)
    lengths = [prefix] + rng.integers(tokens - 8, tokens + 9, facts).tolist()
    ids = [PREFIX_ID] + [f"fact-{i}" for i in range(facts)]
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    index = {c: (int(o), int(n)) for c, o, n in zip(ids, offsets, lengths)}
    tokens_of = {c: tuple(range(n)) for c, n in zip(ids, lengths)}
    shape = (sum(lengths), 2, L, H, D)
    if device is None:
        slab = torch.zeros((1, 1, 1, 1, 1), dtype=dtype).expand(*shape)
    else:
        gen = torch.Generator(device=device).manual_seed(seed)
        slab = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16).to(dtype)
    scales = (torch.rand((len(ids), 2, L, H), generator=torch.Generator().manual_seed(seed))
              + 0.5) if dtype == FP8 else None  # [C, 2, L, H] float32
    return Resident("user", "v1", "fp", slab, index, tokens_of, tier="gpu", scales=scales)


def retrievals(res: Resident, k: int, queries: int) -> tuple[list[list[str]], list[int],
                                                             np.random.Generator]:
    """``queries`` retrievals of ``k`` facts in random order after the prefix (seeded by
    ``k``), their widths in tokens, and the generator, to draw more from."""
    rng = np.random.default_rng(k)
    facts = [c for c in res.index if c != PREFIX_ID]
    picks = [[PREFIX_ID] + [facts[i] for i in rng.choice(len(facts), k, replace=False)]
             for _ in range(queries)]
    return picks, [sum(res.index[c][1] for c in p) for p in picks], rng


def add_size_args(ap: argparse.ArgumentParser, repeats: int) -> None:
    """The flags both benchmarks share (``repeats``: the default of ``--repeats``)."""
    ap.add_argument("--facts", type=int, default=400, help="facts of the resident user")
    ap.add_argument("--tokens", type=int, default=28, help="mean tokens per fact")
    ap.add_argument("--prefix", type=int, default=24, help="tokens of the prefix chunk")
    ap.add_argument("--ks", type=int, nargs="+", default=[10, 50], help="facts per step")
    ap.add_argument("--shape", type=int, nargs=3, default=[32, 8, 128], metavar=("L", "H", "D"),
                    help="layers, KV heads, head dim (default: Llama-3.1-8B)")
    ap.add_argument("--queries", type=int, default=20, help="retrievals cycled through")
    ap.add_argument("--repeats", type=int, default=repeats, help="timed steps per figure")
    ap.add_argument("--out", default=None, help="write the result JSON here")


def check_sizes(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every size >= 1 (--tokens > 8), each k at most --facts; else the parser's error."""
    if min(args.facts, args.tokens - 8, args.prefix, args.queries, args.repeats,
           *args.shape) < 1 or any(k < 1 or k > args.facts for k in args.ks):
        ap.error("sizes must be >= 1 (--tokens > 8), each k at most --facts")
