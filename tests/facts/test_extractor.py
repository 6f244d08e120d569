"""Fact extraction: raw mode, idempotence, the guided LLM adapter, and the real local server."""

from __future__ import annotations

import json

import numpy as np
import psutil
import pytest

from inferscale.settings import Settings, offline_environment

offline_environment()

from inferscale.compose import Composer  # noqa: E402
from inferscale.facts.extractor import FactExtractor, FactsConfig, facts_hash  # noqa: E402
from inferscale.facts.llm_server import LLMServerConfig, LLMServerError, LocalLLMServer  # noqa: E402
from inferscale.ingest.logs import read_logs, sample_conversations  # noqa: E402
from inferscale.facts.table import fact_id, raw_facts  # noqa: E402
from inferscale.facts.mem0_llm import GuidedLLM, GuidedLLMConfig, facts_schema, parse_facts_reply  # noqa: E402
from inferscale.models import resolve_checkpoint  # noqa: E402
from storage_schemas import facts as facts_schema_mod  # noqa: E402


@pytest.fixture(scope="module")
def home():
    return Settings().home


@pytest.fixture(scope="module")
def checkpoint(home):
    return resolve_checkpoint("embedded", home)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def sample_turns():
    return read_logs(str(sample_conversations())).turns


def _check_table(table, turns, tokenizer, dims=384):
    assert table.schema == facts_schema_mod.schema(dims)
    assert table.schema.metadata == facts_schema_mod.schema(dims).metadata
    index_of = dict(zip(turns["turn_id"].to_pylist(), turns["turn_index"].to_pylist()))
    rows = table.to_pylist()
    assert len({r["fact_id"] for r in rows}) == len(rows)
    composer = Composer(tokenizer)
    for r in rows:
        assert r["source_index"] == index_of[r["source_turn_id"]]
        assert r["fact_id"] == fact_id(r["user"], r["source_turn_id"], r["text"])
        assert r["token_ids"] == composer.fact_ids(r["text"], 256)
        assert np.linalg.norm(r["embedding"]) == pytest.approx(1.0, abs=1e-4)
    assert [r["source_index"] for r in rows] == sorted(r["source_index"] for r in rows)


def test_raw_mode_one_fact_per_turn_and_idempotent(tmp_path, tokenizer, sample_turns):
    from sentence_transformers import SentenceTransformer

    from inferscale.facts.extractor import embedded_embedder_path

    config = FactsConfig(mode="raw", store_uri=str(tmp_path / "db"),
                         history_dir=tmp_path / "history")
    with FactExtractor.open(config) as ex:
        results = {u: ex.extract_user(t, tokenizer) for u, t in sample_turns.items()}
        for user, res in results.items():
            turns = sample_turns[user]
            _check_table(res.table, turns, tokenizer)
            assert res.table["source_turn_id"].to_pylist() == turns["turn_id"].to_pylist()
            assert res.facts_per_turn == {t: 1 for t in turns["turn_id"].to_pylist()}
            first = res.table.to_pylist()[0]
            t0 = turns.slice(0, 1).to_pylist()[0]
            assert first["text"] == f"[{t0['timestamp'][:10]}] {t0['speaker']}: {t0['text']}"
            assert res.llm_stats == {}
        # the embedding is the packaged model's
        st = SentenceTransformer(str(embedded_embedder_path()), device="cpu")
        maya = results["maya"].table
        ref = st.encode(maya["text"].to_pylist()[:5])
        np.testing.assert_allclose(np.array(maya["embedding"].to_pylist()[:5]), ref, atol=1e-5)
        # raw_facts, without Mem0, makes the same table (the embeddings the same model's)
        alone = raw_facts(sample_turns["maya"], tokenizer, st.encode)
        assert alone.drop_columns("embedding").equals(maya.drop_columns("embedding"))
        np.testing.assert_allclose(np.array(alone["embedding"].to_pylist()),
                                   np.array(maya["embedding"].to_pylist()), atol=1e-5)
        # a rerun yields the same facts and leaves no duplicate in the store
        rows_before = ex.store.col_info()["count"]
        again = ex.extract_user(sample_turns["maya"], tokenizer)
        assert again.table.equals(results["maya"].table)
        assert again.facts_hash == results["maya"].facts_hash
        assert ex.store.col_info()["count"] == rows_before == 70
        # re-extracting one turn replaces that turn's memories only
        one = ex.extract_user(sample_turns["maya"], tokenizer, turn_ids=["S2:1"])
        assert one.table["source_turn_id"].to_pylist() == ["S2:1"]
        assert ex.store.col_info()["count"] == 70
    # a fresh extractor on a fresh store agrees (content-derived ids and hash)
    fresh = FactsConfig(mode="raw", store_uri=str(tmp_path / "db2"))
    with FactExtractor.open(fresh) as ex2:
        assert ex2.extract_user(sample_turns["tomas"], tokenizer).facts_hash \
            == results["tomas"].facts_hash


