"""Memory replicas on Ray Serve (``inferscale serve --replicas N``).

Without Ray: the placement rule (rendezvous hashing over slots, the routing keys), where
Serve's proxies listen, the gateway's identity headers, a dead replica's shared memory
removed (real processes and segments). With real Ray Serve: the router on light replicas
(homes, the spill rule under overload, a killed replica's users moving to their second
choice and back to the restarted slot), the gateway over a light replica (no start
without keys while Serve's proxies listen beyond loopback), the config file. With real
vLLM CPU engines: two replicas (SmolLM2, 1 GiB KV cache each), four users, through the
OpenAI endpoint: every request on its user's home replica (counted from the replicas'
metrics), every answer injected, hydrate on the home, status of every replica, a stream
whose client goes aborted on its replica, a replica killed mid-run losing no request and
serving no cross-user memory, and ``/dev/shm``: the killed replica's segments removed
once it is back, every replica's unlinked at shutdown.
"""

from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from inferscale.serve.leftovers import SHM, segments_of
from inferscale.serve.placement import (
    Route, choices, home, home_key, parse_key, ranking, score, slot_key,
)
from inferscale.types import user_id_problem

REPO = Path(__file__).resolve().parents[2]
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789-_.@:/ \u00e9\u4e2d\U0001f600\u202e\x00\t"


def random_texts(rng: random.Random, n: int, max_len: int = 24) -> list[str]:
    """``n`` random strings over an alphabet with hostile characters (``/``, controls,
    a bidi override, astral and non-Latin letters)."""
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, max_len)))
            for _ in range(n)]


def random_users(rng: random.Random, n: int) -> list[str]:
    users: list[str] = []
    while len(users) < n:
        users += [u for u in random_texts(rng, n) if user_id_problem(u) is None
                  and u not in users]
    return users[:n]


# ------------------------------------------------------------------ placement, no Ray


@pytest.mark.parametrize("n", range(1, 8))
def test_adding_a_slot_rehomes_about_one_in_n_plus_one_users_all_onto_it(n):
    users = random_users(random.Random(n), 3000)
    before = {u: home(u, range(n)) for u in users}
    after = {u: home(u, range(n + 1)) for u in users}
    moved = [u for u in users if before[u] != after[u]]
    assert all(after[u] == n for u in moved)  # only onto the new slot
    p = 1 / (n + 1)  # binomial(3000, p): within 5 standard deviations
    sd = (3000 * p * (1 - p)) ** 0.5
    assert abs(len(moved) - 3000 * p) <= 5 * sd, (len(moved), 3000 * p)
    assert all(before[u] == after[u] for u in users if after[u] != n)


@pytest.mark.parametrize("n", range(2, 9))
def test_a_dead_slot_moves_only_its_users_each_to_its_second_choice(n):
    users = random_users(random.Random(100 + n), 500)
    for dead in range(n):
        live = [s for s in range(n) if s != dead]
        for u in users:
            order = ranking(u, range(n))
            assert home(u, live) == (order[1] if order[0] == dead else order[0])


def test_a_users_choices_are_its_home_then_its_second_choice():
    rng = random.Random(7)
    for user in random_users(rng, 400):
        slots = set(rng.sample(range(65), rng.randint(1, 10)))
        order = ranking(user, slots)
        assert sorted(order) == sorted(slots) and order[0] == home(user, slots)
        assert choices(parse_key(user), slots) == order[:2]
        assert choices(parse_key(home_key(user)), slots) == order[:1]
        assert ranking(user, sorted(slots, reverse=True)) == order
        assert score(user, order[0]) >= score(user, order[-1])
    with pytest.raises(ValueError):
        home("ann", [])


def test_routing_keys_round_trip_and_never_collide():
    rng = random.Random(8)
    for user in random_users(rng, 400):
        slot = rng.randint(0, 10**6)
        assert parse_key(user) == Route("user", user=user)
        assert parse_key(home_key(user)) == Route("home", user=user)
        assert parse_key(slot_key(slot)) == Route("slot", slot=slot)
        assert choices(Route("slot", slot=slot), [slot]) == [slot]
        assert choices(Route("slot", slot=slot), [slot + 1]) is None  # anyone: "not me"
    assert parse_key("") == Route("any") and choices(Route("any"), [0, 1]) is None


