"""The load benchmark's server process: InferScale's OpenAI-compatible app
(:func:`inferscale.serve.app.serve_app`, the code ``inferscale serve`` runs) on
127.0.0.1, over the engine the benchmark describes (a real checkpoint, or a dummy-weight
shape that ``inferscale serve`` cannot start).

    python benchmarks/load_server.py CONFIG.json

``CONFIG.json``: ``{"engine": {EngineConfig fields}, "tokenizer": dir, "embedder": name
or dir, "top_k": k, "model_name": name, "port": p}``. No API keys: loopback only, the
body's ``user`` field names the user (the app's loopback policy).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferscale.settings import offline_environment  # noqa: E402

offline_environment()


async def serve(cfg: dict) -> None:
    import torch
    from transformers import AutoTokenizer

    from inferscale.artifacts.layout import StoreConfig
    from inferscale.serve.app import AccessPolicy, serve_app
    from inferscale.serve.engine import EngineConfig, MemoryEngine
    from inferscale.serve.retrieval import Embedder
    from inferscale.serve.server import MemoryServer

    cuda = torch.cuda.is_available()
    engine = await MemoryEngine(EngineConfig(**cfg["engine"])).start()
    embedder = Embedder(cfg["embedder"], device="cuda" if cuda else "cpu",
                        dtype=torch.float16 if cuda else None)
    server = MemoryServer(engine, AutoTokenizer.from_pretrained(cfg["tokenizer"]), embedder,
                          StoreConfig(cfg["engine"]["artifact_root"]), mode="kv",
                          top_k=cfg["top_k"])
    await serve_app(server, AccessPolicy({}, None, None, loopback=True), cfg["model_name"],
                    "127.0.0.1", cfg["port"], log_level="warning")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if args and args[0] in ("-h", "--help") else 2)
    asyncio.run(serve(json.loads(Path(args[0]).read_text())))


if __name__ == "__main__":
    main()