def test_star_user_and_star_turn_are_literals(tmp_path, tokenizer, sample_turns):
    """User ``*`` and turn ``*`` are ids like any other: extracting user ``*`` (which
    rebuilds its memories with ``delete_all``) keeps every other user's memories, and
    re-extracting turn ``*`` replaces that turn's memories only."""
    import pyarrow as pa

    maya = sample_turns["maya"].slice(0, 3)
    star = maya.set_column(0, "user", pa.array(["*"] * 3))
    star = star.set_column(2, "turn_id", pa.array(["*", "t2", "t3"]))
    config = FactsConfig(mode="raw", store_uri=str(tmp_path / "db"),
                         history_dir=tmp_path / "history")
    with FactExtractor.open(config) as ex:
        ex.extract_user(maya, tokenizer)
        ex.extract_user(star, tokenizer)

        def memories(user):
            return sorted(m["metadata"]["source_turn_id"] for m in
                          ex.memory.get_all(filters={"user_id": user}, top_k=100)["results"])

        assert memories("maya") == sorted(maya["turn_id"].to_pylist())
        assert memories("*") == ["*", "t2", "t3"]
        one = ex.extract_user(star, tokenizer, turn_ids=["*"])
        assert one.table["source_turn_id"].to_pylist() == ["*"]
        assert memories("*") == ["*", "t2", "t3"]
        assert memories("maya") == sorted(maya["turn_id"].to_pylist())


def test_fact_id_and_hash():
    assert fact_id("u", "t1", "Maya has a  dog.") == fact_id("u", "t1", " maya has a dog.")
    assert fact_id("u", "t1", "Maya has a dog.") != fact_id("u", "t2", "Maya has a dog.")
    assert fact_id("u", "t1", "Maya has a dog.") != fact_id("v", "t1", "Maya has a dog.")
    empty = facts_schema_mod.schema(4).empty_table()
    assert facts_hash(empty, "a") != facts_hash(empty, "b")


def test_config_validation():
    with pytest.raises(ValueError):
        FactsConfig(mode="llm")
    with pytest.raises(ValueError):
        FactsConfig(max_facts_per_turn=0)
    with pytest.raises(ValueError):
        FactsConfig(openai_api_key="sk-x")  # OpenAI needs a model name
    with pytest.raises(ValueError):
        FactsConfig(embedder="openai")  # needs a key
    cfg = FactsConfig(openai_api_key="sk-x", llm_model="gpt-4o-mini")
    assert not cfg.uses_local_server and "sk-x" not in repr(cfg)
    s = Settings(fact_mode="raw", embedder="openai", openai_api_key="sk-y", llm_model="gpt-4o-mini")
    cfg = FactsConfig.from_settings(s)
    assert (cfg.mode, cfg.embedding_dims, cfg.openai_api_key) == ("raw", 1536, "sk-y")
    assert cfg.embedder_id() == "openai:text-embedding-3-small:1536"


# -- the Mem0 LLM adapter, on real Mem0 prompts (no endpoint needed)


def _mem0_prompt(new="user: Maya: We got home from Lisbon last week.\n"):
    from mem0.configs.prompts import ADDITIVE_EXTRACTION_PROMPT, generate_additive_extraction_prompt

    user = generate_additive_extraction_prompt(
        existing_memories=[], new_messages=new,
        last_k_messages=[{"role": "user", "content": "Maya: Hi there."},
                         {"role": "assistant", "content": "assistant: Hello!"},
                         {"role": "user", "content": "Maya: I'm a nurse."}])
    return [{"role": "system", "content": ADDITIVE_EXTRACTION_PROMPT},
            {"role": "user", "content": user}]


def test_reply_parsing_and_bounding():
    items, salvaged = parse_facts_reply('{"memory": [{"text": "a"}, {"text": "b"}]}')
    assert [i["text"] for i in items] == ["a", "b"] and not salvaged
    truncated = '{"memory": [{"text": "Maya has a beagle."}, {"text": "Maya wor'
    items, salvaged = parse_facts_reply(truncated)
    assert items == [{"text": "Maya has a beagle."}] and salvaged
    assert parse_facts_reply("```json\n{\"memory\": []}\n```") == ([], False)

    llm = GuidedLLM(GuidedLLMConfig(model="m", api_key="x", openai_base_url="http://127.0.0.1:9/v1",
                                    max_facts=5, max_fact_chars=20))
    seven = json.dumps({"memory": [{"text": f"fact number {i} " * 3} for i in range(7)]})
    out = json.loads(llm._bound(seven))["memory"]
    assert len(out) == 5 and all(len(m["text"]) <= 20 for m in out)
    assert [m["id"] for m in out] == ["0", "1", "2", "3", "4"]
    assert json.loads(llm._bound("total garbage")) == {"memory": []}
    schema = facts_schema(5, 20)
    assert schema["properties"]["memory"]["maxItems"] == 5