def test_a_malformed_key_is_refused_not_routed():
    rng = random.Random(9)
    texts = random_texts(rng, 3000) + ["home/x", "slot/1", "", "١", "1" * 10, "-1", "1.0"]
    for text in texts:
        for key in ("/" + text, "/home/" + text, "/slot/" + text):
            ok = (key.startswith("/home/") and user_id_problem(key[6:]) is None) or (
                key.startswith("/slot/") and key[6:].isascii() and key[6:].isdigit()
                and len(key[6:]) <= 9)
            if ok:
                assert parse_key(key).kind in ("home", "slot")
            else:
                with pytest.raises(ValueError):
                    parse_key(key)


def test_the_cli_refuses_zero_replicas_and_an_open_bind_without_keys(capsys):
    from inferscale.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--replicas", "0"])
    assert "must be >= 1" in capsys.readouterr().err
    env = {k: os.environ.pop(k) for k in list(os.environ)
           if k in ("INFERSCALE_API_KEYS", "INFERSCALE_ADMIN_KEY")}
    try:
        assert main(["serve", "--replicas", "2", "--host", "0.0.0.0"]) == 2
    finally:
        os.environ.update(env)
    assert "refus" in capsys.readouterr().err.lower()


def test_where_serves_proxies_listen_decides_loopback():
    from inferscale.serve.access import is_loopback
    from inferscale.serve.replicas import bind_host, build_app

    assert is_loopback(bind_host("127.0.0.1", []))
    assert not is_loopback(bind_host("0.0.0.0", []))
    assert not is_loopback(bind_host(None, []))  # all interfaces
    assert not is_loopback(bind_host("127.0.0.1", ["x.add_servicer"]))  # gRPC on [::]
    with pytest.raises(ValueError, match="http_options"):  # no argument says otherwise
        build_app({"replicas": 1, "host": "127.0.0.1"})


def test_the_gateways_admin_status_parses_identity_headers_as_the_app():
    """The gateway's own app (no route of its own): a repeated Authorization header is a
    400 on /admin/status too (it took the last copy: a wrong then the right key listed
    every user)."""
    from fastapi.testclient import TestClient

    from inferscale.serve.access import AccessPolicy
    from inferscale.serve.api_models import RequestLimits
    from inferscale.serve.replicas import Gateway
    from tests.serve.recording_server import RecordingServer

    gateway = Gateway.__new__(Gateway)  # as __init__ leaves it, without a Serve replica
    gateway.policy = AccessPolicy({"key-ann": "ann"}, "admin", None, loopback=False)
    gateway.replicas, gateway.model_name = RecordingServer(), "m"
    gateway.limits = RequestLimits()
    client = TestClient(gateway.__serve_build_asgi_app__())
    wrong_then_right = [("Authorization", "Bearer nope"), ("Authorization", "Bearer admin")]
    assert client.get("/admin/status", headers=wrong_then_right).status_code == 400
    assert client.get("/admin/status",
                      headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/admin/status", headers={"Authorization": "Bearer admin"}).json() == \
        {"mode": "kv", "users": []}


ENGINE_LIKE = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
shm = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(shm._name, "shared_memory")  # as vLLM's queues: not tracked
print(shm.name, flush=True)
time.sleep(600)
"""
REPLICA_LIKE = """
import subprocess, sys, time
engine = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE,
                          text=True)
