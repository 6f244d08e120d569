"""Serving retrieval: the embedder, exact top-k, parity with LanceDB, import hygiene."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from inferscale.settings import offline_environment

offline_environment()

from inferscale.ingest.logs import read_logs, sample_conversations  # noqa: E402
from inferscale.serve.retrieval import Embedder, FactIndex  # noqa: E402
from storage_schemas import facts as facts_schema  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["Maya", "Tomás", "Ada", "Priya", "Lucía", "Elena", "Marta", "Tom", "Ines", "Karl"]
PETS = ["beagle", "tabby cat", "parrot", "Maine Coon", "hamster", "corgi", "goldfish"]
PLACES = ["Lisbon", "Kyoto", "Leeds", "Valencia", "Oslo", "Cádiz", "Harrogate", "Bocairent"]
JOBS = ["nurse", "backend engineer", "teacher", "pilot", "chef", "architect", "florist"]


def synthetic_facts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out: set[str] = set()
    templates = [
        "{n} has a {p} named {m}.", "{n} works as a {j} in {c}.",
        "{n} travelled to {c} in {mo} {y}.", "{n}'s sister lives in {c} and works as a {j}.",
        "{n} is training for a race in {c} on {d} {mo}.", "{n} adopted a {p} called {m} in {y}.",
    ]
    months = ["January", "March", "May", "June", "August", "October", "December"]
    while len(out) < n:
        out.add(rng.choice(templates).format(
            n=rng.choice(NAMES), p=rng.choice(PETS), m=rng.choice(NAMES + ["Biscuit", "Pixel"]),
            j=rng.choice(JOBS), c=rng.choice(PLACES), mo=rng.choice(months),
            y=rng.randint(2015, 2024), d=rng.randint(1, 28)))
    return sorted(out)


def random_queries(n: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    forms = ["What is the name of {n}'s {p}?", "Where did {n} travel?", "What does {n} do for work?",
             "When is {n}'s race in {c}?", "Who lives in {c}?", "Does {n} have a {p}?",
             "What happened in {c} last week?"]
    return [rng.choice(forms).format(n=rng.choice(NAMES), p=rng.choice(PETS), c=rng.choice(PLACES))
            for _ in range(n)]


@pytest.fixture(scope="module")
def embedder():
    return Embedder("embedded", device="cpu")


def test_embedder_matches_sentence_transformers(embedder):
    texts = ["My beagle is called Biscuit.", "I work night shifts as a nurse in Leeds.", "hi"]
    emb = embedder.embed(texts)
    assert emb.shape == (3, 384) and emb.dtype == torch.float32
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(3))
    ref = embedder.model.encode(texts, convert_to_tensor=True, normalize_embeddings=True)
    torch.testing.assert_close(emb, ref.float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(embedder.embed(texts[0])[0], emb[0], atol=1e-5, rtol=0)
    assert embedder.embed([]).shape == (0, 384)


def test_fact_index_topk_shapes_and_edges():
    ids = ["a", "b", "c"]
    emb = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])  # rows normalized inside
    index = FactIndex(ids, emb, device="cpu")
    assert index.topk(torch.tensor([1.0, 0.1]), 2) == ["a", "c"]
    assert index.topk(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), 1) == [["b"], ["a"]]
    assert index.topk(torch.tensor([0.0, 1.0]), 10) == ["b", "c", "a"]  # k > N
    scores, _ = index.topk_indices(torch.tensor([0.0, 1.0]), 1)
    assert scores.item() == pytest.approx(1.0)
    empty = FactIndex([], np.zeros((0, 2), np.float32), device="cpu")
    assert empty.topk(torch.tensor([1.0, 0.0]), 5) == []
    with pytest.raises(ValueError):
        FactIndex(["a"], torch.zeros(2, 2))


def _facts_table(texts: list[str], emb: torch.Tensor) -> pa.Table:
    n = len(texts)
    return pa.table({
        "fact_id": [f"f{i:05d}" for i in range(n)], "user": ["u"] * n,
        "source_turn_id": [f"t{i}" for i in range(n)], "source_index": list(range(n)),
        "text": texts, "token_ids": [[1]] * n,
        "embedding": pa.FixedSizeListArray.from_arrays(
            pa.array(emb.numpy().reshape(-1)), emb.shape[1]),
    }, schema=facts_schema.schema(emb.shape[1]))


def test_parity_with_lancedb_exact_search(tmp_path, embedder):
    """100 random queries: FactIndex top-k == LanceDB brute-force cosine top-k, same facts."""
    import lancedb

    from inferscale.facts.mem0_lancedb import LanceDBStore

    turns = read_logs(str(sample_conversations())).turns
    texts = [t for table in turns.values() for t in table["text"].to_pylist()]
    texts += synthetic_facts(930)
    facts = _facts_table(texts, embedder.embed(texts))  # 1000 facts
    index = FactIndex.from_table(facts, device="cpu")

    db = lancedb.connect(str(tmp_path / "db"))
    table = db.create_table("facts", facts.select(["fact_id", "embedding"]))
    assert table.list_indices() == []  # no index: LanceDB searches exhaustively
    store = LanceDBStore("facts_store", uri=str(tmp_path / "db"), embedding_model_dims=384)
    store.insert(facts["embedding"].to_pylist(), [{"user_id": "u"}] * facts.num_rows,
                 facts["fact_id"].to_pylist())

    queries = embedder.embed(random_queries(100))  # [100, 384]
    k = 10
    batched = index.topk(queries, k)
    for i in range(queries.shape[0]):
        q = queries[i]
        ours = index.topk(q, k)
        hits = (table.search(q.numpy(), vector_column_name="embedding").distance_type("cosine")
                .limit(k).to_arrow())
        assert ours == hits["fact_id"].to_pylist(), f"query {i}"
        assert batched[i] == ours
        np.testing.assert_allclose(index.topk_indices(q, k)[0].numpy(),
                                   1.0 - np.asarray(hits["_distance"]), atol=1e-5)
        assert [h.id for h in store.search("", q.numpy(), top_k=k, filters={"user_id": "u"})] \
            == ours


def test_retrieval_imports_neither_lancedb_nor_mem0():
    code = ("import sys, inferscale.serve.retrieval; "
            "bad = [m for m in ('lancedb', 'mem0', 'pydantic_settings') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_query_path_matches_the_eager_encoder():
    from inferscale.settings import Settings

    # the configured embedder (INFERSCALE_EMBEDDER): the GPU machine has MiniLM staged as a
    # directory, not the package behind "embedded"
    emb = Embedder(Settings().embedder, device="cuda")
    assert emb._graphs is not None
    for text in ["dog", "What is the name of Caroline's dog?", "a " * 40]:
        graphed = emb.embed(text)
        eager = emb._eager([text])
        assert (graphed - eager).abs().max().item() < 1e-3
    assert emb._graphs.enabled and len(emb._graphs.graphs) == 3


def test_prewarm_captures_every_short_length_up_front():
    """On CUDA, prewarm leaves no question of up to 64 tokens to capture while serving
    (each capture would stall retrieval); on the CPU there is nothing to capture."""
    from inferscale.serve.retrieval import Embedder
    from inferscale.settings import Settings

    device = "cuda" if torch.cuda.is_available() else "cpu"
    emb = Embedder(Settings().embedder, device=device)
    ready = emb.prewarm(64)
    if device == "cpu":
        assert ready == 0 and emb._graphs is None
        return
    assert ready == 63 and emb._graphs.enabled  # lengths 2..64 ([CLS] and [SEP] included)
    for text in ["Where did Caroline move from four years ago?", "dog"]:
        assert (emb.embed(text) - emb._eager([text])).abs().max().item() < 1e-3
    assert len(emb._graphs.graphs) == 63  # nothing new captured
