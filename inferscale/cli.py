"""``inferscale``: the command line.

    inferscale encode --logs URI    logs -> facts -> KV -> published artifacts (one process)
    inferscale serve [--mode kv|prompt] [--host H] [--port P] [--replicas N]
    inferscale hydrate|evict|status talk to a running server's admin API
    inferscale versions --user U    list a user's published versions

Settings come from ``INFERSCALE_*`` environment variables (``inferscale.settings``);
flags override the few that matter per command. ``encode`` runs the offline chain of
:mod:`inferscale.pipeline.chain` without Prefect (the flows run the same chain as tasks);
the demo, which runs a Prefect flow, is ``inferscale-demo`` (``flows/demo.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from inferscale.settings import Settings, offline_environment
from inferscale.types import ENCODER_CONTEXTS, TIERS

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
    """The run report as JSON on stdout; exit status 1 when a user failed (the others are
    published all the same), 2 when the logs or the users asked for cannot be read."""
    from functools import partial

    from inferscale.ingest.logs import LogError, sample_conversations
    from inferscale.pipeline import steps
    from inferscale.pipeline.chain import Steps, run
    from inferscale.pipeline.config import configs_from_settings

    settings = _settings(args)
    logs = args.logs or settings.log_uris or [str(sample_conversations())]
    cfg, facts_cfg = configs_from_settings(settings)
    try:
        report = run(cfg, facts_cfg, logs, users=args.users, quarantine_uri=args.quarantine,
                     steps=Steps(encode=partial(steps.encode_user_kv, progress=True)))
    except (LogError, ValueError) as exc:
        print(f"inferscale encode: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2))
    if report.failed:
        print(f"inferscale encode: {len(report.failed)} of {len(report.outcomes)} users "
              f"failed: {', '.join(o.user for o in report.failed[:10])}", file=sys.stderr)
        return 1
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
    from inferscale.models import checkpoint_fingerprint, resolve_checkpoint

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

    p = sub.add_parser("encode", help="logs -> facts -> KV -> artifacts, in this process; "
                       "exit status 1 when some user failed")
    p.add_argument("--logs", nargs="+", default=None,
                   help="fsspec URIs/globs of conversation logs (default: INFERSCALE_LOG_URIS, "
                   "else the sample)")
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