print(engine.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def _replica_like():
    """A "replica" process whose child (its "engine") creates a shared-memory segment
    (``psm_*``) as vLLM's engine core does, maps it and waits: (process, segment)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", REPLICA_LIKE, ENGINE_LIKE],
                            stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_dead_replicas_shared_memory_is_removed_and_no_live_ones(tmp_path):
    """Real processes and segments: three replicas recorded with their engines'
    segments. While they live, nothing is touched. Two are killed (SIGKILL, engines
    too): their segments stay in /dev/shm. A clear removes the one nobody maps and
    leaves the one another live process still maps; the live replica's is never
    touched."""
    import signal
    from multiprocessing import resource_tracker, shared_memory

    import psutil

    from inferscale.serve.leftovers import clear_dead, record_replica

    folder = tmp_path / "records"
    procs, segments = [], []
    try:
        for _ in range(3):
            proc, segment = _replica_like()
            procs.append(proc)
            segments.append(segment)
            assert segment.startswith("psm_")
            assert record_replica(folder, proc.pid)["segments"] == [segment]
        (dead, kept, live), (dead_seg, kept_seg, live_seg) = procs, segments
        borrowed = shared_memory.SharedMemory(name=kept_seg)  # this process maps it too
        resource_tracker.unregister(borrowed._name, "shared_memory")
        assert clear_dead(folder) == []  # all alive: nothing touched
        for p in (dead, kept):  # the replica and its engine die at once
            for q in [*psutil.Process(p.pid).children(recursive=True), p]:
                os.kill(q.pid, signal.SIGKILL)
            p.wait()
        assert all((SHM / s).exists() for s in segments)  # leaked
        assert clear_dead(folder) == [dead_seg]
        assert not (SHM / dead_seg).exists()
        assert (SHM / kept_seg).exists() and (SHM / live_seg).exists()
        assert sorted(x.name for x in folder.glob("*.json")) == [f"{live.pid}.json"]
        borrowed.close()
    finally:
        for p in procs:
            if p.poll() is None:
                for q in [*psutil.Process(p.pid).children(recursive=True), p]:
                    q.kill()
                p.wait()
        for segment in segments:
            (SHM / segment).unlink(missing_ok=True)


def test_the_config_file_builds_the_application():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from inferscale.serve.replicas import build_app

    config = ServeDeploySchema.model_validate(
        yaml.safe_load((REPO / "deploy" / "ray-serve.yaml").read_text()))
    (spec,) = config.applications
    assert spec.import_path == "inferscale.serve.replicas:build_app"
    deployments = {d.name: d for d in spec.deployments}
    assert set(deployments) == {"MemoryReplica", "Gateway"}
    app = build_app(spec.args)
    memory = app._bound_deployment.init_args[0]._bound_deployment
    assert memory.name == "MemoryReplica"
    router = memory._deployment_config.request_router_config
    assert router.request_router_class == "inferscale.serve.router:MemoryAffinityRouter"
    assert memory._deployment_config.num_replicas == spec.args["replicas"]


# ------------------------------------------------------------------ the router in real Ray Serve


@pytest.mark.slow
def test_the_router_keeps_users_home_spills_only_to_the_second_choice_and_follows_slots():
    """Light replicas (no engine) under :class:`MemoryAffinityRouter` in real Ray Serve:
    homes, the spill rule with ``max_ongoing_requests=2``, slot keys, and a killed
    replica's users on their second choice until Ray restarts it in the same slot."""
    import asyncio
    import signal

    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from inferscale.serve.replicas import ROUTER

    class Light:
        def _slot(self):
            return serve.get_replica_context().rank.rank

        def record_replica_metadata(self):
            return {"slot": self._slot()}

        def record_routing_stats(self):
            return {"slot": self._slot()}

        async def where(self, hold_s: float = 0.0):
            await asyncio.sleep(hold_s)
            return self._slot(), os.getpid()

    dep = serve.deployment(Light).options(
        name="Light", num_replicas=3, max_ongoing_requests=2,
        ray_actor_options={"num_cpus": 0},
        request_router_config=RequestRouterConfig(request_router_class=ROUTER,
                                                  request_routing_stats_period_s=1))
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             object_store_memory=100 << 20, num_cpus=2)
    try:
        handle = serve.run(dep.bind(), name="router-test", route_prefix=None)

        async def where(key, hold_s=0.0):
            return await handle.options(multiplexed_model_id=key).where.remote(hold_s)

        async def scenario():
            users = random_users(random.Random(11), 30)
            for user in users:  # one at a time: always the home
                assert (await where(user))[0] == home(user, range(3))
            for slot in range(3):
                assert (await where(slot_key(slot)))[0] == slot
            user = users[0]
            first, second, third = ranking(user, range(3))
            t0 = time.monotonic()
            got = await asyncio.gather(*(where(user, 1.5) for _ in range(5)))
            slots = [s for s, _ in got]
            # home full -> the second choice; both full -> wait for one, never the third
            assert set(slots) == {first, second} and third not in slots, got
            assert slots.count(first) >= 2 and slots.count(second) >= 2, got
            assert time.monotonic() - t0 >= 2.9
            assert [(await where(home_key(user), 0.5))[0] for _ in range(2)] == [first] * 2
            pid = (await where(slot_key(first)))[1]
            os.kill(pid, signal.SIGKILL)  # a replica process this test started
            deadline = time.monotonic() + 120
            seen = []
            while time.monotonic() < deadline:
                try:
                    slot, now = await asyncio.wait_for(where(user), 30)
                except Exception as exc:  # noqa: BLE001 - the dead replica, once
                    seen.append(type(exc).__name__)
                    continue
                seen.append(slot)
                if slot == first and now != pid:
                    break
                assert slot in (first, second) and now != pid or slot == second, seen
                await asyncio.sleep(0.5)
            assert second in seen and seen[-1] == first, seen  # failed over, then home

        asyncio.run(scenario())
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow
def test_the_gateway_wants_keys_unless_serves_proxies_listen_on_loopback():
    """The gateway over a light replica in real Ray Serve, no API keys: with Serve's
    proxies on 0.0.0.0 (as deploy/ray-serve.yaml starts them) it refuses to start; on
    127.0.0.1 it serves, and its /admin/status refuses a repeated Authorization header
    as every route of the app does."""
    import httpx
    import ray
    from ray import serve

    from inferscale.serve.replica_cluster import free_port
    from inferscale.serve.replicas import MEMORY_DEPLOYMENT, Gateway

    class Light:
        async def status(self, slot: int) -> dict:
            return {"replica": slot, "state": "running", "users": ["ann"]}

    replica = serve.deployment(Light).options(name=MEMORY_DEPLOYMENT, num_replicas=1,
                                              ray_actor_options={"num_cpus": 0})
    gateway = serve.deployment(serve.ingress()(Gateway)).options(
        name="Gateway", ray_actor_options={"num_cpus": 0}, max_constructor_retry_count=1)
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k in (
        "INFERSCALE_API_KEYS", "INFERSCALE_ADMIN_KEY", "INFERSCALE_TRUSTED_USER_HEADER")}
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             object_store_memory=100 << 20, num_cpus=2)
    try:
        serve.start(http_options={"host": "0.0.0.0", "port": free_port()})
        with pytest.raises(RuntimeError, match="Deploying application gateway-test failed"):
            serve.run(gateway.bind(replica.bind(), {"admin_key": "adm"}, "kv"),
                      name="gateway-test", route_prefix="/")
        why = serve.status().applications["gateway-test"].deployments["Gateway"].message
        assert "binding beyond loopback needs INFERSCALE_API_KEYS" in why, why
        serve.shutdown()
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(gateway.bind(replica.bind(), {"admin_key": "adm"}, "kv"),
                  name="gateway-test", route_prefix="/")
        url = f"http://127.0.0.1:{port}/admin/status"
        right = ("Authorization", "Bearer adm")
        assert httpx.get(url, headers=[right], trust_env=False).json()["users"] == ["ann"]
        assert httpx.get(url, headers=[("Authorization", "Bearer nope"), right],
                         trust_env=False).status_code == 400
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.update(saved)


