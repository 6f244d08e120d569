"""The peer, stock vLLM under the same load (``benchmarks.lib.load.peer``): its ``vllm
serve`` command and the effective config it reports, and its prompts, composed by the
library exactly as InferScale's prompt mode composes them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np

from benchmarks.lib.load.peer import PeerPrompts, peer_argv, serve_entry, server_config


def test_vllm_serve_command_and_its_config_from_the_log(tmp_path):
    memory = {"server": {"engine": {"model": "/w/llama-3.1-8b-shape"}, "tokenizer": "/w/tok"}}
    args = SimpleNamespace(model="llama-3.1-8b-shape", peer_serve_args="")
    argv = peer_argv(args, memory, 8123)
    assert argv[1:3] == ["-m", serve_entry()[1]] and argv[4:6] == ["/w/llama-3.1-8b-shape",
                                                                    "--tokenizer"]
    assert argv[-2:] == ["--load-format", "dummy"] and "--port" in argv
    real = peer_argv(SimpleNamespace(model="embedded", peer_serve_args="--max-model-len 4096"),
                     memory, 8123)
    assert "--load-format" not in real and real[-2:] == ["--max-model-len", "4096"]

    class NoServerInfo:  # a server without the dev endpoints answers 404
        def get(self, path):
            return (200, json.dumps({"version": "0.26.0"})) if path == "/version" else (404, "")

    log = tmp_path / "peer.log"
    log.write_text("INFO ... Chunked prefill is enabled with max_num_batched_tokens=8192.\n")
    cfg = server_config(NoServerInfo(), log)
    assert cfg == {"vllm_version": "0.26.0", "scheduler": {"max_num_batched_tokens": 8192},
                   "scheduler_source": "the server's log"}


def test_peer_prompts_are_the_prompt_modes(published, tokenizer, embedder):
    """The peer's prompt for (user, question) is the token ids the prompt mode composes:
    the same published facts, retrieval and composer."""
    from inferscale.compose import Composer
    from inferscale.models import resolve_checkpoint
    from inferscale.settings import Settings

    tok_dir = resolve_checkpoint("embedded", Settings().home)
    pool, embeddings, groups, versions = (published.pool, published.embeddings,
                                          published.groups, published.versions)
    memory = {"server": {"engine": {"artifact_root": published.store.root,
                                    "model_fingerprint": published.fp},
                         "tokenizer": str(tok_dir)}}
    prompts = PeerPrompts(SimpleNamespace(top_k=3), memory, embedder)
    question = "c0 question 1?"
    prompts.compose([(0.1, "load-0001", question), (0.2, "load-0001", question)])
    ids, info = prompts.composed[("load-0001", question)]
    assert len(prompts.composed) == 1
    assert info["user"] == "load-0001" and info["version"] == versions["load-0001"]["version"]
    assert info["mode"] == "prompt" and len(info["facts"]) == 3
    # the same prompt, independently: the top 3 of the user's facts by cosine, as text
    q = embedder.embed([question])[0].float().cpu().numpy()
    group = groups[1]
    order = np.argsort(-(embeddings[group.turns] @ q))[:3]
    composer = Composer(tokenizer)
    expected, _ = composer.compose([composer.prefix_ids()] + [
        pool[group.turns[i]].token_ids for i in order], question, [])
    assert ids == expected


def test_the_peer_run_has_no_storage_tier_to_report(published, embedder):
    """The run against stock vLLM measures no storage (its memory carries none): it is
    built from that memory and reports nothing under ``storage`` (it once failed on the
    H100 with ``KeyError: 'storage'`` before its first step)."""
    import asyncio

    from inferscale.models import resolve_checkpoint
    from inferscale.settings import Settings
    from benchmarks.lib.load.peer import PeerRun

    memory = {"versions": published.versions, "questions": {}, "shares": {},
              "question_lengths": {},
              "server": {"engine": {"artifact_root": published.store.root,
                                    "model_fingerprint": published.fp, "model": "m"},
                         "tokenizer": str(resolve_checkpoint("embedded", Settings().home))}}
    args = SimpleNamespace(top_k=3, request_timeout_s=5.0, profile_dir=None, deadline_s=60.0)
    server = SimpleNamespace(url="http://127.0.0.1:9", proc=None)  # never contacted
    run = PeerRun(args, server, memory, 0.0, embedder)
    result: dict = {}
    asyncio.run(run.storage(result))
    assert run.measured is None and "storage" not in result
