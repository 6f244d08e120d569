"""``make demo`` publishes where the ``inferscale`` command looks by default, so the
README's next commands find its users with no flag; it never writes into a store of the
user's own (a configured root, or sample users published from other logs there), and
then says where it published and how to look there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flows.demo import _next_steps, demo_root


@pytest.mark.slow
def test_the_demo_publishes_where_the_cli_looks(flow_env, own_home):
    """(No capsys here: Prefect's log handler would keep the captured stream.)"""
    from flows.demo import publish_sample
    from inferscale.settings import Settings

    settings = Settings()
    root, why = demo_root(settings)
    assert (root, why) == (str(own_home / "artifacts"), None)
    assert root == settings.resolved_artifact_root()  # the CLI's default
    report = publish_sample("raw", root, window=2)
    assert {u: r["status"] for u, r in report["users"].items()} == {
        "maya": "published", "tomas": "published"}
    for user in ("maya", "tomas"):  # the README's next command, no flag
        proc = subprocess.run([sys.executable, "-m", "inferscale.cli", "versions", "--user",
                               user], capture_output=True, text=True, env=os.environ.copy(),
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert f"* {report['users'][user]['version']}" in proc.stdout
    # its own users are no reason to move: the next demo publishes there again
    assert demo_root(Settings()) == (root, None)
    assert "export" not in _next_steps(root, None)


def test_the_demo_never_writes_into_a_store_of_yours(own_home, tmp_path, monkeypatch):
    from builders import make_inputs

    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.publish import publish
    from inferscale.models import checkpoint_fingerprint, resolve_checkpoint
    from inferscale.settings import Settings

    demo_folder = str(own_home / "demo" / "artifacts")
    monkeypatch.setenv("INFERSCALE_ARTIFACT_ROOT", str(tmp_path / "mine"))
    root, why = demo_root(Settings())
    assert root == demo_folder and "INFERSCALE_ARTIFACT_ROOT" in why
    assert f"export INFERSCALE_ARTIFACT_ROOT={demo_folder}" in _next_steps(root, why)
    monkeypatch.delenv("INFERSCALE_ARTIFACT_ROOT")

    # a maya of other logs in the default root, for the demo's model
    fp = checkpoint_fingerprint(resolve_checkpoint("embedded", own_home), own_home)
    memory, facts, lineage = make_inputs("maya", fp=fp)
    publish(StoreConfig(str(own_home / "artifacts")), "maya", memory, facts, lineage,
            embeddings=False)
    root, why = demo_root(Settings())
    assert root == demo_folder and "maya" in why and "tomas" not in why
    # a root named on the command line is used as it is
    assert demo_root(Settings(), str(tmp_path / "x")) == (str(tmp_path / "x"),
                                                          "--artifact-root named it")
    default = str(own_home / "artifacts")
    assert demo_root(Settings(), default) == (default, None)