@pytest.mark.slow
@pytest.mark.engine
def test_the_cli_serves_replicas_until_sigterm(tmp_path):
    """``inferscale serve --replicas 1`` end to end: serving on the given port, then
    SIGTERM stops Serve, Ray and the engine (no process of it left)."""
    import signal
    import subprocess
    import sys

    import httpx
    import psutil

    from inferscale.serve.replica_cluster import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("INFERSCALE_API_KEYS", "INFERSCALE_ADMIN_KEY")}
    env.update({"INFERSCALE_ARTIFACT_ROOT": str(tmp_path / "artifacts"),
           "INFERSCALE_KV_CACHE_MEMORY_BYTES": str(1 << 30),
           "INFERSCALE_MAX_MODEL_LEN": "2048", "RAY_memory_monitor_refresh_ms": "0"})
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "inferscale.cli", "serve", "--replicas", "1",
                             "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5, trust_env=False)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the replicas never came up"
            time.sleep(2)
        assert r.json()["mode"] == "kv"
        status = httpx.get(f"http://127.0.0.1:{port}/admin/status", timeout=60,
                           trust_env=False).json()
        assert [x["state"] for x in status["replicas"]] == ["running"]
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert status["replicas"][0]["pid"] in tree
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(180) == 0
        deadline = time.monotonic() + 60
        while (alive := [p for p in tree if psutil.pid_exists(p)
                         and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]):
            assert time.monotonic() < deadline, f"left running: {alive}"
            time.sleep(1)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


