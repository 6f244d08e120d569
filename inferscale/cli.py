"""``inferscale``: the command line.

    inferscale demo                 encode the sample conversation, serve, compare answers
    inferscale encode --logs URI    logs -> facts -> KV -> published artifacts (one process)
    inferscale serve [--mode kv|prompt] [--host H] [--port P]
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
        "fact_mode": getattr(args, "fact_mode", None),
    }.items() if v is not None}
    return Settings(**overrides)


# ---------------------------------------------------------------------------- commands


def cmd_encode(args: argparse.Namespace) -> int:
    from inferscale.facts import FactsConfig
    from inferscale.logs import sample_conversations
    from inferscale.pipeline import PipelineConfig, run

    settings = _settings(args)
    logs = args.logs or [str(sample_conversations())]
    result = run(PipelineConfig.from_settings(settings), FactsConfig.from_settings(settings),
                 logs, users=args.users, quarantine_uri=args.quarantine)
    print(json.dumps(result, indent=2))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from inferscale.serve import ServeError, serve_forever

    try:
        asyncio.run(serve_forever(_settings(args), args.mode, args.host, args.port))
    except ServeError as exc:
        print(f"inferscale serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _admin(args: argparse.Namespace):
    """The admin client: the key from ``--admin-key-file`` or INFERSCALE_ADMIN_KEY (never
    from the command line, where ``ps`` shows it), sent only to a configured server."""
    from inferscale.admin_client import admin_client_for

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


def cmd_versions(args: argparse.Namespace) -> int:
    from inferscale.artifacts import latest_version, list_versions
    from inferscale.models import checkpoint_fingerprint, resolve_checkpoint
    from inferscale.store import StoreConfig

    settings = _settings(args)
    store = StoreConfig.from_settings(settings)
    fp = checkpoint_fingerprint(resolve_checkpoint(settings.model, settings.home), settings.home)
    latest = latest_version(store, args.user, fp)
    for m in list_versions(store, args.user, fp):
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
    from inferscale.logs import sample_conversations

    print(f"[1/3] encode flow (Prefect, in-process): sample conversation -> facts ({args.fact_mode})"
          f" -> pre-RoPE KV (window {settings.window}) -> artifacts under {root}", flush=True)
    report = encode_users(logs=[str(sample_conversations())], fact_mode=args.fact_mode,
                          artifact_root=root)
    print(_report_lines(report), flush=True)
    settings = Settings(artifact_root=root, model=settings.model, window=settings.window)
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

    from inferscale.serve import AccessPolicy, create_app, start_server

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
    finally:
        web.should_exit = True
        await serving
        server.engine.shutdown()
    return 0


# ---------------------------------------------------------------------------- parser


ADMIN_KEY_HELP = ("file holding the admin key (default: INFERSCALE_ADMIN_KEY); sent only to "
                  "INFERSCALE_SERVER_URLS")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="inferscale", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="encode the sample conversation, serve it, compare answers")
    p.add_argument("--fact-mode", choices=["raw", "mem0"], default="raw",
                   help="raw: each turn is a fact (fast); mem0: LLM extraction (slow on CPU)")
    p.add_argument("--artifact-root", default=None)
    p.add_argument("--questions", type=int, default=len(DEMO_QUESTIONS))
    p.add_argument("--max-tokens", type=int, default=40)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("encode", help="logs -> facts -> KV -> artifacts, in this process")
    p.add_argument("--logs", nargs="+", default=None, help="fsspec URIs/globs (default: sample)")
    p.add_argument("--users", nargs="+", default=None)
    p.add_argument("--fact-mode", choices=["raw", "mem0"], default=None)
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--artifact-root", default=None)
    p.add_argument("--quarantine", default=None, help="where rejected records go (JSONL)")
    p.set_defaults(func=cmd_encode)

    p = sub.add_parser("serve", help="OpenAI-compatible server answering from user memory")
    p.add_argument("--mode", choices=["kv", "prompt"], default="kv",
                   help="kv: inject memory KV; prompt: the Mem0-style baseline")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--artifact-root", default=None)
    p.set_defaults(func=cmd_serve)

    for name, func, help_ in (("hydrate", cmd_hydrate, "load users into a running server"),
                              ("evict", cmd_evict, "drop users from a running server")):
        p = sub.add_parser(name, help=help_, allow_abbrev=False)  # --admin-key is no option
        p.add_argument("users", nargs="+")
        p.add_argument("--url", default="http://127.0.0.1:8000")
        p.add_argument("--admin-key-file", default=None, help=ADMIN_KEY_HELP)
        if name == "hydrate":
            p.add_argument("--tier", choices=["gpu", "host"], default="gpu")
            p.add_argument("--version", default="latest")
        p.set_defaults(func=func)
    p = sub.add_parser("status", help="what a running server holds", allow_abbrev=False)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--admin-key-file", default=None, help=ADMIN_KEY_HELP)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("versions", help="a user's published versions (* = LATEST)")
    p.add_argument("--user", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--artifact-root", default=None)
    p.set_defaults(func=cmd_versions)
    return ap


def main(argv: list[str] | None = None) -> int:
    offline_environment()
    args = build_parser().parse_args(argv)
    if getattr(args, "host", "x") is None:
        args.host = Settings().host
    if getattr(args, "port", 1) is None:
        args.port = Settings().port
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
