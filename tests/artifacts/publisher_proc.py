"""Subprocess helper for the fault-injection and race tests (not a test module).

``crash``: publish A for each user, then fork a child that publishes B and SIGKILL it
after a random delay (uniform over twice a measured publish); prints a JSON report.
``race``: for each round of ``--rounds`` (a JSON list of ``{"seed", "noise", "inputs_at",
"go"}``, all optional but ``seed``), build the inputs (``noise``: other KV bytes for the
same version id), print ``ready``, wait for ``{go_dir}/{go}`` (default ``go{i}``),
publish (with ``inputs_at`` when given) and print the result; several such processes
race on one user.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
import traceback
import warnings
from datetime import datetime

import torch

from builders import crash_inputs, make_inputs
from inferscale.artifacts.layout import StoreConfig
from inferscale.artifacts.publish import publish


def _publish_in_child(store: StoreConfig, user: str, inputs) -> tuple[int, int]:
    """Fork a child publishing ``inputs``; returns (pid, read end of its done-pipe)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            start = time.perf_counter()
            publish(store, user, *inputs)
            os.write(w, json.dumps({"elapsed": time.perf_counter() - start}).encode())
        except BaseException:  # noqa: BLE001 - reported through the exit code
            traceback.print_exc()
            code = 3
        os._exit(code)
    os.close(w)
    return pid, r


def crash(store: StoreConfig, runs: int, seed: int) -> None:
    rng = random.Random(seed)
    pid, r = _publish_in_child(store, "calibrate", crash_inputs("calibrate")[1])
    os.waitpid(pid, 0)
    elapsed = json.loads(os.read(r, 1000))["elapsed"]
    os.close(r)
    report = {"publish_s": elapsed, "runs": []}
    for i in range(runs):
        user = f"u{i:02d}"
        a, b = crash_inputs(user)
        publish(store, user, *a)
        delay = rng.uniform(0, 2.0 * elapsed)
        pid, r = _publish_in_child(store, user, b)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        finished = bool(os.read(r, 1000))
        os.close(r)
        report["runs"].append({"user": user, "delay": delay, "finished": finished,
                               "killed": os.WIFSIGNALED(status)})
    print(json.dumps(report), flush=True)


def race(store: StoreConfig, rounds: list[dict], go_dir: str) -> None:
    for i, job in enumerate(rounds):
        inputs = make_inputs("racer", 200, seed=job["seed"], layers=4, heads=4, head_dim=32,
                             kv_noise=job.get("noise"))
        kw = {"inputs_at": datetime.fromisoformat(job["inputs_at"])} if "inputs_at" in job else {}
        print(json.dumps({"ready": i}), flush=True)
        while not os.path.exists(os.path.join(go_dir, job.get("go", f"go{i}"))):
            time.sleep(0.0005)
        r = publish(store, "racer", *inputs, **kw)
        print(json.dumps({"round": i, "version": r.version, "created": r.created,
                          "digest": r.manifest.files["kv.arrow"].xxh3_128}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["crash", "race"])
    p.add_argument("--root", required=True)
    p.add_argument("--options", default="{}")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", default="[]")
    p.add_argument("--go-dir")
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    __import__("lancedb")  # imported once here, before any fork

    store = StoreConfig(args.root, json.loads(args.options))
    if args.mode == "crash":
        crash(store, args.runs, args.seed)
    else:
        race(store, json.loads(args.rounds), args.go_dir)


if __name__ == "__main__":
    sys.exit(main())