# ------------------------------------------------------------------ real vLLM replicas

ADMIN = "admin-secret"
FACTS = {
    "rp-ann": ["The user's dog is named Pelican.", "The user lives in Porto."],
    "rp-bob": ["The user's cat is called Marigold.", "The user works as a baker."],
    "rp-cyd": ["The user's horse is named Thunder.", "The user plays the oboe."],
    "rp-dee": ["The user's parrot is called Saffron.", "The user grows tomatoes."],
}
HOMES = {"rp-ann": 0, "rp-bob": 0, "rp-cyd": 1, "rp-dee": 1}  # home(user, range(2))
QUESTIONS = ["What is my pet's name?", "Where do I live?", "What do I do for work?",
             "What instrument do I play?", "What do I grow?"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm2, embedder):
    """Two memory replicas (SmolLM2, 1 GiB KV cache each) serving four published users."""
    from inferscale.serve.replica_cluster import ReplicaCluster
    from engine_helpers import limiting_memory
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.publish import Lineage, publish

    assert {u: home(u, range(2)) for u in FACTS} == HOMES
    store = StoreConfig(str(tmp_path_factory.mktemp("replicas") / "artifacts"))
    fact_ids = {}
    for user, texts in FACTS.items():
        mem, table = limiting_memory(smollm2.model, smollm2.tokenizer, user, texts,
                                     smollm2.fingerprint, embedder)
        publish(store, user, mem, table, Lineage(f"log-{user}", "f"), embeddings=False)
        fact_ids[user] = set(table.column("fact_id").to_pylist())
    env = {"INFERSCALE_ARTIFACT_ROOT": store.root,
           "INFERSCALE_KV_CACHE_MEMORY_BYTES": str(1 << 30),
           "INFERSCALE_MAX_MODEL_LEN": "2048", "INFERSCALE_TOP_K": "2",
           "INFERSCALE_API_KEYS": '{' + ", ".join(f'"key-{u}": "{u}"' for u in FACTS) + '}',
           "INFERSCALE_ADMIN_KEY": ADMIN, "INFERSCALE_REPLICA_TIMEOUT_S": "300"}
    with ReplicaCluster(env, replicas=2, admin_key=ADMIN) as c:
        c.fact_ids = fact_ids
        yield c
        segments = segments_of(replica_processes(c))
    # a graceful stop unlinks every segment the replicas' engines had
    assert segments and not [s for s in segments if (SHM / s).exists()], segments


def replica_processes(c, slots=(0, 1)) -> list[int]:
    """The processes of the replicas in ``slots``: each replica and its engine's."""
    import psutil

    pids = [c.replica(s)["pid"] for s in slots]
    return pids + [p.pid for pid in pids for p in psutil.Process(pid).children(recursive=True)]


def ask(c, user: str, question: str, *, stream: bool = False, max_tokens: int = 4) -> dict:
    """One chat request through the official client with the user's key -> ``{"info",
    "finish", "text"}`` (a streamed answer's extras come with its last chunk)."""
    import openai

    client = openai.OpenAI(base_url=f"{c.url}/v1", api_key=f"key-{user}", max_retries=0,
                           timeout=600)
    kwargs = dict(model="embedded", messages=[{"role": "user", "content": question}],
                  max_tokens=max_tokens, extra_body={"ignore_eos": True})
    if not stream:
        r = client.chat.completions.create(**kwargs)
        return {"info": r.model_extra["inferscale"], "finish": r.choices[0].finish_reason,
                "text": r.choices[0].message.content}
    info, finish, text = None, None, ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        info = (chunk.model_extra or {}).get("inferscale") or info
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return {"info": info, "finish": finish, "text": text}


def injected(info: dict) -> bool:
    """Memory from the connector, not prefilled: injected now, or in vLLM's prefix cache
    (salted per user and version) from an earlier injection."""
    return (info["mode"] == "kv" and "fallback" not in info and info["injected_tokens"] > 0
            or info["cached_tokens"] >= info["memory_tokens"] > 0)