def test_prompt_rewrites_observation_date_and_compacts():
    from inferscale.facts.mem0_llm import observation_date

    base = dict(model="m", api_key="x", openai_base_url="http://127.0.0.1:9/v1")
    mem0_style = GuidedLLM(GuidedLLMConfig(prompt_style="mem0", **base))
    with observation_date("2024-03-29 (Friday)"):
        msgs = mem0_style._rewrite(_mem0_prompt())
    assert "## Observation Date\n2024-03-29 (Friday)\n" in msgs[1]["content"]
    assert msgs[0]["content"] == _mem0_prompt()[0]["content"]

    compact = GuidedLLM(GuidedLLMConfig(prompt_style="compact", context_messages=2, **base))
    with observation_date("2024-03-29 (Friday)"):
        msgs = compact._rewrite(_mem0_prompt())
    system, user = msgs[0]["content"], msgs[1]["content"]
    assert len(system) < 1000 and "at most 5" in system.lower()
    assert user.startswith("Observation Date: 2024-03-29 (Friday)\n")
    assert "assistant: Hello!" in user and "user: Maya: I'm a nurse." in user
    assert "Hi there" not in user  # only the last 2 earlier messages
    assert "New message:\nuser: Maya: We got home from Lisbon last week." in user
    # outside the block Mem0's own date stays
    msgs = mem0_style._rewrite(_mem0_prompt())
    assert msgs[1]["content"] == _mem0_prompt()[1]["content"]


# -- the real local LLM server


def _live_children() -> set[psutil.Process]:
    return {p for p in psutil.Process().children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE}


@pytest.fixture
def new_children():
    """Child processes started since the test began (the session's shared engine, when
    another test started it, is not the test's business)."""
    before = _live_children()
    return lambda: sorted(_live_children() - before, key=lambda p: p.pid)


def test_server_command_sizes_its_kv_cache(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cmd = LocalLLMServer(LLMServerConfig(tmp_path)).command()
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)  # the default
    cmd = LocalLLMServer(LLMServerConfig(tmp_path, kv_cache_memory_bytes=None)).command()
    assert "--kv-cache-memory-bytes" not in cmd and "--gpu-memory-utilization" in cmd
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        LLMServerConfig(tmp_path, kv_cache_memory_bytes=-1)


def test_server_start_failure_reports_log_tail(tmp_path, new_children):
    ckpt = tmp_path / "broken"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(LLMServerError) as err:
        with LocalLLMServer(LLMServerConfig(ckpt, startup_timeout_s=300, log_dir=tmp_path)):
            pass
    assert "exited with code" in str(err.value) and "log" in str(err.value)
    assert len(str(err.value).splitlines()) > 3  # the tail is there
    assert new_children() == []


@pytest.mark.slow
def test_mem0_extraction_with_local_vllm_server(tmp_path, home, tokenizer, sample_turns,
                                                new_children):
    turns = sample_turns["maya"]
    selected = ["S1:7", "S1:11", "S2:1"]  # beagle; Lisbon trip dates; "last week"
    config = FactsConfig(mode="mem0", store_uri=str(tmp_path / "db"),
                         history_dir=tmp_path / "history")
    assert config.uses_local_server
    with FactExtractor.open(config, home) as ex:
        assert ex.memory.llm.config.prompt_style == "compact"
        res = ex.extract_user(turns, tokenizer, turn_ids=selected)
        last_request = ex.memory.llm.last_request
        stored = ex.store.list(filters={"user_id": "maya"})[0]
    assert new_children() == []  # the server and its engine are gone

    assert set(res.facts_per_turn) == set(selected)
    assert all(0 <= n <= 5 for n in res.facts_per_turn.values())
    assert res.llm_stats["extract"] == len(selected)
    _check_table(res.table, turns, tokenizer)
    assert set(res.table["source_turn_id"].to_pylist()) <= set(selected)
    assert res.table.num_rows >= 1  # the tiny model still says something
    assert len(stored) == sum(res.facts_per_turn.values())
    assert {r.payload["source_turn_id"] for r in stored} <= set(selected)
    # the model saw the session's date, not today's, for the "last week" turn
    assert last_request[1]["content"].startswith("Observation Date: 2024-03-29 (Friday)")
    assert "last week" in last_request[1]["content"]


def test_identity_keeps_no_credentials():
    """The facts config's identity is recorded in every manifest and hashed into cache
    keys: a password in the LLM's URL is neither (and does not change them)."""
    plain = FactsConfig(mode="mem0", llm_base_url="https://llm.example:8443/v1?x=1",
                        llm_model="m")
    secret = FactsConfig(mode="mem0", llm_base_url="https://me:s3cret@llm.example:8443/v1?x=1",
                         llm_model="m", openai_api_key="sk-key")
    assert secret.identity() == plain.identity()
    assert plain.identity()["llm_base_url"] == "https://llm.example:8443/v1?x=1"
    assert "s3cret" not in json.dumps(secret.identity()) and "sk-key" not in json.dumps(
        secret.identity())
    assert FactsConfig(mode="raw").identity() != FactsConfig(mode="mem0").identity()
