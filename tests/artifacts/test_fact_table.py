"""The LanceDB table of fact embeddings beside the versions (real LanceDB, local and S3):
one table per (user, model), overwritten per publish, each version reachable by its tag."""

from __future__ import annotations

import logging

from builders import facts_table
from inferscale.artifacts import fact_table
from inferscale.artifacts.blobs import Location

FP = "fp-test"
V1, V2 = "1" * 32, "2" * 32


def _facts(n: int, seed: int):
    ids = [f"f{seed}-{i}" for i in range(n)]
    return facts_table("ann", ids, [[i, i + 1] for i in range(n)], seed)


def _at(store, version):
    table = fact_table.connect(store, Location(store, "ann", FP)).open_table(fact_table.TABLE)
    table.checkout(version)
    return table.to_arrow().sort_by("fact_id")


def test_each_version_reads_back_its_own_facts(store):
    first, second = _facts(3, 1), _facts(5, 2)
    lance_v1 = fact_table.index_embeddings(store, "ann", FP, V1, first)
    lance_v2 = fact_table.index_embeddings(store, "ann", FP, V2, second)
    assert lance_v2 > lance_v1
    assert _at(store, V1).column("fact_id").to_pylist() == first.column("fact_id").to_pylist()
    got = _at(store, V2)
    assert got.column("fact_id").to_pylist() == second.column("fact_id").to_pylist()
    assert got.column("embedding").to_pylist() == second.column("embedding").to_pylist()
    # the table itself holds the newest facts
    db = fact_table.connect(store, Location(store, "ann", FP))
    assert db.open_table(fact_table.TABLE).count_rows() == 5


def test_indexing_a_version_again_keeps_its_tag(store):
    facts = _facts(2, 1)
    fact_table.index_embeddings(store, "ann", FP, V1, facts)
    fact_table.index_embeddings(store, "ann", FP, V1, facts)  # "already exists" is fine
    table = fact_table.connect(store, Location(store, "ann", FP)).open_table(fact_table.TABLE)
    assert list(table.tags.list()) == [V1]


def test_ensure_tag_writes_only_missing_tags(store):
    loc = Location(store, "ann", FP)
    fact_table.ensure_tag(store, loc, V1, _facts(2, 1))  # no table yet: written
    fact_table.ensure_tag(store, loc, V1, _facts(4, 9))  # tag exists: untouched
    assert _at(store, V1).num_rows == 2
    fact_table.ensure_tag(store, loc, V2, _facts(4, 9))
    assert _at(store, V2).num_rows == 4


def test_drop_tags_of_removed_versions(store, caplog):
    loc = Location(store, "ann", FP)
    with caplog.at_level(logging.WARNING):
        fact_table.drop_tags(store, loc, [V1])  # no table: a warning, never an error
    assert "could not open the fact table" in caplog.text
    fact_table.index_embeddings(store, "ann", FP, V1, _facts(2, 1))
    fact_table.index_embeddings(store, "ann", FP, V2, _facts(3, 2))
    fact_table.drop_tags(store, loc, [V1, "f" * 32])  # unknown versions are skipped
    table = fact_table.connect(store, loc).open_table(fact_table.TABLE)
    assert list(table.tags.list()) == [V2]
