"""The command line answers like a tool: one line and a non-zero status when there is
nothing to talk to or nothing to list, for bad input and for bad settings (found before
vLLM is imported); the admin commands find the configured server; every option of every
subcommand explained, with its default."""

from __future__ import annotations

import argparse
import json
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


# ------------------------------------------------------------------ bad input, bad settings

# main() in a fresh interpreter, then what it imported: vLLM (and Ray) must not be
RUN_MAIN = """
import json, sys
from inferscale.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
print(json.dumps({"rc": rc, "vllm": "vllm" in sys.modules, "ray": "ray" in sys.modules}))
"""


def run_main(argv: list[str], env: dict[str, str]) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", RUN_MAIN, *argv], capture_output=True,
                          text=True, env=env, timeout=300)
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def assert_one_line(err: str, command: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"inferscale {command}: "), err
    for word in words:
        assert word in lines[0], (word, err)


@pytest.mark.parametrize("argv, words", [
    (["versions", "--user", "../etc"], ["--user", "'../etc'", "'/'"]),
    (["versions", "--user", "a b"], ["--user", "'a b'", "whitespace"]),
    (["versions", "--user", "maya", "--artifact-root", "/etc/passwd"],
     ["/etc/passwd", "not a directory"]),
    (["hydrate", "../etc"], ["'../etc'"]),
    (["encode", "--users", "a b"], ["--users", "whitespace"]),
    (["encode", "--window", "-1"], ["--window", ">= 0"]),
    (["serve", "--artifact-root", "/etc/passwd"], ["/etc/passwd", "not a directory"]),
])
def test_bad_input_is_one_line_and_fails(argv, words, child_env):
    out, err = run_main(argv, child_env)
    assert out["rc"] == 2 and not out["vllm"] and not out["ray"], (out, err)
    assert_one_line(err, argv[0], *words)


BAD_SETTINGS = [("notjson", "INFERSCALE_API_KEYS cannot be parsed"),
                ('{"s3cret": "bad user"}', "INFERSCALE_API_KEYS: user id 'bad user' contains"),
                ('{"s3cret": ann}', "INFERSCALE_API_KEYS cannot be parsed"),
                ('{"s3cret": 5}', "INFERSCALE_API_KEYS: Input should be a valid string")]


@pytest.mark.parametrize("keys, words", BAD_SETTINGS)
@pytest.mark.parametrize("argv", [["serve"], ["serve", "--replicas", "2"], ["status"],
                                  ["hydrate", "maya"], ["evict", "maya"], ["encode"],
                                  ["versions", "--user", "maya"]])
def test_bad_settings_are_one_line_before_vllm_is_imported(argv, keys, words, child_env):
    out, err = run_main(argv, {**child_env, "INFERSCALE_API_KEYS": keys})
    assert out["rc"] == 2 and not out["vllm"] and not out["ray"], (out, err)
    assert_one_line(err, argv[0], "bad settings", words)
    assert "s3cret" not in err  # a key is a secret: never echoed


def test_a_refused_access_policy_is_one_line_before_vllm_is_imported(child_env):
    env = {**child_env, "INFERSCALE_API_KEYS": '{"k": "ann"}'}
    env.pop("INFERSCALE_ADMIN_KEY", None)
    out, err = run_main(["serve"], env)
    assert out["rc"] == 2 and not out["vllm"], (out, err)
    assert_one_line(err, "serve", "INFERSCALE_ADMIN_KEY is not", "refusing to start")


# ------------------------------------------------------------------ the configured server


@pytest.mark.parametrize("host, url", [
    ("127.0.0.1", "http://127.0.0.1:{port}"), ("0.0.0.0", "http://127.0.0.1:{port}"),
    ("localhost", "http://localhost:{port}"), ("::", "http://[::1]:{port}"),
    ("::1", "http://[::1]:{port}")])
def test_the_admin_commands_talk_to_the_configured_server(host, url, monkeypatch, capsys):
    """INFERSCALE_HOST/PORT decide the default ``--url`` and the allow-list of the admin
    key alike: the key goes there (nothing listens, so the call fails, but it is sent,
    not refused); a URL of another port is refused before anything is sent."""
    port = int(_unused_url().rsplit(":", 1)[1])
    url = url.format(port=port)
    monkeypatch.setenv("INFERSCALE_HOST", host)
    monkeypatch.setenv("INFERSCALE_PORT", str(port))
    monkeypatch.setenv("INFERSCALE_ADMIN_KEY", "k")
    monkeypatch.delenv("INFERSCALE_SERVER_URLS", raising=False)
    for argv in (["status"], ["hydrate", "maya"], ["status", "--url", url]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"inferscale {argv[0]}: no server answers at {url} ("), err
    other = f"http://127.0.0.1:{port + 1}"
    assert main(["status", "--url", other]) == 1
    assert "is not a configured server" in capsys.readouterr().err


def test_help_shows_defaults_and_their_values_now(monkeypatch, capsys):
    monkeypatch.setenv("INFERSCALE_PORT", "8101")
    monkeypatch.setenv("INFERSCALE_WINDOW", "7")
    for argv, shown in ((["status", "--help"], "now http://127.0.0.1:8101"),
                        (["serve", "--help"], "(default: kv)"),
                        (["serve", "--help"], "now 8101"),
                        (["encode", "--help"], "now 7"),
                        (["hydrate", "--help"], "(default: gpu)"),
                        (["hydrate", "--help"], "{gpu,host,facts}")):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0
        assert shown in " ".join(capsys.readouterr().out.split()), (argv, shown)
    # bad settings do not break --help: it names the variables without their values
    monkeypatch.setenv("INFERSCALE_API_KEYS", "notjson")
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    assert "INFERSCALE_HOST:INFERSCALE_PORT" in " ".join(capsys.readouterr().out.split())


def test_version_is_the_package_version(child_env):
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    proc = subprocess.run([sys.executable, "-m", "inferscale.cli", "--version"],
                          capture_output=True, text=True, env=child_env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"inferscale {version}"
