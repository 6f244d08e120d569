"""``inferscale-demo`` (``make demo``): the main job on the embedded defaults, in one process.

1. the encode flow (Prefect, in-process with a temporary local server) on the sample
   conversation: facts, pre-RoPE KV, published artifacts where the ``inferscale`` command
   looks by default (:func:`demo_root`), so ``inferscale versions --user maya`` and
   ``inferscale serve`` find them afterwards;
2. serving: the vLLM engine with the InferScale connector and the OpenAI-compatible
   server on 127.0.0.1, both users hydrated through the admin API;
3. answers to a few questions, each with KV injection and with the prompt baseline on
   the same engine and retrieval. Exits non-zero when any KV answer was prefilled
   instead of injected.

No network, no keys, no GPU needed. It lives here, not in ``inferscale/``, because it
runs a Prefect flow and the library never imports Prefect.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys

from flows import use_prefect_home
from inferscale.ingest.logs import SAMPLE_QUESTIONS
from inferscale.settings import Settings

def demo(fact_mode: str = "raw", artifact_root: str | None = None,
         questions: int = len(SAMPLE_QUESTIONS), max_tokens: int = 40) -> int:
    """Encode the sample conversation with the encode flow, serve it, compare answers;
    the exit status."""
    settings = Settings()
    use_prefect_home(str(settings.home / "prefect"))
    root, why = demo_root(settings, artifact_root)
    report = publish_sample(fact_mode, root, settings.window)
    if report is None:
        return 1
    # on CPU a 1 GiB KV cache (the demo's prompts are ~400 tokens) instead of half the
    # host's memory: the engine starts sooner and fits a small CI machine
    kv_bytes = settings.kv_cache_memory_bytes or (
        None if settings.resolved_device().startswith("cuda") else 1 << 30)
    status = asyncio.run(_serve_and_ask(
        Settings(artifact_root=root, model=settings.model, window=settings.window,
                 kv_cache_memory_bytes=kv_bytes), questions, max_tokens))
    print(_next_steps(root, why), flush=True)
    return status


def demo_root(settings: Settings, explicit: str | None = None) -> tuple[str, str | None]:
    """Where the demo publishes, and why that is not the ``inferscale`` command's default
    root (None when it is).

    The default is the CLI's own root (``INFERSCALE_HOME/artifacts``), so the commands
    that follow the demo find its users without a flag. The demo never writes into a
    store it could damage: when ``INFERSCALE_ARTIFACT_ROOT`` names one (perhaps shared,
    perhaps S3), or when the default root already holds a sample user (maya, tomas)
    published from other logs, it uses ``INFERSCALE_HOME/demo/artifacts`` instead."""
    if explicit:
        same = _same_root(explicit, settings.resolved_artifact_root())
        return explicit, None if same else "--artifact-root named it"
    if settings.artifact_root:
        return str(settings.home / "demo" / "artifacts"), \
            "INFERSCALE_ARTIFACT_ROOT names a store of your own"
    root = settings.resolved_artifact_root()
    taken = _users_from_other_logs(settings, root)
    if taken:
        return str(settings.home / "demo" / "artifacts"), \
            f"{root} holds {', '.join(taken)} from other logs"
    return root, None


def _same_root(a: str, b: str) -> bool:
    from inferscale.artifacts.layout import StoreConfig

    return StoreConfig(a).root == StoreConfig(b).root


def _users_from_other_logs(settings: Settings, root: str) -> list[str]:
    """The sample's users whose ``LATEST`` under ``root`` (for the settings' model) was
    published from other logs, or cannot be read."""
    from inferscale.artifacts.layout import ArtifactError, StoreConfig
    from inferscale.artifacts.read import latest_version, read_manifest
    from inferscale.ingest.logs import read_logs, sample_conversations
    from inferscale.models import checkpoint_fingerprint, resolve_checkpoint

    store = StoreConfig(root)
    fp = checkpoint_fingerprint(resolve_checkpoint(settings.model, settings.home), settings.home)
    taken = []
    for user, log_hash in sorted(read_logs(str(sample_conversations())).turns_hashes().items()):
        try:
            latest = latest_version(store, user, fp)
            if latest and read_manifest(store, user, fp, latest).parents.get("log") != log_hash:
                taken.append(user)
        except (ArtifactError, OSError):
            taken.append(user)
    return taken


def publish_sample(fact_mode: str, root: str, window: int) -> dict | None:
    """Step 1: the encode flow on the sample conversation, publishing under ``root``; the
    run report, or None (said why) when a user failed."""
    from flows.encode import encode_users
    from flows.results import UsersFailed
    from inferscale.ingest.logs import sample_conversations

    print(f"[1/3] encode flow (Prefect, in-process): sample conversation -> facts ({fact_mode})"
          f" -> pre-RoPE KV (window {window}) -> artifacts under {root}", flush=True)
    try:
        report = encode_users(logs=[str(sample_conversations())], fact_mode=fact_mode,
                              artifact_root=root)
    except UsersFailed as exc:  # the flow ended Failed: the report says who and why
        print(_report_lines(exc.report), flush=True)
        print(f"inferscale-demo: {exc}", file=sys.stderr)
        return None
    print(_report_lines(report), flush=True)
    return report


def _next_steps(root: str, why: str | None) -> str:
    """What to try after the demo: the commands of the README, which find its users."""
    setup = "" if why is None else (f"  ({why}: the demo published under {root}; first\n"
                                    f"   export INFERSCALE_ARTIFACT_ROOT={root})\n")
    return ("\nNext (README, 'Using it'):\n" + setup
            + "  inferscale versions --user maya        # the published versions\n"
            "  inferscale serve                       # the OpenAI-compatible server\n"
            "  inferscale hydrate maya tomas ; inferscale status    # in another shell")


def _report_lines(report: dict) -> str:
    """The encode run's report (``RunReport.to_dict()``): one line per user."""
    keep = ("status", "version", "facts", "kv_bytes", "seconds", "error")
    return "\n".join(
        f"      {user}: " + "  ".join(f"{k}={str(v)[:16] if k == 'version' else v}"
                                     for k, v in row.items() if k in keep and v not in ("", None))
        for user, row in report["users"].items())


