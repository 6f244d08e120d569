"""Deployments from prefect.yaml, run by a process worker against the real local server;
lineage read back through the API and in the UI (headless Chromium); a worker killed in
the middle of a run, then the run again: complete, no duplicate, nothing partial; runs
that fail some users end Failed, with their report read back from the API."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from chromium import Browser, chromium_binary
from prefect_env import (
    PREFECT, REPO, _free_port, artifacts_of_run, artifacts_with_key, kill_tree, table_rows,
    task_runs_of,
)

pytestmark = pytest.mark.slow
POOL = "inferscale"
SCREENSHOTS = REPO / "tests" / "_artifacts"

ROWS_JS = """(() => {
  const item = document.querySelectorAll('.artifact-timeline-item-content')[%d];
  const table = item && item.querySelector('table');
  if (!table) return null;
  const rows = Array.from(table.querySelectorAll('tr')).map(
    r => Array.from(r.querySelectorAll('th,td')).map(c => c.innerText.trim()));
  const need = ['version', 'previous version', 'parent: log', 'parent: facts',
                'model fingerprint', 'files'];  // wait until the whole table is rendered
  return need.every(f => rows.some(r => r[0] === f && r[1])) ? rows : null;
})()"""


def start_worker(tmp_path: Path, name: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "ab")
    return subprocess.Popen([*PREFECT, "worker", "start", "--pool", POOL, "--type", "process",
                             "--name", name], cwd=REPO, env=os.environ.copy(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def run_deployment(name: str, parameters: dict):
    from prefect.deployments import run_deployment as run

    return run(name, parameters=parameters, timeout=0)


def wait_final(flow_run_id, timeout: float = 600):
    from prefect import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            fr = client.read_flow_run(flow_run_id)
            if fr.state and fr.state.is_final():
                return fr
            if time.monotonic() > deadline:
                raise TimeoutError(f"flow run {flow_run_id} still {fr.state and fr.state.name}")
            time.sleep(1)


@pytest.fixture(scope="module")
def deployed(flow_env):
    """The work pool and every deployment of prefect.yaml (`prefect deploy --all`)."""
    from prefect import get_client

    flow_env.cli("work-pool", "create", POOL, "--type", "process")
    flow_env.cli("--no-prompt", "deploy", "--all")
    with get_client(sync_client=True) as client:
        deps = {d.name: d for d in client.read_deployments()}
    return flow_env, deps


def test_prefect_yaml_deployments(deployed):
    _, deps = deployed
    assert set(deps) >= {"encode", "nightly", "backfill", "hydrate"}
    assert {d.entrypoint for d in deps.values()} >= {
        "flows/encode.py:encode_users", "flows/nightly.py:nightly_reencode",
        "flows/backfill.py:backfill_model", "flows/hydrate.py:hydrate_serving"}
    assert all(d.work_pool_name == POOL for d in deps.values())
    (sched,) = deps["nightly"].schedules
    assert sched.schedule.cron == "0 2 * * *" and sched.active
    assert deps["backfill"].parameters["model"] == "embedded"
    props = deps["encode"].parameter_openapi_schema["properties"]
    assert "every user found in the logs" in props["users"]["description"]  # documented
    assert props["task_runner"]["enum"] == ["threads", "ray"] or \
        "threads" in str(props["task_runner"])


def test_encode_deployment_lineage_in_api_and_ui(deployed, tmp_path, inferscale_home):
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.lineage_view import artifact_key
    from inferscale.artifacts.read import list_versions, verify_version

    root = tmp_path / "artifacts"
    worker = start_worker(tmp_path, f"w-{uuid.uuid4().hex[:6]}")
    try:
        fr = run_deployment("encode-users/encode", {
            "artifact_root": str(root), "fact_mode": "raw", "window": 1})
        fr = wait_final(fr.id)
    finally:
        kill_tree(worker)
    assert fr.state.is_completed(), fr.state
    # read everything back through the API
    store = StoreConfig(str(root))
    fp = _embedded_fp(inferscale_home)
    arts = artifacts_of_run(fr.id)
    (summary,) = [a for a in arts if a.key == "inferscale-encode-summary"]
    tables = {a.key: a for a in arts if a.type == "table"}
    for user in ("maya", "tomas"):
        (m,) = list_versions(store, user, fp)
        key = artifact_key(user, fp)
        assert key in tables and f"/artifacts/key/{key}" in summary.data
        rows = {r["field"]: r["value"] for r in table_rows(tables[key])}
        assert rows["version"] == m.version and rows["parent: log"] == m.parents["log"]
        assert rows["parent: facts"] == m.parents["facts"]
        assert '"window": 1' in rows["encoder config"]
    names = {r.name for r in task_runs_of(fr.id)}
    assert {"encode-user-maya", "encode-kv-maya", "publish-maya", "record-version-maya"} <= names

    # the UI: open maya's key, walk the timeline, find the lineage table of every version
    if chromium_binary() is None:
        pytest.fail("chromium is not installed: apt-get install -y chromium")
    m = verify_version(store, "maya", fp)
    key = artifact_key("maya", fp)
    known = [table_rows(a) for a in artifacts_with_key(key)]
    with Browser(tmp_path / "chromium-profile") as b:
        b.open(f"{deployed[0].url}/artifacts/key/{key}")
        n = b.wait_for("document.querySelectorAll('.artifact-timeline-item-content__heading')"
                       ".length", 90)
        assert n == len(known)
        shown = []
        for i in range(n):
            b.eval("document.querySelectorAll('.artifact-timeline-item-content__heading')"
                   f"[{i}].click()")
            rows = {r[0]: r[1] for r in b.wait_for(ROWS_JS % i, 60) if len(r) == 2}
            shown.append(rows)
            assert {"parent: log", "parent: facts", "model fingerprint"} <= set(rows), rows
        assert shown[0]["version"] == m.version  # newest first: this run's version
        assert shown[0]["parent: log"] == m.parents["log"]
        assert shown[0]["files"].endswith(m.version)
        assert sorted(r["version"] for r in shown) == sorted(
            next(x["value"] for x in rows_ if x["field"] == "version") for rows_ in known)
        header = b.eval("document.body.innerText")
        assert key in header and m.version in header
        shot = b.screenshot(tmp_path / "artifact-key-maya.png")
    assert shot.stat().st_size > 20_000
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, SCREENSHOTS / "artifact-key-maya.png")


def _embedded_fp(home) -> str:
    from inferscale.models import checkpoint_fingerprint, resolve_checkpoint

    return checkpoint_fingerprint(resolve_checkpoint("embedded", home), home)


def _version_dirs(store, user, fp):
    from inferscale.artifacts.layout import VERSION_RE

    d = Path(store.root) / "users" / user / fp
    return sorted(p.name for p in d.iterdir() if VERSION_RE.fullmatch(p.name))


def test_worker_killed_mid_flow_then_rerun(deployed, tmp_path, inferscale_home):
    from inferscale.artifacts.layout import MANIFEST_FILE, StoreConfig
    from inferscale.artifacts.lineage_view import artifact_key, version_of_rows
    from inferscale.artifacts.read import latest_version, verify_version

    fp = _embedded_fp(inferscale_home)
    root = tmp_path / "artifacts"
    store = StoreConfig(str(root))
    # window 0: inputs nobody encoded yet in this session (so the run does real work) and
    # the cheapest to encode; one user at a time; a limit large enough that the killed
    # run's leases (held up to a minute) do not block the rerun
    params = {"artifact_root": str(root), "fact_mode": "raw", "window": 0, "max_workers": 1,
              "concurrency_limit": 4}
    worker = start_worker(tmp_path, "doomed")
    killed_at = None
    try:
        fr1 = run_deployment("encode-users/encode", params)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # kill as soon as the first user is published
            if latest_version(store, "maya", fp) is not None:
                kill_tree(worker, sig_kill=True)
                killed_at = time.monotonic()
                break
            time.sleep(0.05)
    finally:
        kill_tree(worker, sig_kill=True)
    assert killed_at is not None, "the first user was never published"
    assert latest_version(store, "tomas", fp) is None, "the kill came after the run's end"
    from prefect import get_client

    with get_client(sync_client=True) as client:
        assert not client.read_flow_run(fr1.id).state.is_final()  # it died running

    worker = start_worker(tmp_path, "survivor")
    try:
        fr2 = wait_final(run_deployment("encode-users/encode", params).id)
    finally:
        kill_tree(worker)
    assert fr2.state.is_completed(), fr2.state
    for user in ("maya", "tomas"):
        m = verify_version(store, user, fp)  # LATEST complete, every checksum right
        assert _version_dirs(store, user, fp) == [m.version]  # no duplicate, no leftover
        assert (Path(store.root) / "users" / user / fp / m.version / MANIFEST_FILE).exists()
        assert m.encoder_config["window"] == 0
        recorded = [version_of_rows(table_rows(a))
                    for a in artifacts_with_key(artifact_key(user, fp))]
        assert recorded.count(m.version) == 1, recorded  # recorded once, never twice
    # maya was published before the kill: the rerun did not encode her again
    names = {r.name for r in task_runs_of(fr2.id)}
    assert "encode-kv-maya" not in names and "encode-kv-tomas" in names


def _worker_reported_exit(log: Path, run_name: str, timeout: float = 60) -> str:
    """The worker's log once it has reported how the run's process exited."""
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text(errors="replace")
        if f"Process for flow run {run_name!r} exited" in text:
            return text
        assert time.monotonic() < deadline, text[-3000:]
        time.sleep(0.5)


def test_runs_that_fail_some_users_end_failed_with_their_report(deployed, tmp_path,
                                                                  monkeypatch):
    """The hydrate deployment with users the server refuses (here: the worker's configured
    server, http://127.0.0.1:INFERSCALE_PORT by default, is not on INFERSCALE_SERVER_URLS,
    so the admin key may not go there: refused before anything is sent) and the encode
    deployment with a
    damaged store for tomas: each run ends Failed, not Crashed; the engine raises the run's
    ``UsersFailed`` (no ``TypeError: Unexpected result for failed state``) and its process
    exits 1, as Prefect's does for every Failed run; the per-user report comes back from
    the API through the run's state, and the encode run's summary artifact lists it."""
    from prefect import get_client

    from flows.results import UsersFailed

    root = tmp_path / "artifacts"
    (root / "users").mkdir(parents=True)
    (root / "users" / "tomas").write_text("not a folder")
    port = _free_port()
    monkeypatch.setenv("INFERSCALE_ADMIN_KEY", "k")  # the worker's environment
    monkeypatch.setenv("INFERSCALE_PORT", str(port))
    monkeypatch.setenv("INFERSCALE_SERVER_URLS", '["http://127.0.0.1:1"]')
    name = f"w-{uuid.uuid4().hex[:6]}"
    worker = start_worker(tmp_path, name)
    try:
        runs = {
            "hydrate": run_deployment("hydrate-serving/hydrate", {
                "users": ["nobody", "tomas"], "tier": "gpu"}),  # prefect.yaml: server_url null
            "encode": run_deployment("encode-users/encode", {
                "users": ["maya", "tomas"], "artifact_root": str(root), "fact_mode": "raw",
                "window": 1})}
        final = {k: wait_final(fr.id) for k, fr in runs.items()}
        log = ""
        for fr in final.values():
            log = _worker_reported_exit(tmp_path / f"{name}.log", fr.name)
    finally:
        kill_tree(worker)
    assert "Unexpected result for failed state" not in log and "TypeError" not in log, log
    hydrate, encode = final["hydrate"], final["encode"]
    assert f"Process for flow run {hydrate.name!r} exited with status code: 1" in log
    assert "flows.results.UsersFailed: 2 of 2 users not hydrated: nobody, tomas" in log
    assert "flows.results.UsersFailed: 1 of 2 users failed: tomas" in log
    with get_client(sync_client=True) as client:  # after the worker saw the exit: still Failed
        hydrate, encode = (client.read_flow_run(fr.id) for fr in (hydrate, encode))
    assert hydrate.state.is_failed() and hydrate.state.name == "Failed", hydrate.state
    assert hydrate.state.message == "2 of 2 users not hydrated: nobody, tomas"
    assert encode.state.is_failed() and encode.state.message == "1 of 2 users failed: tomas"

    failed = hydrate.state.result(raise_on_failure=False)  # read back from result storage
    assert isinstance(failed, UsersFailed) and str(failed) == hydrate.state.message
    rows = failed.report["users"]
    assert {u: r["status"] for u, r in rows.items()} == {"nobody": "failed", "tomas": "failed"}
    assert failed.report["server_url"] == f"http://127.0.0.1:{port}"
    assert f"http://127.0.0.1:{port} is not a configured server" in rows["nobody"]["error"]
    with pytest.raises(UsersFailed):
        hydrate.state.result()
    report = encode.state.result(raise_on_failure=False).report
    assert report["users"]["maya"]["status"] == "published"
    assert report["users"]["tomas"]["status"] == "failed"
    assert "NotADirectoryError" in report["users"]["tomas"]["error"]
    (summary,) = [a for a in artifacts_of_run(encode.id) if a.key == "inferscale-encode-summary"]
    assert "| tomas | failed: NotADirectoryError" in summary.data
