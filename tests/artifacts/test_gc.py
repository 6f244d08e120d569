"""Garbage collection: the newest versions and LATEST's stay, stale unfinished ones go."""

from __future__ import annotations

import os
import time

import pytest

from builders import make_inputs
from inferscale.artifacts.blobs import Location
from inferscale.artifacts.gc import gc
from inferscale.artifacts.publish import publish
from inferscale.artifacts.read import latest_version, list_versions, open_fact_table

FP = "fp-test"


def test_gc_keeps_newest_and_latest(store):
    versions = []
    inputs = [make_inputs("dave", 2, seed=s) for s in range(4)]
    for memory, facts, lineage in inputs:
        versions.append(publish(store, "dave", memory, facts, lineage).version)
    removed = gc(store, "dave", FP, keep=2)
    assert sorted(removed) == sorted(versions[:2])
    loc = Location(store, "dave", FP)
    assert set(loc.blobs.listdir(loc.dir)) == {*versions[2:], "lance"}  # folders gone
    assert [m.version for m in list_versions(store, "dave", FP)] == versions[2:]
    tags = open_fact_table(store, "dave", FP).tags.list()
    assert set(tags) == set(versions[2:])
    # republish the oldest kept: LATEST now names an older version; keep=1 still keeps it
    publish(store, "dave", *inputs[2])
    assert latest_version(store, "dave", FP) == versions[2]
    assert gc(store, "dave", FP, keep=1) == []
    with pytest.raises(ValueError):
        gc(store, "dave", FP, keep=0)
    # publish(keep=...) collects too
    r = publish(store, "dave", *make_inputs("dave", 2, seed=9), keep=1)
    assert set(r.removed) == set(versions[2:])
    assert [m.version for m in list_versions(store, "dave", FP)] == [r.version]


def test_gc_removes_only_stale_unfinished_versions(local_store):
    store = local_store
    memory, facts, lineage = make_inputs("erin", 2)
    v = publish(store, "erin", memory, facts, lineage).version
    loc = Location(store, "erin", FP)
    stale, fresh = "a" * 32, "b" * 32
    for name in (stale, fresh):
        os.makedirs(loc.version_dir(name))
        with open(loc.file(name, "kv.arrow"), "wb") as f:
            f.write(b"partial")
    old = time.time() - 7200
    os.utime(loc.file(stale, "kv.arrow"), (old, old))
    os.utime(loc.version_dir(stale), (old, old))
    assert gc(store, "erin", FP, keep=5) == [stale]
    assert os.path.exists(loc.version_dir(fresh)) and not os.path.exists(loc.version_dir(stale))
    assert latest_version(store, "erin", FP) == v
