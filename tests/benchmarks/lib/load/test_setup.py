"""The load benchmark's setup (``benchmarks.lib.load.setup``): its flags checked across
each other, the peer's result read back (and refused when measured under other
settings), the server's memory-cache and cold-split settings, the reuse of published
users."""

from __future__ import annotations

import json

import pytest

from benchmarks.lib.load import setup


def test_cold_split_flag_is_checked_and_reaches_the_servers_config():
    p = setup.parser("load")
    assert setup.cold_split_settings(p.parse_args([])) == {"mode": "auto", "pinned_chunks": 0}
    assert setup.cold_split_settings(p.parse_args(["--cold-split", "pinned:7"])) == \
        {"mode": "pinned", "pinned_chunks": 7}
    for bad in ("pinned", "pinned:x", "off:3", "sometimes"):
        with pytest.raises(SystemExit):
            p.parse_args(["--cold-split", bad])


def _setup_args(conversations):
    ap = setup.parser("test")
    return ap, lambda *more: setup.resolve(
        ap, ap.parse_args(["--conversations", conversations[0], "--top-k", "5", *more]), False)


def test_the_peer_result_is_read_and_refused_under_other_settings(tmp_path, conversations):
    _, resolve = _setup_args(conversations)
    peer = {"command": "python -m benchmarks.load --peer", "model": "embedded", "top_k": 5,
            "max_tokens": 32, "objective_ms": 1000.0, "requests_per_step": 50, "zipf": 1.0,
            "facts_per_user": 400, "summary": {"goodput_peer_rps": 6.0}}
    path = tmp_path / "peer.json"
    path.write_text(json.dumps(peer))
    args = resolve("--peer-result", str(path), "--modes", "kv")
    assert args.peer_goodput == 6.0 and str(path) in args.peer_source
    assert args.peer_lower_bound is False
    path.write_text(json.dumps({**peer, "summary": {"goodput_peer_rps": 10.0,
                                                    "peer": {"lower_bound": True}}}))
    assert resolve("--peer-result", str(path)).peer_lower_bound is True
    path.write_text(json.dumps({**peer, "top_k": 50}))
    with pytest.raises(SystemExit):
        resolve("--peer-result", str(path))
    path.write_text(json.dumps({"summary": {}}))
    with pytest.raises(SystemExit):
        resolve("--peer-result", str(path))
    path.write_text(json.dumps({**peer, "summary": {"goodput_peer_rps": None}}))
    with pytest.raises(SystemExit):  # its run measured no step: no goodput, not 0
        resolve("--peer-result", str(path))
    with pytest.raises(SystemExit):  # the peer run itself takes no peer goodput
        resolve("--peer", "--peer-goodput", "3")
    assert resolve("--peer").modes == ["peer"]
    with pytest.raises(SystemExit):  # KV alone needs some baseline's goodput
        resolve("--modes", "kv")
    assert resolve("--modes", "kv", "--peer-goodput", "6").peer_goodput == 6.0


def test_memory_cache_settings_build_the_servers_config(tmp_path, conversations):
    from inferscale.serve.memory_cache import MemoryCacheConfig

    _, resolve = _setup_args(conversations)
    cfg = MemoryCacheConfig(**setup.memory_cache_settings(resolve()))
    assert cfg.budget_bytes == 8 << 30 and cfg.misses_per_s >= 1e6  # never shed by default


def test_published_users_are_reused_only_with_the_same_settings(tmp_path, conversations):
    _, resolve = _setup_args(conversations)
    args = resolve("--reuse-memory", "--groups", "2")
    assert setup.reused_memory(args, tmp_path, 10) is None  # nothing published yet
    (tmp_path / setup.MEMORY_FILE).write_text(json.dumps(
        {"key": setup.memory_key(args, 10), "versions": {"load-0000": {"version": "v"}}}))
    assert setup.reused_memory(args, tmp_path, 10)["versions"]["load-0000"]["version"] == "v"
    with pytest.raises(ValueError, match="groups, users"):
        setup.reused_memory(resolve("--reuse-memory", "--groups", "3"), tmp_path, 12)
    assert setup.reused_memory(resolve(), tmp_path, 12) is None  # not asked to reuse


def test_the_users_memory_dtype_defaults_to_what_the_encoder_stores(conversations,
                                                                    monkeypatch):
    """fp8 on CUDA, bf16 on the CPU (INFERSCALE_KV_DTYPE=auto); the flag or an explicit
    setting wins; a setting the benchmark cannot build users in is refused."""
    ap = setup.parser("test")

    def resolve(cuda, *more):
        return setup.resolve(ap, ap.parse_args(
            ["--conversations", conversations[0], "--modes", "kv", "--peer-goodput", "4",
             *more]), cuda).memory_dtype

    monkeypatch.delenv("INFERSCALE_KV_DTYPE", raising=False)
    assert (resolve(True), resolve(False)) == ("float8_e4m3fn", "bfloat16")
    assert resolve(True, "--memory-dtype", "bfloat16") == "bfloat16"
    monkeypatch.setenv("INFERSCALE_KV_DTYPE", "bfloat16")
    assert resolve(True) == "bfloat16"
    monkeypatch.setenv("INFERSCALE_KV_DTYPE", "float32")
    with pytest.raises(SystemExit):
        resolve(True)
