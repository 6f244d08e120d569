"""``inferscale``: the command line.

    inferscale encode --logs URI    logs -> facts -> KV -> published artifacts (one process)
    inferscale serve [--mode kv|prompt] [--host H] [--port P] [--replicas N]
    inferscale hydrate|evict|status talk to a running server's admin API
    inferscale versions --user U    list a user's published versions
    inferscale --version

Settings come from ``INFERSCALE_*`` environment variables (``inferscale.settings``);
flags override the few that matter per command, and ``--help`` shows each default and
its value now. Bad input and bad settings are one line on stderr and exit status 2,
found before anything heavy is loaded (``serve`` checks its settings and access policy
before vLLM or Ray is imported); a failed admin call is one line and exit status 1.
``encode`` runs the offline chain of :mod:`inferscale.pipeline.chain` without Prefect
(the flows run the same chain as tasks) and prints the run's log, each version's lineage
included, on stderr; the demo, which runs a Prefect flow, is ``inferscale-demo``
(``flows/demo.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterator, NoReturn

from inferscale import __version__
from inferscale.settings import Settings, offline_environment, settings_problem
from inferscale.types import ENCODER_CONTEXTS, HYDRATE_TARGETS


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


def _store(settings: Settings):
    """The settings' artifact store; a local root that is a file is refused here rather
    than at the first read below it."""
    from inferscale.artifacts.layout import StoreConfig

    store = StoreConfig.from_settings(settings)
    if store.is_local and os.path.exists(store.root) and not os.path.isdir(store.root):
        raise NotADirectoryError(f"artifact root {store.root} is not a directory")
    return store


@contextlib.contextmanager
def _run_log() -> Iterator[None]:
    """The library's log at INFO on stderr while a command runs (the chain's progress and
    each version's lineage record)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("inferscale")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# ---------------------------------------------------------------------------- commands


def cmd_encode(args: argparse.Namespace, settings: Settings) -> int:
    """The run report as JSON on stdout, the run's log on stderr; exit status 1 when a
    user failed (the others are published all the same), 2 when the logs or the users
    asked for cannot be read."""
    from functools import partial

    from inferscale.ingest.logs import LogError, sample_conversations
    from inferscale.pipeline import steps
    from inferscale.pipeline.chain import Steps, run
    from inferscale.pipeline.config import configs_from_settings

    _store(settings)
    logs = args.logs or settings.log_uris or [str(sample_conversations())]
    cfg, facts_cfg = configs_from_settings(settings)
    try:
        with _run_log():
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


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.serve.access import policy_from

    policy_from(settings, args.host)  # ServeError: refused before vLLM or Ray is imported
    _store(settings)
    if args.replicas is not None:  # Ray Serve: N memory replicas behind one endpoint
        from inferscale.serve.replicas import run_replicas

        overrides = {k: getattr(args, k) for k in ("model", "artifact_root")
                     if getattr(args, k) is not None}
        run_replicas(settings, args.mode, args.host, args.port, args.replicas, overrides)
        return 0
    from inferscale.serve.server import serve_forever

    asyncio.run(serve_forever(settings, args.mode, args.host, args.port))
    return 0


def _admin(args: argparse.Namespace, settings: Settings):
    """The admin client: the key from ``--admin-key-file`` or INFERSCALE_ADMIN_KEY (never
    from the command line, where ``ps`` shows it), sent only to a configured server."""
    from inferscale.serve.admin_client import admin_client_for

    if args.url is None:  # kept in args: a failure names the URL
        args.url = settings.server_url()
    if args.admin_key_file:
        key = Path(args.admin_key_file).read_text().strip() or None
    else:
        key = settings.admin_key.get_secret_value() if settings.admin_key else None
    return admin_client_for(args.url, key, settings.admin_urls())


def cmd_hydrate(args: argparse.Namespace, settings: Settings) -> int:
    client = _admin(args, settings)
    for user in args.users:
        print(json.dumps(client.hydrate(user, tier=args.tier, version=args.version)))
    return 0


def cmd_evict(args: argparse.Namespace, settings: Settings) -> int:
    client = _admin(args, settings)
    for user in args.users:
        print(json.dumps(client.evict(user)))
    return 0


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    print(json.dumps(_admin(args, settings).status(), indent=2))
    return 0