def own_memory(c, user: str, info: dict) -> bool:
    return info["user"] == user and set(info["facts"]) <= c.fact_ids[user] and info["facts"]


@pytest.mark.slow
@pytest.mark.engine
def test_requests_land_on_their_users_home_replica_and_are_injected(cluster):
    import httpx

    from inferscale.serve.replica_cluster import metric

    c = cluster
    for user, slot in HOMES.items():  # hydrate reaches the home replica
        assert c.hydrate(user)["replica"] == slot
    status = c.status()
    assert [r["replica"] for r in status["replicas"]] == [0, 1]
    for r in status["replicas"]:
        mine = sorted(u for u, s in HOMES.items() if s == r["replica"])
        assert r["state"] == "running" and r["users"] == mine and r["home_users"] == mine
        assert sorted(x["user"] for x in r["engine"]["residents"]) == mine
    before = c.scrape()
    plan = [(u, QUESTIONS[i % len(QUESTIONS)], i % 4 == 3) for i in range(25) for u in FACTS]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: ask(c, p[0], p[1], stream=p[2]), plan))
    after = c.scrape()
    # the single server's API through the gateway: keys decide the user, limits are 4xx
    with httpx.Client(base_url=c.url, trust_env=False, timeout=300) as h:
        body = {"model": "embedded", "messages": [{"role": "user", "content": "Hi?"}]}
        assert h.post("/v1/chat/completions", json=body).status_code == 401
        assert h.post("/v1/chat/completions", json={**body, "user": "rp-bob"},
                      headers={"Authorization": "Bearer key-rp-ann"}).status_code == 401
        assert h.get("/admin/status").status_code == 401
        wrong_then_right = [("Authorization", "Bearer nope"), ("Authorization", f"Bearer {ADMIN}")]
        assert h.get("/admin/status", headers=wrong_then_right).status_code == 400
        for stream in (False, True):  # too long for the model: a 400 from the replica
            r = h.post("/v1/chat/completions", headers={"Authorization": "Bearer key-rp-ann"},
                       json={**body, "max_tokens": 2047, "stream": stream})
            assert r.status_code == 400 and "exceeds" in r.json()["detail"], r.text
            assert "Traceback" not in r.text
    for (user, _, _), a in zip(plan, answers):
        info = a["info"]
        assert info["replica"] == {"slot": HOMES[user], "home": HOMES[user]}, info
        assert own_memory(c, user, info) and injected(info), info
        assert a["finish"] == "length"
    # counted by the replicas themselves, scraped through the gateway
    assert metric(after, "inferscale_replica_requests_total", placement="home") - metric(
        before, "inferscale_replica_requests_total", placement="home") == 100
    assert metric(after, "inferscale_replica_requests_total", placement="away") == 0
    for slot in (0, 1):
        served = metric(after, "inferscale_requests_total", mode="kv", replica=slot) - metric(
            before, "inferscale_requests_total", mode="kv", replica=slot)
        assert served == 25 * sum(s == slot for s in HOMES.values())
        assert metric(after, "vllm:num_requests_running", replica=slot) >= 0  # vLLM's, per replica


