"""The LanceDB Mem0 vector store: the whole interface, filters, S3, and a Mem0 round trip."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from inferscale.settings import offline_environment

offline_environment()

from inferscale.facts.extractor import embedded_embedder_path  # noqa: E402
from inferscale.facts.mem0_lancedb import PK_METADATA, PROVIDER, LanceDBStore  # noqa: E402


def _unit(rng, n, d):
    v = rng.standard_normal((n, d)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.fixture
def store(tmp_path):
    return LanceDBStore("mem", uri=str(tmp_path / "db"), embedding_model_dims=8)


def test_interface_rows_and_collections(store, tmp_path):
    rng = np.random.default_rng(0)
    vecs = _unit(rng, 4, 8)
    payloads = [{"user_id": "u1", "data": "a", "n": 1}, {"user_id": "u1", "data": "b", "n": 2},
                {"user_id": "u2", "data": "c", "n": 3}, {"agent_id": "x", "data": "d"}]
    store.insert(vecs, payloads, ["a", "b", "c", "d"])
    store.insert(vecs[:2], payloads[:2], ["a", "b"])  # a re-sent id replaces, never duplicates
    assert store.col_info() == {"name": "mem", "count": 4, "dimension": 8, "distance": "cosine"}
    assert store.table.schema.field("id").metadata == PK_METADATA

    hits = store.search("q", vecs[1], top_k=3)
    assert hits[0].id == "b" and hits[0].score == pytest.approx(1.0, abs=1e-5)
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    expected = sorted(range(4), key=lambda i: -float(vecs[i] @ vecs[1]))[:3]
    assert [h.id for h in hits] == [["a", "b", "c", "d"][i] for i in expected]
    for h in hits:
        i = "abcd".index(h.id)
        assert h.score == pytest.approx(float(vecs[i] @ vecs[1]), abs=1e-5)

    assert {h.id for h in store.search("q", vecs[0], top_k=10, filters={"user_id": "u1"})} == {"a", "b"}
    assert store.get("c").payload == payloads[2] and store.get("zz") is None

    store.update("a", payload={"user_id": "u1", "data": "a2"})
    assert store.get("a").payload["data"] == "a2"
    assert store.search("q", vecs[0], top_k=1)[0].id == "a"  # vector kept
    store.update("a", vector=vecs[3])
    assert store.get("a").payload["data"] == "a2"  # payload kept
    np.testing.assert_allclose(store.get_vectors(["a"])["a"], vecs[3], atol=1e-6)
    with pytest.raises(ValueError):
        store.update("missing", payload={})

    store.delete("b")
    assert sorted(r.id for r in store.list()[0]) == ["a", "c", "d"]
    assert len(store.list(top_k=2)[0]) == 2

    other = LanceDBStore("mem_entities", uri=str(tmp_path / "db"), embedding_model_dims=8)
    other.insert(vecs[:1], [{"data": "e"}], ["e"])
    assert sorted(store.list_cols()) == ["mem", "mem_entities"]
    other.delete_col()
    assert store.list_cols() == ["mem"] and store.col_info()["count"] == 3
    store.reset()
    assert store.col_info()["count"] == 0 and store.list_cols() == ["mem"]
    assert store.search("q", vecs[0], top_k=5) == []
    with pytest.raises(ValueError):  # dimension mismatch on an existing collection
        LanceDBStore("mem", uri=str(tmp_path / "db"), embedding_model_dims=4)


def test_filters(store):
    rng = np.random.default_rng(1)
    payloads = [
        {"user_id": "u", "source_turn_id": "t1", "n": 1, "tag": "Rex the Dog"},
        {"user_id": "u", "source_turn_id": "t2", "n": 5, "tag": "cat"},
        {"user_id": "u", "source_turn_id": "t3", "n": 9},
        {"user_id": "v", "source_turn_id": "t1", "n": 5, "tag": "o'brien"},
    ]
    store.insert(_unit(rng, 4, 8), payloads, ["p1", "p2", "p3", "p4"])
    q = _unit(rng, 1, 8)[0]

    def ids(filters):
        listed = {r.id for r in store.list(filters=filters)[0]}
        searched = {r.id for r in store.search("q", q, top_k=10, filters=filters)}
        assert listed == searched, filters
        return listed

    assert ids({"user_id": "u", "source_turn_id": "t1"}) == {"p1"}
    assert ids({"source_turn_id": ["t1", "t3"]}) == {"p1", "p3", "p4"}
    assert ids({"tag": "*"}) == set()  # a value like any other, never a wildcard
    assert ids({"n": {"gte": 5, "lt": 9}}) == {"p2", "p4"}
    assert ids({"n": {"in": [1, 9]}}) == {"p1", "p3"}
    assert ids({"n": {"nin": [1, 9]}, "user_id": "u"}) == {"p2"}
    assert ids({"tag": {"icontains": "dog"}}) == {"p1"}
    assert ids({"tag": {"ne": "cat"}}) == {"p1", "p3", "p4"}
    assert ids({"$or": [{"n": 1}, {"tag": "cat"}]}) == {"p1", "p2"}
    assert ids({"user_id": "u", "$not": [{"n": 9}]}) == {"p1", "p2"}
    assert ids({"tag": "o'brien"}) == {"p4"}
    assert ids({"user_id": "o'brien"}) == set()  # quotes are escaped in SQL
    assert len(store.search("q", q, top_k=1, filters={"user_id": "u"})) == 1


def test_concurrent_merge_insert_does_not_duplicate(tmp_path):
    rng = np.random.default_rng(2)
    vecs = _unit(rng, 50, 8)
    ids = [f"k{i}" for i in range(50)]
    stores = [LanceDBStore("c", uri=str(tmp_path / "db"), embedding_model_dims=8) for _ in range(2)]
    errors = []

    def write(s):
        try:
            s.insert(vecs, [{"i": i} for i in range(50)], ids)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(s,)) for s in stores]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    stores[0].table.checkout_latest()
    assert stores[0].table.count_rows() == 50


def test_s3_storage(tmp_path):
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        creds = {"aws_access_key_id": "test", "aws_secret_access_key": "test"}
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **creds) \
            .create_bucket(Bucket="memories")
        opts = {"endpoint": endpoint, "allow_http": "true", "region": "us-east-1", **creds}
        store = LanceDBStore("mem", uri="s3://memories/users", storage_options=opts,
                             embedding_model_dims=3)
        store.insert([[1, 0, 0], [0, 1, 0]], [{"user_id": "u"}, {"user_id": "w"}], ["a", "b"])
        again = LanceDBStore("mem", uri="s3://memories/users", storage_options=opts,
                             embedding_model_dims=3)
        hits = again.search("q", [1, 0.2, 0], top_k=2, filters={"user_id": "u"})
        assert [h.id for h in hits] == ["a"] and again.list_cols() == ["mem"]
    finally:
        server.stop()


def _mem0_config(tmp_path, collection: str) -> dict:
    return {
        "vector_store": {"provider": PROVIDER, "config": {
            "uri": str(tmp_path / "db"), "collection_name": collection,
            "embedding_model_dims": 384}},
        "embedder": {"provider": "huggingface", "config": {
            "model": str(embedded_embedder_path()), "embedding_dims": 384}},
        # never called with infer=False; a loopback address keeps it off the network anyway
        "llm": {"provider": "openai", "config": {
            "api_key": "unused", "openai_base_url": "http://127.0.0.1:9/v1", "model": "unused"}},
        "history_db_path": str(tmp_path / "history.db"),
    }


def test_mem0_round_trip(tmp_path):
    from mem0 import Memory

    memory = Memory.from_config(_mem0_config(tmp_path, "roundtrip"))
    assert isinstance(memory.vector_store, LanceDBStore)
    added = memory.add([{"role": "user", "content": "My beagle is called Biscuit."},
                        {"role": "user", "content": "I work night shifts as a nurse in Leeds."}],
                       user_id="maya", infer=False, metadata={"source_turn_id": "S1:7"})
    memory.add("I am training for the Valencia marathon.", user_id="tomas", infer=False)
    ids = [r["id"] for r in added["results"]]
    assert len(ids) == 2

    found = memory.search("What is my dog's name?", filters={"user_id": "maya"}, top_k=5)
    assert found["results"][0]["memory"] == "My beagle is called Biscuit."
    assert found["results"][0]["metadata"] == {"source_turn_id": "S1:7"}
    assert {r["user_id"] for r in found["results"]} == {"maya"}
    scores = [r["score"] for r in found["results"]]
    assert scores == sorted(scores, reverse=True)

    memory.update(ids[0], "My beagle is called Rex.")
    assert memory.get(ids[0])["memory"] == "My beagle is called Rex."
    assert memory.search("dog name", filters={"user_id": "maya"})["results"][0]["memory"] \
        == "My beagle is called Rex."

    memory.delete(ids[1])
    assert [m["id"] for m in memory.get_all(filters={"user_id": "maya"})["results"]] == [ids[0]]
    assert len(memory.get_all(filters={"user_id": "tomas"})["results"]) == 1

    memory.reset()
    assert memory.get_all(filters={"user_id": "tomas"})["results"] == []
    memory.close()


# ------------------------------------------------------------- filters compare literally

# values that are patterns, wildcards, quotes or escapes in some query language
HOSTILE_IDS = ["*", "%", "_", "a%", "?", ".*", "x' OR '1'='1", "'", '"', "\\", "a\\'b", "--",
               "user_id", "NULL", "null", "[a]", "{a}", "$or", "ann"]


def _fresh(tmp_path_factory) -> LanceDBStore:
    return LanceDBStore("scoped", uri=str(tmp_path_factory.mktemp("db")), embedding_model_dims=4)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(victim=st.sampled_from(HOSTILE_IDS) | st.text(min_size=1, max_size=12),
       attacker=st.sampled_from(HOSTILE_IDS) | st.text(min_size=1, max_size=12))
@example(victim="ann", attacker="*")
def test_a_scope_filter_is_a_literal_never_a_pattern(tmp_path_factory, victim, attacker):
    """A search, list or delete scoped to one user id touches exactly that id's rows,
    whatever characters either id holds (``*`` included: Mem0's wildcard is not ours)."""
    assume(victim != attacker)
    store = _fresh(tmp_path_factory)
    rng = np.random.default_rng(3)
    store.insert(_unit(rng, 3, 4), [{"user_id": victim, "data": "My bank PIN is 4921."},
                                    {"user_id": victim, "data": "x"},
                                    {"user_id": attacker, "data": "y"}], ["v1", "v2", "a1"])
    q = _unit(rng, 1, 4)[0]
    for scope in ({"user_id": attacker}, {"user_id": attacker, "data": "y"},
                  {"$or": [{"user_id": attacker}]}, {"user_id": [attacker]}):
        assert {r.id for r in store.list(filters=scope)[0]} == {"a1"}, scope
        assert {r.id for r in store.search("q", q, top_k=10, filters=scope)} == {"a1"}, scope
    assert {r.id for r in store.list(filters={"data": {"eq": "x"}, "user_id": victim})[0]} \
        == {"v2"}
    for r in store.list(filters={"user_id": attacker})[0]:
        store.delete(r.id)
    assert {r.id for r in store.list()[0]} == {"v1", "v2"}


def test_star_user_neither_sees_nor_deletes_another_users_memories(tmp_path):
    """Through the real Mem0 ``Memory``: user ``*`` is a user like any other."""
    from mem0 import Memory

    memory = Memory.from_config(_mem0_config(tmp_path, "star"))
    memory.add("My bank PIN is 4921.", user_id="maya", infer=False)
    memory.add("I like green tea.", user_id="*", infer=False)
    for question in ("What is my bank PIN?", "What do I like to drink?"):
        found = memory.search(question, filters={"user_id": "*"}, top_k=10, threshold=0.0)
        assert "My bank PIN is 4921." not in [r["memory"] for r in found["results"]]
        assert {r["user_id"] for r in found["results"]} <= {"*"}
    assert [r["memory"] for r in found["results"]] == ["I like green tea."]
    assert [m["memory"] for m in memory.get_all(filters={"user_id": "*"})["results"]] \
        == ["I like green tea."]
    memory.delete_all(user_id="*")
    assert memory.get_all(filters={"user_id": "*"})["results"] == []
    assert [m["memory"] for m in memory.get_all(filters={"user_id": "maya"})["results"]] \
        == ["My bank PIN is 4921."]
    memory.close()