def _admin_failure(args: argparse.Namespace, exc: Exception) -> int:
    """One line on stderr for a failed admin call; exit status 1."""
    from inferscale.serve.admin_client import AdminError

    if isinstance(exc, AdminError) and exc.status is None:
        cause = exc.__cause__ or exc
        return _fail(args, f"no server answers at {args.url} ({type(cause).__name__}: "
                           f"{cause})", 1)
    return _fail(args, str(exc), 1)


def cmd_versions(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.artifacts.read import latest_version, list_versions
    from inferscale.models import checkpoint_fingerprint, resolve_checkpoint

    store = _store(settings)
    fp = checkpoint_fingerprint(resolve_checkpoint(settings.model, settings.home), settings.home)
    latest = latest_version(store, args.user, fp)
    found = list_versions(store, args.user, fp)
    if not found:
        return _fail(args, f"no versions of user {args.user!r} for model {fp} under "
                           f"{store.root}", 1)
    for m in found:
        mark = "*" if m.version == latest else " "
        print(f"{mark} {m.version}  created {m.created}  facts {m.counts.get('facts')}  "
              f"kv {m.files['kv.arrow'].bytes} B  parents log={m.parents.get('log', '')[:12]} "
              f"facts={m.parents.get('facts', '')[:12]}")
    return 0


ADMIN_COMMANDS = (cmd_hydrate, cmd_evict, cmd_status)


def _fail(args: argparse.Namespace, message: str, status: int = 2) -> int:
    """``message`` as one line on stderr, after the command's name; the exit status."""
    print(f"inferscale {args.command}: {' '.join(message.split())}", file=sys.stderr)
    return status


def _refused_input(exc: Exception) -> bool:
    """Whether ``exc`` is bad input, settings or surroundings (one line, no traceback)
    rather than a fault of InferScale (which keeps its traceback)."""
    from inferscale.artifacts.layout import ArtifactError
    from inferscale.models import ModelError
    from inferscale.serve.access import ServeError

    return isinstance(exc, (ValueError, OSError, ArtifactError, ModelError, ServeError))


# ---------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """A usage error is one line: what is wrong and where to read more (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Appends an option's default, unless it has none of its own here (it comes from the
    settings, and the help says which and its value now)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _current_settings() -> Settings | None:
    """The settings as the environment has them, for ``--help`` (None when they are bad:
    the command then says what is wrong)."""
    try:
        return Settings()
    except ValueError:
        return None


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _non_negative(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def _user_id(text: str) -> str:
    from inferscale.types import InvalidUserIdError, check_user_id

    try:
        return check_user_id(text)
    except InvalidUserIdError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    now = _current_settings()

    def default(source: str, value: Any = None) -> str:
        """``(default: SOURCE; now VALUE)``, VALUE read from the settings now."""
        shown = f"; now {value(now)}" if now is not None and value else ""
        return f"(default: {source}{shown})"

    ap = _Parser(prog="inferscale", formatter_class=_Help, description="InferScale: "
                 "encode users' memory as KV, serve it, manage a running server. Settings "
                 "are INFERSCALE_* environment variables; each command's --help shows its "
                 "defaults.")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    parser = lambda name, **kw: sub.add_parser(name, formatter_class=_Help, **kw)  # noqa: E731
    root_help = ("artifact store root: a directory or s3://bucket/prefix " + default(
        "INFERSCALE_ARTIFACT_ROOT, else INFERSCALE_HOME/artifacts",
        lambda s: s.resolved_artifact_root()))
    model_help = ("serving model: 'embedded' (SmolLM2), a checkpoint directory or a hub id "
                  + default("INFERSCALE_MODEL", lambda s: s.model))
    url_help = ("root URL of the running server (inferscale serve) " + default(
        "http://INFERSCALE_HOST:INFERSCALE_PORT, a wildcard host reached on loopback",
        lambda s: s.server_url()))
    key_help = ("file holding the admin key the server wants off loopback (default: "
                "INFERSCALE_ADMIN_KEY); sent only to INFERSCALE_SERVER_URLS, by default "
                "this host's configured server")

    p = parser("encode", help="logs -> facts -> KV -> artifacts, in this process; "
               "exit status 1 when some user failed")
    p.add_argument("--logs", nargs="+", default=None,
                   help="fsspec URIs/globs of conversation logs (default: INFERSCALE_LOG_URIS, "
                   "else the sample)")
    p.add_argument("--users", nargs="+", type=_user_id, default=None,
                   help="user ids to encode (default: every user in the logs)")
    p.add_argument("--fact-mode", choices=["raw", "mem0"], default=None,
                   help="raw: each turn is a fact; mem0: LLM extraction "
                   + default("INFERSCALE_FACT_MODE", lambda s: s.fact_mode))
    p.add_argument("--window", type=_non_negative, default=None,
                   help="turns of context encoded before each fact "
                   + default("INFERSCALE_WINDOW", lambda s: s.window))
    p.add_argument("--context", choices=list(ENCODER_CONTEXTS), default=None,
                   help="what each fact is encoded after: memory = the serving prefix and the "
                   "window as memory lines; transcript = the raw window (the original "
                   "encoder) " + default("INFERSCALE_ENCODER_CONTEXT",
                                         lambda s: s.encoder_context))
    p.add_argument("--text-tail", type=_non_negative, default=None,
                   help="best facts a request prefills as text right before the question "
                   "instead of injecting them " + default("INFERSCALE_TEXT_TAIL",
                                                          lambda s: s.text_tail))
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--artifact-root", default=None, help=root_help)
    p.add_argument("--quarantine", default=None,
                   help="where rejected records go, JSONL (default: none written)")
    p.set_defaults(func=cmd_encode)

    p = parser("serve", help="OpenAI-compatible server answering from user memory")
    p.add_argument("--mode", choices=["kv", "prompt"], default="kv",
                   help="kv: inject memory KV; prompt: the Mem0-style baseline")
    p.add_argument("--host", default=None, help="address to bind "
                   + default("INFERSCALE_HOST", lambda s: s.host))
    p.add_argument("--port", type=int, default=None, help="port to listen on "
                   + default("INFERSCALE_PORT", lambda s: s.port))
    p.add_argument("--replicas", type=_positive, default=None, metavar="N",
                   help="serve with N memory replicas on Ray Serve (a local Ray instance), "
                   "each user's requests routed to the replica holding its memory "
                   "(default: one process, no Ray; docs/serving.md, 'Scaling out')")
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--artifact-root", default=None, help=root_help)
    p.set_defaults(func=cmd_serve)

    for name, func, help_ in (("hydrate", cmd_hydrate, "load users into a running server"),
                              ("evict", cmd_evict, "drop users from a running server")):
        p = parser(name, help=help_, allow_abbrev=False)  # --admin-key is no option
        p.add_argument("users", nargs="+", type=_user_id, help=f"ids of the users to {name}")
        p.add_argument("--url", default=None, help=url_help)
        p.add_argument("--admin-key-file", default=None, help=key_help)
        if name == "hydrate":
            p.add_argument("--tier", choices=list(HYDRATE_TARGETS), default="gpu",
                           help="gpu: device memory; host: pinned host memory; facts: only "
                                "the facts and retrieval index (the KV stays in storage)")
            p.add_argument("--version", default="latest",
                           help="version id to load, or 'latest' (the LATEST pointer)")
        p.set_defaults(func=func)
    p = parser("status", help="what a running server holds", allow_abbrev=False)
    p.add_argument("--url", default=None, help=url_help)
    p.add_argument("--admin-key-file", default=None, help=key_help)
    p.set_defaults(func=cmd_status)

    p = parser("versions", help="a user's published versions (* = LATEST); "
               "exit status 1 when there are none")
    p.add_argument("--user", required=True, type=_user_id,
                   help="id of the user whose versions to list")
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--artifact-root", default=None, help=root_help)
    p.set_defaults(func=cmd_versions)
    return ap


def main(argv: list[str] | None = None) -> int:
    offline_environment()
    args = build_parser().parse_args(argv)
    try:
        settings = _settings(args)
    except ValueError as exc:  # pydantic's ValidationError, pydantic-settings' SettingsError
        return _fail(args, f"bad settings: {settings_problem(exc)}")
    if getattr(args, "host", "") is None:
        args.host = settings.host
    if getattr(args, "port", 0) is None:
        args.port = settings.port
    try:
        return args.func(args, settings)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from inferscale.serve.admin_client import AdminError

        if args.func in ADMIN_COMMANDS and isinstance(exc, (AdminError, ValueError, OSError)):
            return _admin_failure(args, exc)  # OSError: an unreadable key file
        if not _refused_input(exc):
            raise
        return _fail(args, str(exc) or type(exc).__name__)


if __name__ == "__main__":
    sys.exit(main())
