"""``inferscale``: the command line.

    inferscale demo                 encode the sample conversation, serve, compare answers
    inferscale encode --logs URI    logs -> facts -> KV -> published artifacts (one process)
    inferscale serve [--mode kv|prompt] [--host H] [--port P] [--replicas N]
    inferscale hydrate|evict|status talk to a running server's admin API
    inferscale versions --user U    list a user's published versions

Settings come from ``INFERSCALE_*`` environment variables (``inferscale.settings``);
flags override the few that matter per command. The library never imports Prefect; only
``demo`` runs a Prefect flow (``flows.encode``), in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
from pathlib import Path

from inferscale.settings import Settings, offline_environment
from inferscale.types import ENCODER_CONTEXTS, TIERS

DEMO_QUESTIONS = [
    ("maya", "What is my dog's name?"),
    ("maya", "Who did I go to Lisbon with?"),
    ("maya", "Where do I work?"),
    ("tomas", "Which marathon am I training for?"),
    ("tomas", "What is my cat called?"),
]


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {k: v for k, v in {
        "artifact_root": getattr(args, "artifact_root", None),
        "model": getattr(args, "model", None),
        "window": getattr(args, "window", None),
        "encoder_context": getattr(args, "context", None),
        "text_tail": getattr(args, "text_tail", None),
        "fact_mode": getattr(args, "fact_mode", None),
    }.items() if v is not None}
    return Settings(**overrides)


# ---------------------------------------------------------------------------- commands


def cmd_encode(args: argparse.Namespace) -> int:
    from inferscale.facts.extractor import FactsConfig
    from inferscale.ingest.logs import sample_conversations
    from inferscale.pipeline import PipelineConfig, run

    settings = _settings(args)
    logs = args.logs or [str(sample_conversations())]
    result = run(PipelineConfig.from_settings(settings), FactsConfig.from_settings(settings),
                 logs, users=args.users, quarantine_uri=args.quarantine)
    print(json.dumps(result, indent=2))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from inferscale.serve.app import ServeError, serve_forever

    try:
        if args.replicas is not None:  # Ray Serve: N memory replicas behind one endpoint
            from inferscale.serve.replicas import run_replicas

            overrides = {k: getattr(args, k) for k in ("model", "artifact_root")
                         if getattr(args, k) is not None}
            run_replicas(_settings(args), args.mode, args.host, args.port, args.replicas,
                         overrides)
            return 0
        asyncio.run(serve_forever(_settings(args), args.mode, args.host, args.port))
    except ServeError as exc:
        print(f"inferscale serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _admin(args: argparse.Namespace):
    """The admin client: the key from ``--admin-key-file`` or INFERSCALE_ADMIN_KEY (never
    from the command line, where ``ps`` shows it), sent only to a configured server."""
    from inferscale.serve.admin_client import admin_client_for

    settings = Settings()
    if args.admin_key_file:
        key = Path(args.admin_key_file).read_text().strip() or None
    else:
        key = settings.admin_key.get_secret_value() if settings.admin_key else None
    return admin_client_for(args.url, key, settings.admin_urls())


def cmd_hydrate(args: argparse.Namespace) -> int:
    client = _admin(args)
    for user in args.users:
        print(json.dumps(client.hydrate(user, tier=args.tier, version=args.version)))
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    client = _admin(args)
    for user in args.users:
        print(json.dumps(client.evict(user)))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    print(json.dumps(_admin(args).status(), indent=2))
    return 0


def _admin_failure(args: argparse.Namespace, exc: Exception) -> int:
    """One line on stderr for a failed admin call; exit status 1."""
    from inferscale.serve.admin_client import AdminError

    if isinstance(exc, AdminError) and exc.status is None:
        cause = exc.__cause__ or exc
        print(f"inferscale {args.command}: no server answers at {args.url} "
              f"({type(cause).__name__}: {cause})", file=sys.stderr)
    else:
        print(f"inferscale {args.command}: {exc}", file=sys.stderr)
    return 1


def cmd_versions(args: argparse.Namespace) -> int:
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.read import latest_version, list_versions
    from inferscale.encode.models import checkpoint_fingerprint, resolve_checkpoint

    settings = _settings(args)
    store = StoreConfig.from_settings(settings)
    fp = checkpoint_fingerprint(resolve_checkpoint(settings.model, settings.home), settings.home)
    latest = latest_version(store, args.user, fp)
    found = list_versions(store, args.user, fp)
    if not found:
        print(f"inferscale versions: no versions of user {args.user!r} for model {fp} under "
              f"{store.root}", file=sys.stderr)
        return 1
    for m in found:
        mark = "*" if m.version == latest else " "
        print(f"{mark} {m.version}  created {m.created}  facts {m.counts.get('facts')}  "
              f"kv {m.files['kv.arrow'].bytes} B  parents log={m.parents.get('log', '')[:12]} "
              f"facts={m.parents.get('facts', '')[:12]}")
    return 0


# ---------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on the embedded defaults: no network, no keys, no GPU needed."""
    settings = _settings(args)
    root = args.artifact_root or str(settings.home / "demo" / "artifacts")
    os.environ.setdefault("PREFECT_HOME", str(settings.home / "prefect"))
    from flows.encode import encode_users
    from inferscale.ingest.logs import sample_conversations

    print(f"[1/3] encode flow (Prefect, in-process): sample conversation -> facts ({args.fact_mode})"
          f" -> pre-RoPE KV (window {settings.window}) -> artifacts under {root}", flush=True)
    report = encode_users(logs=[str(sample_conversations())], fact_mode=args.fact_mode,
                          artifact_root=root)
    print(_report_lines(report), flush=True)
    import torch

    # on CPU a 1 GiB KV cache (the demo's prompts are ~400 tokens) instead of half the
    # host's memory: the engine starts sooner and fits a small CI machine
    kv_bytes = settings.kv_cache_memory_bytes or (
        None if torch.cuda.is_available() and settings.device != "cpu" else 1 << 30)
    settings = Settings(artifact_root=root, model=settings.model, window=settings.window,
                        kv_cache_memory_bytes=kv_bytes)
    return asyncio.run(_demo_serve(settings, args.questions, args.max_tokens))


