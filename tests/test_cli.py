"""The command line answers like a tool: one line and a non-zero status when there is
nothing to talk to or nothing to list, and every option of every subcommand explained."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from inferscale.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]


def _unused_url() -> str:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_status_without_a_server_is_one_line_and_fails(child_env):
    url = _unused_url()
    proc = subprocess.run([sys.executable, "-m", "inferscale.cli", "status", "--url", url],
                          capture_output=True, text=True, env=child_env, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"inferscale status: no server answers at {url} (")


@pytest.mark.parametrize("argv", [["hydrate", "maya"], ["evict", "maya"]])
def test_admin_commands_without_a_server_fail_in_one_line(argv, capsys):
    url = _unused_url()
    assert main([*argv, "--url", url]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert f"inferscale {argv[0]}: no server answers at {url}" in err


def test_a_bad_url_is_one_line(capsys):
    assert main(["status", "--url", "127.0.0.1:8000"]) == 1
    assert "server URL must be http(s)://" in capsys.readouterr().err


def test_versions_of_an_unknown_user_says_where_it_looked(tmp_path, capsys):
    root = tmp_path / "artifacts"
    assert main(["versions", "--user", "maya", "--artifact-root", str(root)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "no versions of user 'maya' for model " in err and str(root) in err


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _explains_every_option(name: str, parser: argparse.ArgumentParser, run_help, capsys):
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and len(action.help) > 8, (name, action.dest)
    with pytest.raises(SystemExit) as done:
        run_help()
    assert done.value.code == 0
    text = capsys.readouterr().out
    for action in parser._actions:  # each option and its explanation are printed
        label = action.option_strings[0] if action.option_strings else action.dest
        assert label in text, (name, label)
        assert action.help.split()[0] in text, (name, action.help)


def test_every_option_of_every_subcommand_is_explained(capsys):
    subs = _subcommands()
    assert set(subs) == {"encode", "serve", "hydrate", "evict", "status", "versions"}
    for name, parser in subs.items():
        _explains_every_option(name, parser, lambda: main([name, "--help"]), capsys)


def test_the_demo_is_a_command_of_its_own(capsys):
    """The demo runs a Prefect flow, so it lives in flows/ (the library never imports
    Prefect), as the ``inferscale-demo`` script ``make demo`` runs."""
    import tomllib

    from flows import demo

    _explains_every_option("inferscale-demo", demo.build_parser(), lambda: demo.main(["--help"]),
                           capsys)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["inferscale-demo"] == "flows.demo:main"
    assert "$(VENV)/bin/inferscale-demo" in (REPO / "Makefile").read_text()
