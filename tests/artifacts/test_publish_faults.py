"""Crash and race safety of publishing, with real processes.

- A publisher SIGKILLed at random moments (24 runs on local disk, 10 on S3): afterwards
  LATEST names a complete version whose checksums verify (the old one or the new one),
  and re-running the publish completes the same version id.
- Two processes publishing for one user at once: one wins, both end with a valid LATEST.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from builders import crash_inputs, expected_slab, make_inputs
from inferscale.artifacts.publish import publish, version_id
from inferscale.artifacts.read import (
    latest_version, list_versions, open_fact_table, read_facts, verify_version,
)
from inferscale.hydrate.slab import hydrate

FP = "fp-test"
HELPER = str(Path(__file__).with_name("publisher_proc.py"))


def run_crash_driver(store, env, runs: int, seed: int) -> dict:
    out = subprocess.run(
        [sys.executable, HELPER, "crash", "--root", store.root,
         "--options", json.dumps(store.storage_options), "--runs", str(runs), "--seed", str(seed)],
        env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_complete(store, user, version, inputs):
    memory, facts, _ = inputs
    m = verify_version(store, user, FP, version)
    assert m.version == version
    assert torch.equal(hydrate(store, user, FP, version).slab, expected_slab(memory))
    assert read_facts(store, user, FP, version).equals(facts)
    assert open_fact_table(store, user, FP, version).to_arrow().num_rows == facts.num_rows


@pytest.mark.parametrize("backend, runs", [("local", 24), ("s3", 10)])
def test_publisher_killed_at_random_points(request, child_env, backend, runs):
    store = request.getfixturevalue(f"{backend}_store")
    report = run_crash_driver(store, child_env, runs, seed=1234 if backend == "local" else 99)
    outcomes = {"old": 0, "new": 0, "partial": 0}
    for run in report["runs"]:
        user = run["user"]
        a, b = crash_inputs(user)
        va = version_id(user, a[2], FP, a[0].encoder_config)
        vb = version_id(user, b[2], FP, b[0].encoder_config)
        latest = latest_version(store, user, FP)
        assert latest in (va, vb), run
        check_complete(store, user, latest, a if latest == va else b)
        listed = [m.version for m in list_versions(store, user, FP)]
        assert set(listed) <= {va, vb} and latest in listed
        for v in listed:
            verify_version(store, user, FP, v)
        outcomes["new" if latest == vb else "old"] += 1
        if latest == va and vb in version_dirs(store, user):
            outcomes["partial"] += 1
        rerun = publish(store, user, *b)
        assert rerun.version == vb
        assert rerun.created == (vb not in listed)
        assert latest_version(store, user, FP) == vb
        check_complete(store, user, vb, b)
    print(f"\n{backend}: publish {report['publish_s']:.3f}s, outcomes {outcomes}")
    # some kills must have landed in the middle of writing B (else nothing was tested)
    assert outcomes["partial"] >= 1, outcomes


def version_dirs(store, user):
    from inferscale.artifacts.blobs import Location

    loc = Location(store, user, FP)
    return loc.blobs.listdir(loc.dir)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_concurrent_publishers(request, child_env, tmp_path, backend):
    store = request.getfixturevalue(f"{backend}_store")
    go = tmp_path / "go"
    go.mkdir()
    seeds = {"p1": "1,2", "p2": "1,3"}  # round 0: same inputs; round 1: different inputs
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-X", "faulthandler", HELPER, "race", "--root", store.root, "--options",
             json.dumps(store.storage_options), "--seeds", s, "--go-dir", str(go)],
            env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, s in seeds.items()
    }
    lines = {name: queue.Queue() for name in procs}
    for name, p in procs.items():
        threading.Thread(target=lambda p=p, q=lines[name]: [*map(q.put, p.stdout), q.put(None)],
                         daemon=True).start()

    def next_line(name: str) -> dict:
        try:
            line = lines[name].get(timeout=120)
        except queue.Empty:
            line = None
        if line is None:
            procs[name].kill()
            pytest.fail(f"{name} died or hung: {procs[name].stderr.read()[-3000:]}")
        return json.loads(line)

    results: dict[int, list[dict]] = {0: [], 1: []}
    try:
        for round_ in (0, 1):
            for name in procs:
                assert next_line(name) == {"ready": round_}
            (go / f"go{round_}").touch()
            for name in procs:
                results[round_].append(next_line(name))
    finally:
        for p in procs.values():
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
    for p in procs.values():
        assert p.returncode == 0, p.stderr.read()[-3000:]

    same, different = results[0], results[1]
    v1 = version_id("racer", make_inputs("racer", 0, seed=1)[2], FP,
                      make_inputs("racer", 0, seed=1)[0].encoder_config)
    assert [r["version"] for r in same] == [v1, v1]
    assert sorted(r["created"] for r in same) == [False, True]  # exactly one created it
    v2, v3 = (r["version"] for r in different)
    assert v2 != v3 and all(r["created"] for r in different)
    latest = latest_version(store, "racer", FP)
    assert latest in (v2, v3)
    for seed, version in ((1, v1), (2, v2), (3, v3)):
        inputs = make_inputs("racer", 200, seed=seed, layers=4, heads=4, head_dim=32)
        check_complete(store, "racer", version, inputs)