def _report_lines(report: dict) -> str:
    """The encode run's report (``RunReport.to_dict()``): one line per user."""
    keep = ("status", "version", "facts", "kv_bytes", "seconds", "error")
    return "\n".join(
        f"      {user}: " + "  ".join(f"{k}={str(v)[:16] if k == 'version' else v}"
                                     for k, v in row.items() if k in keep and v not in ("", None))
        for user, row in report["users"].items())


async def _demo_serve(settings: Settings, n_questions: int, max_tokens: int) -> int:
    import httpx
    import uvicorn
    from openai import AsyncOpenAI

    from inferscale.serve.app import AccessPolicy, create_app
    from inferscale.serve.server import start_server

    print("[2/3] starting the engine (vLLM + InferScale connector) and the OpenAI-compatible "
          "server on 127.0.0.1", flush=True)
    server, name = await start_server(settings, "kv")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = uvicorn.Server(uvicorn.Config(create_app(server, AccessPolicy({}, None, None, True), name),
                                        host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(web.serve())
    try:
        while not web.started:
            await asyncio.sleep(0.1)
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=600, trust_env=False) as http:
            for user in sorted({u for u, _ in DEMO_QUESTIONS}):
                r = await http.post("/admin/hydrate", json={"user": user, "tier": "gpu"})
                r.raise_for_status()
                h = r.json()
                print(f"      hydrated {user}: version {h['version'][:12]}, {h['facts']} facts, "
                      f"{h['bytes'] / 2**20:.1f} MiB KV ({h['tier']} tier)", flush=True)
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key="local", http_client=None)
        print("[3/3] answers (greedy; KV injection vs. the Mem0-style prompt baseline, same "
              "retrieval, same engine, prefix cache reset before each)", flush=True)
        not_injected = []
        for user, question in DEMO_QUESTIONS[:n_questions]:
            print(f"\n  {user}: {question}")
            for mode in ("kv", "prompt"):
                await server.engine.llm.reset_prefix_cache()
                resp = await client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": question}], user=user,
                    max_tokens=max_tokens, temperature=0.0, extra_body={"inferscale": {"mode": mode}})
                info = resp.model_extra["inferscale"]
                label = "KV injection" if mode == "kv" else "prompt     "
                print(f"    {label}  TTFT {info['timings_ms']['engine_ttft']:7.0f} ms  "
                      f"(prompt {resp.usage.prompt_tokens} tokens, injected "
                      f"{info['injected_tokens']}): {resp.choices[0].message.content.strip()}",
                      flush=True)
                if mode == "kv" and not info["injected_tokens"]:
                    not_injected.append(f"{user}: {question} ({info.get('fallback')})")
    finally:
        web.should_exit = True
        await serving
        server.engine.shutdown()
    if not_injected:  # the demo's point is answers from injected memory: say it failed
        print("\ninferscale demo: KV answers prefilled instead of injected:\n  "
              + "\n  ".join(not_injected), file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------- parser


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="inferscale", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    root_help = "artifact store root: a directory or s3://bucket/prefix (default: " \
        "INFERSCALE_ARTIFACT_ROOT, else ~/.cache/inferscale/artifacts)"
    model_help = "serving model: 'embedded' (SmolLM2), a checkpoint directory or a hub id " \
        "(default: INFERSCALE_MODEL)"
    url_help = "root URL of the running server (inferscale serve)"
    key_help = ("file holding the admin key the server wants off loopback (default: "
                "INFERSCALE_ADMIN_KEY); sent only to INFERSCALE_SERVER_URLS")

    p = sub.add_parser("demo", help="encode the sample conversation, serve it, compare answers")
    p.add_argument("--fact-mode", choices=["raw", "mem0"], default="raw",
                   help="raw: each turn is a fact (fast); mem0: LLM extraction (slow on CPU)")
    p.add_argument("--artifact-root", default=None,
                   help="where the demo publishes (default: ~/.cache/inferscale/demo/artifacts)")
    p.add_argument("--questions", type=int, default=len(DEMO_QUESTIONS),
                   help=f"how many of the {len(DEMO_QUESTIONS)} sample questions to ask")
    p.add_argument("--max-tokens", type=int, default=40, help="tokens per answer (greedy)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("encode", help="logs -> facts -> KV -> artifacts, in this process")
    p.add_argument("--logs", nargs="+", default=None,
                   help="fsspec URIs/globs of conversation logs (default: the sample)")
    p.add_argument("--users", nargs="+", default=None,
                   help="user ids to encode (default: every user in the logs)")
    p.add_argument("--fact-mode", choices=["raw", "mem0"], default=None,
                   help="raw: each turn is a fact; mem0: LLM extraction "
                   "(default: INFERSCALE_FACT_MODE)")
    p.add_argument("--window", type=int, default=None,
                   help="turns of context encoded before each fact (default: INFERSCALE_WINDOW)")
    p.add_argument("--context", choices=list(ENCODER_CONTEXTS), default=None,
                   help="what each fact is encoded after: memory = the serving prefix and the "
                   "window as memory lines; transcript = the raw window (the original "
                   "encoder) (default: INFERSCALE_ENCODER_CONTEXT)")
    p.add_argument("--text-tail", type=int, default=None,
                   help="best facts a request prefills as text right before the question "
                   "instead of injecting them (default: INFERSCALE_TEXT_TAIL)")
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--artifact-root", default=None, help=root_help)
    p.add_argument("--quarantine", default=None, help="where rejected records go (JSONL)")
    p.set_defaults(func=cmd_encode)

    p = sub.add_parser("serve", help="OpenAI-compatible server answering from user memory")
    p.add_argument("--mode", choices=["kv", "prompt"], default="kv",
                   help="kv: inject memory KV; prompt: the Mem0-style baseline")
    p.add_argument("--host", default=None,
                   help="address to bind (default: INFERSCALE_HOST, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None,
                   help="port to listen on (default: INFERSCALE_PORT, 8000)")
    p.add_argument("--replicas", type=_positive, default=None, metavar="N",
                   help="serve with N memory replicas on Ray Serve (a local Ray instance), "
                   "each user's requests routed to the replica holding its memory; "
                   "default: one process, no Ray (docs/serving.md, 'Scaling out')")
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--artifact-root", default=None, help=root_help)
    p.set_defaults(func=cmd_serve)

    for name, func, help_ in (("hydrate", cmd_hydrate, "load users into a running server"),
                              ("evict", cmd_evict, "drop users from a running server")):
        p = sub.add_parser(name, help=help_, allow_abbrev=False)  # --admin-key is no option
        p.add_argument("users", nargs="+", help=f"ids of the users to {name}")
        p.add_argument("--url", default="http://127.0.0.1:8000", help=url_help)
        p.add_argument("--admin-key-file", default=None, help=key_help)
        if name == "hydrate":
            p.add_argument("--tier", choices=list(TIERS), default="gpu",
                           help="gpu: device memory; host: pinned host memory")
            p.add_argument("--version", default="latest",
                           help="version id to load, or 'latest' (the LATEST pointer)")
        p.set_defaults(func=func)
    p = sub.add_parser("status", help="what a running server holds", allow_abbrev=False)
    p.add_argument("--url", default="http://127.0.0.1:8000", help=url_help)
    p.add_argument("--admin-key-file", default=None, help=key_help)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("versions", help="a user's published versions (* = LATEST); "
                       "exit status 1 when there are none")
    p.add_argument("--user", required=True, help="id of the user whose versions to list")
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--artifact-root", default=None, help=root_help)
    p.set_defaults(func=cmd_versions)
    return ap


def main(argv: list[str] | None = None) -> int:
    offline_environment()
    args = build_parser().parse_args(argv)
    if getattr(args, "host", "x") is None:
        args.host = Settings().host
    if getattr(args, "port", 1) is None:
        args.port = Settings().port
    if args.func in (cmd_hydrate, cmd_evict, cmd_status):
        from inferscale.serve.admin_client import AdminError

        try:
            return args.func(args)
        except (AdminError, ValueError, OSError) as exc:  # OSError: an unreadable key file
            return _admin_failure(args, exc)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
