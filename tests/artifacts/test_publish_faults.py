"""Crash and race safety of publishing, with real processes.

- A publisher SIGKILLed at random moments (24 runs on local disk, 10 on S3): afterwards
  LATEST names a complete version whose checksums verify (the old one or the new one),
  and re-running the publish completes the same version id.
- Processes publishing for one user at once: one wins, all end with a valid LATEST;
  with different bytes for one version id, the version verifies and hydrates; with
  inputs of different times, LATEST names the newest.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone
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


class Racers:
    """Publisher processes (``publisher_proc.py race``) started together, each with its
    rounds; the test releases them through go files and reads their results."""

    def __init__(self, store, env, go_dir: Path, rounds: dict[str, list[dict]]):
        self.go_dir = go_dir
        go_dir.mkdir(exist_ok=True)
        self.procs = {
            name: subprocess.Popen(
                [sys.executable, "-X", "faulthandler", HELPER, "race", "--root", store.root,
                 "--options", json.dumps(store.storage_options), "--rounds", json.dumps(r),
                 "--go-dir", str(go_dir)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, r in rounds.items()
        }
        self.lines = {name: queue.Queue() for name in self.procs}
        for name, p in self.procs.items():
            threading.Thread(target=lambda p=p, q=self.lines[name]: [*map(q.put, p.stdout),
                                                                     q.put(None)],
                             daemon=True).start()

    def next(self, name: str) -> dict:
        try:
            line = self.lines[name].get(timeout=180)
        except queue.Empty:
            line = None
        if line is None:
            self.procs[name].kill()
            pytest.fail(f"{name} died or hung: {self.procs[name].stderr.read()[-3000:]}")
        return json.loads(line)

    def ready(self, round_: int, names=None) -> None:
        for name in names or self.procs:
            assert self.next(name) == {"ready": round_}

    def go(self, go: str, names=None) -> list[dict]:
        """Release the publishers waiting for ``go``; their results, in ``names`` order."""
        (self.go_dir / go).touch()
        return [self.next(name) for name in names or self.procs]

    def __enter__(self) -> "Racers":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Wait for the publishers to finish (all rounds done) and check they exited 0;
        on a failed test, kill them at once (they may wait for a go file forever)."""
        for p in self.procs.values():
            if exc_type is not None:
                p.kill()
            try:
                p.wait(timeout=180)
            except subprocess.TimeoutExpired:
                p.kill()
        if exc_type is None:
            for p in self.procs.values():
                assert p.returncode == 0, p.stderr.read()[-3000:]


def racer_inputs(seed: int, noise: int | None = None):
    return make_inputs("racer", 200, seed=seed, layers=4, heads=4, head_dim=32, kv_noise=noise)


def racer_version(seed: int) -> str:
    memory, _, lineage = racer_inputs(seed)
    return version_id("racer", lineage, FP, memory.encoder_config)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_concurrent_publishers(request, child_env, tmp_path, backend):
    store = request.getfixturevalue(f"{backend}_store")
    # round 0: same inputs; round 1: different inputs
    with Racers(store, child_env, tmp_path / "go",
                {"p1": [{"seed": 1}, {"seed": 2}], "p2": [{"seed": 1}, {"seed": 3}]}) as racers:
        results = {}
        for round_ in (0, 1):
            racers.ready(round_)
            results[round_] = racers.go(f"go{round_}")
    same, different = results[0], results[1]
    v1 = racer_version(1)
    assert [r["version"] for r in same] == [v1, v1]
    assert sorted(r["created"] for r in same) == [False, True]  # exactly one created it
    v2, v3 = (r["version"] for r in different)
    assert v2 != v3 and all(r["created"] for r in different)
    latest = latest_version(store, "racer", FP)
    assert latest in (v2, v3)
    for seed, version in ((1, v1), (2, v2), (3, v3)):
        check_complete(store, "racer", version, racer_inputs(seed))


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_racing_publishers_with_different_bytes_for_one_version(request, child_env, tmp_path,
                                                                 backend):
    """Three processes publish the same inputs (one version id) with different KV bytes,
    as a CUDA/bf16 and a CPU/fp32 encoder would: whoever wins, the version verifies and
    hydrates to the winner's bytes, and every publisher reports the winner's manifest."""
    store = request.getfixturevalue(f"{backend}_store")
    seeds, names = (11, 12, 13), ("a", "b", "c")
    with Racers(store, child_env, tmp_path / "go", {
            name: [{"seed": seed, "noise": 100 * k + i} for i, seed in enumerate(seeds)]
            for k, name in enumerate(names)}) as racers:
        results = []
        for round_ in range(len(seeds)):
            racers.ready(round_)
            results.append(racers.go(f"go{round_}"))
    for i, (seed, rs) in enumerate(zip(seeds, results)):
        version = racer_version(seed)
        assert {r["version"] for r in rs} == {version}
        assert sorted(r["created"] for r in rs) == [False, False, True]
        m = verify_version(store, "racer", FP, version)
        assert {r["digest"] for r in rs} == {m.files["kv.arrow"].xxh3_128}
        h = hydrate(store, "racer", FP, version)
        candidates = [racer_inputs(seed, 100 * k + i)[0] for k in range(len(names))]
        assert sum(torch.equal(h.slab, expected_slab(c)) for c in candidates) == 1
    assert latest_version(store, "racer", FP) == racer_version(seeds[-1])


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_latest_names_the_newest_inputs_whatever_finishes_last(request, child_env, tmp_path,
                                                               backend):
    """Publishers of different inputs race; LATEST must name the newest inputs (the
    latest ``inputs_at``), never move back to older ones that finish later.
    Round 0: the newest publisher finishes first, the two older ones race after it.
    Round 1: all three at once, the newest in the middle of the list."""
    store = request.getfixturevalue(f"{backend}_store")
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    at = {name: [(t0 + timedelta(hours=h)).isoformat() for h in hours]
          for name, hours in {"new": (2, 11), "mid": (1, 12), "old": (0, 10)}.items()}
    seeds = {"new": (21, 31), "mid": (22, 32), "old": (23, 33)}
    with Racers(store, child_env, tmp_path / "go", {
            name: [{"seed": seeds[name][0], "inputs_at": at[name][0],
                    "go": "first" if name == "new" else "rest"},
                   {"seed": seeds[name][1], "inputs_at": at[name][1]}]
            for name in ("new", "mid", "old")}) as racers:
        racers.ready(0)
        racers.go("first", ["new"])
        racers.go("rest", ["mid", "old"])
        assert latest_version(store, "racer", FP) == racer_version(seeds["new"][0])
        racers.ready(1)
        racers.go("go1")
    assert latest_version(store, "racer", FP) == racer_version(seeds["mid"][1])
    for name in seeds:  # the versions that did not become LATEST are complete all the same
        for seed in seeds[name]:
            check_complete(store, "racer", racer_version(seed), racer_inputs(seed))