async def _serve_and_ask(settings: Settings, n_questions: int, max_tokens: int) -> int:
    import httpx
    import uvicorn
    from openai import AsyncOpenAI

    from inferscale.serve.access import AccessPolicy
    from inferscale.serve.app import create_app
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
            for user in sorted({u for u, _ in SAMPLE_QUESTIONS}):
                r = await http.post("/admin/hydrate", json={"user": user, "tier": "gpu"})
                r.raise_for_status()
                h = r.json()
                print(f"      hydrated {user}: version {h['version'][:12]}, {h['facts']} facts, "
                      f"{h['bytes'] / 2**20:.1f} MiB KV ({h['tier']} tier)", flush=True)
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key="local", http_client=None)
        print("[3/3] answers (greedy; KV injection vs. the Mem0-style prompt baseline, same "
              "retrieval, same engine, prefix cache reset before each)", flush=True)
        not_injected = []
        for user, question in SAMPLE_QUESTIONS[:n_questions]:
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
        server.close()  # stops the loop-lag probe first: no stall logged for the shutdown
    if not_injected:  # the demo's point is answers from injected memory: say it failed
        print("\ninferscale-demo: KV answers prefilled instead of injected:\n  "
              + "\n  ".join(not_injected), file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="inferscale-demo",
                                 description="encode the sample conversation (the encode flow, "
                                 "in-process), serve it, compare answers with the prompt "
                                 "baseline")
    ap.add_argument("--fact-mode", choices=["raw", "mem0"], default="raw",
                    help="raw: each turn is a fact (fast); mem0: LLM extraction (slow on CPU)")
    ap.add_argument("--artifact-root", default=None,
                    help="where the demo publishes (default: where the inferscale command "
                    "looks, INFERSCALE_HOME/artifacts, unless INFERSCALE_ARTIFACT_ROOT is "
                    "set or maya or tomas there came from other logs: then "
                    "INFERSCALE_HOME/demo/artifacts)")
    ap.add_argument("--questions", type=int, default=len(SAMPLE_QUESTIONS),
                    help=f"how many of the {len(SAMPLE_QUESTIONS)} sample questions to ask")
    ap.add_argument("--max-tokens", type=int, default=40, help="tokens per answer (greedy)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return demo(args.fact_mode, args.artifact_root, args.questions, args.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