@pytest.mark.slow
@pytest.mark.engine
def test_a_stream_whose_client_goes_is_aborted_on_its_replica(cluster):
    """Through the gateway: a stream's client reads its first chunk and goes; the
    replica's engine aborts the request long before its max_tokens, and the replica
    counts the abort (``inferscale_requests_aborted_total``, with the tokens it had)."""
    import socket

    from inferscale.serve.replica_cluster import metric

    c, user, max_tokens = cluster, "rp-cyd", 1500
    slot = HOMES[user]

    def settled() -> dict:
        """A scrape once the replica's engine has stopped generating."""
        last = c.scrape()
        while True:
            time.sleep(2)
            now = c.scrape()
            if metric(now, "vllm:generation_tokens_total", replica=slot) == metric(
                    last, "vllm:generation_tokens_total", replica=slot):
                return now
            last = now

    before = settled()
    body = json.dumps({"model": "embedded", "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True, "messages": [{"role": "user", "content": "Tell me a "
                                                                                "long story."}]})
    port = int(c.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
                 f"key-{user}\r\nContent-Type: application/json\r\nContent-Length: "
                 f"{len(body)}\r\n\r\n{body}".encode())
    sock.settimeout(600)
    seen = b""
    while b"chat.completion.chunk" not in seen:  # its first chunk: generating
        data = sock.recv(65536)
        assert data, seen
        seen += data
    sock.close()
    after = settled()
    made = (metric(after, "vllm:generation_tokens_total", replica=slot)
            - metric(before, "vllm:generation_tokens_total", replica=slot))
    assert 0 < made < max_tokens
    aborted = (metric(after, "inferscale_requests_aborted_total", replica=slot, mode="kv")
               - metric(before, "inferscale_requests_aborted_total", replica=slot, mode="kv"))
    assert aborted == 1
    assert 0 < (metric(after, "inferscale_aborted_completion_tokens_total", replica=slot)
                - metric(before, "inferscale_aborted_completion_tokens_total",
                         replica=slot)) <= made


@pytest.mark.slow
@pytest.mark.engine
def test_a_killed_replica_loses_no_request_and_serves_no_other_users_memory(cluster):
    import psutil

    from inferscale.serve.replica_cluster import metric

    c = cluster
    retries_before = metric(c.scrape(), "inferscale_gateway_retries_total")
    with ThreadPoolExecutor(8) as pool:
        # in flight on slot 0 when it dies: a stream that has sent output, a unary answer
        # that has sent nothing yet, and requests of every user around them
        stream = pool.submit(ask, c, "rp-ann", QUESTIONS[0], stream=True, max_tokens=400)
        unary = pool.submit(ask, c, "rp-bob", QUESTIONS[2], max_tokens=120)
        others = [pool.submit(ask, c, u, q, max_tokens=24) for u in FACTS for q in QUESTIONS[:2]]
        time.sleep(3)
        doomed = segments_of(replica_processes(c, (0,)))  # its engine's message queues
        assert doomed and all((SHM / s).exists() for s in doomed)
        pid, children = c.kill(0)
        later = [pool.submit(ask, c, u, QUESTIONS[1]) for u in FACTS for _ in range(3)]
        done = [f.result(timeout=600) for f in [unary, *others, *later]]
        cut = stream.result(timeout=600)
    assert cut["finish"] == "error" and "died" in cut["info"]["error"], cut
    for a in done:  # every other request answered in full, from its own user's memory
        assert a["finish"] == "length", a
        assert own_memory(c, a["info"]["user"], a["info"]), a["info"]
    assert metric(c.scrape(), "inferscale_gateway_retries_total") > retries_before
    # while slot 0 is down its users are served by slot 1: prefilled, then injected
    deadline = time.monotonic() + 300
    while True:
        info = ask(c, "rp-bob", QUESTIONS[3])["info"]
        if info["replica"]["slot"] == 0:  # already back (no fault window left to see)
            break
        assert info["replica"] == {"slot": 1, "home": 0} and own_memory(c, "rp-bob", info)
        if injected(info):
            break
        assert time.monotonic() < deadline, "rp-bob never injected on its second choice"
        time.sleep(2)
    back = c.wait_back(0, pid)  # Ray Serve restarts it, in the same slot
    assert back["pid"] != pid
    gone = [p for p in children if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not gone, f"processes of the killed replica still running: {gone}"
    # the segments nothing maps any more are removed by the replica that took the slot
    # (at start, or at a health check once the dead engine had exited)
    deadline = time.monotonic() + 120
    while (left := [s for s in doomed if (SHM / s).exists()]):
        assert time.monotonic() < deadline, f"the killed replica's segments stay: {left}"
        time.sleep(2)
    assert segments_of(replica_processes(c, (0,)))  # the new replica's own are in use
    deadline = time.monotonic() + 300
    while True:  # and its users come home: prefilled from storage, then injected
        a = ask(c, "rp-ann", QUESTIONS[1])
        assert a["info"]["replica"] == {"slot": 0, "home": 0}, a["info"]
        assert own_memory(c, "rp-ann", a["info"])
        if injected(a["info"]):
            break
        assert time.monotonic() < deadline, "rp-ann never injected after coming home"
        time.sleep(2)

