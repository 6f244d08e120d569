"""``GET /metrics`` on the real engine: vLLM's engine metrics and the server's, scraped
before and after real requests through the official ``openai`` client; every counter
moves by exactly what those requests did (modes, injected tokens, fallbacks by reason,
background reloads, a failed load, residency, reads started ahead of their requests and
the facts of users in neither tier)."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.engine]

FACTS = ["The user's dog is named Pelican.", "The user lives in a small town by the sea.",
         "The user plays the cello on Sundays."]


def scrape(http) -> dict[tuple[str, tuple], float]:
    """``/metrics`` parsed with prometheus_client's own parser: (sample, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def value(m: dict, name: str, **labels) -> float:
    want = {k: str(v) for k, v in labels.items()}
    return sum(v for (n, lab), v in m.items()
               if n == name and all(dict(lab).get(k) == x for k, x in want.items()))


def delta(after: dict, before: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def settled(http) -> dict:
    """A scrape once vLLM has recorded every request that finished before it (its stat
    loggers run just after a request's last output is handed over)."""
    last = scrape(http)
    while True:
        time.sleep(0.5)
        now = scrape(http)
        if value(now, "vllm:request_success_total") == value(last, "vllm:request_success_total"):
            return now
        last = now


def test_metrics_count_what_the_requests_did(engine_env, embedder):
    import httpx
    import openai

    from engine_helpers import limiting_memory, served_app
    from inferscale.artifacts.publish import Lineage, publish
    from inferscale.serve.access import AccessPolicy
    from inferscale.serve.cold_split import ColdSplitConfig
    from inferscale.serve.server import ServerConfig, build_server

    env = engine_env
    tok, model, fp = env.model.tokenizer, env.model.model, env.model.fingerprint

    def publish_user(user: str, lineage: str = "1", facts=FACTS) -> str:
        mem, table = limiting_memory(model, tok, user, facts, fp, embedder)
        return publish(env.store, user, mem, table, Lineage(f"log-{user}-{lineage}", "f"),
                       embeddings=False).version

    users = ("mx-ann", "mx-cold", "mx-faulty", "mx-stale")
    for user in users:
        publish_user(user)
    # every chunk of a user in neither tier read from storage (prefetched ahead of the
    # request); the automatic split's choice depends on timings
    server = build_server(env.engine, tok, embedder, env.store, ServerConfig(
        top_k=3, cold=ColdSplitConfig(mode="pinned", pinned_chunks=100)))
    msg = [{"role": "user", "content": "What is the name of my dog?"}]
    with served_app(env.loop, server, AccessPolicy({}, None, None, loopback=True)) as url:
        http = httpx.Client(base_url=url, trust_env=False, timeout=300)
        for user in ("mx-ann", "mx-faulty", "mx-stale"):
            assert http.post("/admin/hydrate", json={"user": user}).status_code == 200
        # the stale user: the workers move on to a newer version the server has not read
        v2 = publish_user("mx-stale", "2", FACTS[:2])
        env.loop.run(env.engine.hydrate("mx-stale", version=v2))
        assert env.loop.run(env.engine.llm.collective_rpc(
            "inferscale_fault_drop_slab", args=("mx-faulty",))) == [True]
        env.loop.run(env.engine.llm.reset_prefix_cache())
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        before = settled(http)
        assert value(before, "inferscale_requests_total") == 0  # a new server counts from 0

        infos, usage = [], []

        def ask(user, mode="kv", stream=False):
            extra = {"inferscale": {"mode": mode}, "ignore_eos": True}
            if not stream:
                r = client.chat.completions.create(model="smollm2", messages=msg, user=user,
                                                   max_tokens=6, extra_body=extra)
                infos.append(r.model_extra["inferscale"])
                usage.append(r.usage.completion_tokens)
                return
            info = None
            for c in client.chat.completions.create(
                    model="smollm2", messages=msg, user=user, max_tokens=6, stream=True,
                    stream_options={"include_usage": True}, extra_body=extra):
                info = (c.model_extra or {}).get("inferscale") or info
                if c.usage:
                    usage.append(c.usage.completion_tokens)
            infos.append(info)

        ask("mx-ann")
        ask("mx-ann", stream=True)
        ask("mx-ann")
        ask("mx-ann", mode="prompt")
        ask("mx-nobody")  # no artifact: answered from the question alone
        ask("mx-cold")  # published, never hydrated: its facts read from storage, injected
        ask("mx-faulty")  # its slab lost its data: the load fails, vLLM recomputes
        ask("mx-stale")  # the server's version supersedes the workers': read from storage
        modes = [i["mode"] for i in infos]
        assert modes == ["kv"] * 3 + ["prompt", "none"] + ["kv"] * 3
        assert all(i["injected_tokens"] > 0 and "fallback" not in i for i in infos[:3])
        assert all(i["facts_by_tier"] == {"gpu": 3} for i in infos[:3])
        assert [i.get("fallback_reason") for i in infos[5:]] == [None, "load_error", None]
        for i in (infos[5], infos[7]):  # the two users in neither tier (for that version)
            assert i["injected_tokens"] > 0 and i["facts_by_tier"] == {"storage": 3}
            assert i["storage_bytes"] > 0
            assert (i["cold"]["facts_loaded"], i["cold"]["facts_computed"]) == (3, 0)
            assert i["cold"]["bytes_read"] == i["storage_bytes"]
        assert all("cold" not in i for i in infos[:5] + [infos[6]])
        assert len(usage) == 8 and all(u == 6 for u in usage)

        deadline = time.monotonic() + 120  # the two reloads, and vLLM's last stats, land
        while True:
            after = scrape(http)
            if delta(after, before, "inferscale_reloads_total") >= 2 and \
                    delta(after, before, "vllm:request_success_total") >= 8:
                break
            assert time.monotonic() < deadline, "no reload / vLLM stats after 120 s"
            time.sleep(0.5)

        # per request, in the API process
        for mode, n in (("kv", 6), ("prompt", 1), ("none", 1)):
            assert delta(after, before, "inferscale_requests_total", mode=mode) == n
            assert delta(after, before, "inferscale_completion_tokens_total", mode=mode) == 6 * n
            assert delta(after, before, "inferscale_query_to_first_token_seconds_count",
                         mode=mode) == n
        injected = sum(i["injected_tokens"] for i in infos)
        assert delta(after, before, "inferscale_injected_memory_tokens_total") == injected
        assert delta(after, before, "inferscale_memory_tokens_total", mode="kv") == \
            sum(i["memory_tokens"] for i in infos if i["mode"] == "kv")
        assert delta(after, before, "inferscale_text_tail_tokens_total") == 0
        assert {r: delta(after, before, "inferscale_fallbacks_total", reason=r)
                for r in ("not_resident", "load_error", "stale_version", "token_mismatch",
                          "fingerprint_mismatch", "connector_error", "other")} == {
            "not_resident": 0, "load_error": 1, "stale_version": 0, "token_mismatch": 0,
            "fingerprint_mismatch": 0, "connector_error": 0, "other": 0}
        for name in ("inferscale_retrieval_seconds_count", "inferscale_composition_seconds_count"):
            assert delta(after, before, name) == 7  # every request with memory
        # in the worker, read at scrape time
        assert delta(after, before, "inferscale_worker_loaded_tokens_total") == injected
        assert delta(after, before, "inferscale_worker_load_failures_total") == 1
        assert delta(after, before, "inferscale_memory_facts_total", tier="gpu") == 9
        assert delta(after, before, "inferscale_memory_facts_total", tier="storage") == 6
        read = infos[5]["storage_bytes"] + infos[7]["storage_bytes"]
        assert delta(after, before, "inferscale_storage_read_bytes_total") == read
        assert delta(after, before, "inferscale_fetch_seconds_count") == 2
        assert delta(after, before, "inferscale_fetch_failures_total") == 0
        # mx-cold read ahead of its request; the users the server hydrated ask for no
        # prefetch (it knows where it put them), so mx-stale, whose newer version the
        # workers got behind the server's back, is read once the engine schedules it
        assert {o: delta(after, before, "inferscale_prefetches_total", outcome=o)
                for o in ("started", "adopted", "resident", "dropped")} == {
            "started": 1, "adopted": 1, "resident": 0, "dropped": 0}
        # the split of those two: every fact loaded
        assert delta(after, before, "inferscale_cold_requests_total") == 2
        assert {src: delta(after, before, "inferscale_cold_facts_total", source=src)
                for src in ("storage", "prefill")} == {"storage": 6, "prefill": 0}
        assert delta(after, before, "inferscale_cold_read_bytes_total") == read
        assert delta(after, before, "inferscale_cold_split_fraction_count") == 2
        assert delta(after, before, "inferscale_cold_split_fraction_bucket", le="0.9") == 0
        assert value(after, "inferscale_storage_bandwidth_bytes_per_second") > 0
        assert value(after, "inferscale_cold_split_estimate", quantity="wait_seconds") >= 0
        # every busy step timed; the injections timed too
        assert delta(after, before, "inferscale_engine_step_seconds_count") >= 8 * 5
        assert delta(after, before, "inferscale_inject_kernel_seconds_count") >= 5
        assert delta(after, before, "inferscale_connector_seconds_total", side="worker") > 0
        # mx-cold into the host tier, mx-stale's served version over the workers' one
        assert delta(after, before, "inferscale_reloads_total") == 2
        assert delta(after, before, "inferscale_reload_seconds_count") == 2
        assert delta(after, before, "inferscale_reload_failures_total") == 0
        status = http.get("/admin/status").json()["engine"]
        for tier in ("gpu", "host"):
            held = [r for r in status["residents"] if r["tier"] == tier]
            assert value(after, "inferscale_resident_users", tier=tier) == len(held)
            assert value(after, "inferscale_resident_bytes", tier=tier) == \
                sum(r["bytes"] for r in held)
        assert "mx-cold" in {r["user"] for r in status["residents"] if r["tier"] == "host"}
        # vLLM's own engine metrics, from the same endpoint
        assert delta(after, before, "vllm:request_success_total") == 8
        assert delta(after, before, "vllm:generation_tokens_total") == 8 * 6
        for user in users:
            http.post("/admin/evict", json={"user": user})
