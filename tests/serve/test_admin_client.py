"""The admin key leaves the process only for configured servers, never on a command line."""

from __future__ import annotations

import pytest

from inferscale.serve.admin_client import AdminKeyRefused, admin_client_for, origin


def test_origins_compare_scheme_host_and_port():
    assert origin("http://127.0.0.1:8000/") == ("http", "127.0.0.1", 8000)
    assert origin("HTTP://LocalHost:8000/admin") == ("http", "localhost", 8000)
    assert origin("https://serve.example.com") == ("https", "serve.example.com", 443)
    for bad in ("ftp://x", "127.0.0.1:8000", "http://"):
        with pytest.raises(ValueError):
            origin(bad)


def test_the_key_is_attached_only_for_allowed_servers():
    allowed = ["http://127.0.0.1:8000", "https://serve.internal"]
    assert admin_client_for("http://127.0.0.1:8000/", "k", allowed).admin_key == "k"
    assert admin_client_for("https://SERVE.internal:443", "k", allowed).admin_key == "k"
    for url in ("http://127.0.0.1:8001", "https://127.0.0.1:8000", "http://evil.example",
                "http://serve.internal", "http://127.0.0.1:8000@evil.example"):
        with pytest.raises(AdminKeyRefused, match="INFERSCALE_SERVER_URLS"):
            admin_client_for(url, "k", allowed)
    # no key configured: nothing secret to protect
    assert admin_client_for("http://elsewhere:9000", None, allowed).admin_key is None


def test_default_allow_list_is_this_hosts_server(monkeypatch):
    from inferscale.settings import Settings

    monkeypatch.delenv("INFERSCALE_SERVER_URLS", raising=False)
    monkeypatch.setenv("INFERSCALE_PORT", "8123")
    assert "http://127.0.0.1:8123" in Settings().admin_urls()
    monkeypatch.setenv("INFERSCALE_SERVER_URLS", '["https://a.internal:9443"]')
    assert Settings().admin_urls() == ["https://a.internal:9443"]


def test_the_cli_takes_no_key_on_its_command_line(tmp_path, monkeypatch, capsys):
    from inferscale.cli import _admin, build_parser
    from inferscale.settings import Settings

    for argv in (["hydrate", "ann", "--admin-key", "s3cret"], ["status", "--admin-key", "x"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
    capsys.readouterr()
    key_file = tmp_path / "admin.key"
    key_file.write_text("from-file\n")
    monkeypatch.setenv("INFERSCALE_ADMIN_KEY", "from-env")
    monkeypatch.delenv("INFERSCALE_SERVER_URLS", raising=False)
    monkeypatch.delenv("INFERSCALE_PORT", raising=False)
    args = build_parser().parse_args(["status", "--admin-key-file", str(key_file)])
    assert _admin(args, Settings()).admin_key == "from-file"
    args = build_parser().parse_args(["evict", "ann"])
    assert _admin(args, Settings()).admin_key == "from-env"
    args = build_parser().parse_args(["evict", "ann", "--url", "http://evil.example:8000"])
    with pytest.raises(AdminKeyRefused):
        _admin(args, Settings())
