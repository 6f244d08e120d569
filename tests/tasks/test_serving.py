"""The hydrate task sends INFERSCALE_ADMIN_KEY only to configured servers: a recording
HTTP server on loopback sees no request while it is not on INFERSCALE_SERVER_URLS."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytestmark = pytest.mark.slow  # the real Prefect server


@contextmanager
def recording_server():
    """An HTTP server on 127.0.0.1 answering every POST like /admin/hydrate, recording
    (method, path, Authorization) of each request."""
    seen: list[tuple[str, str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the stdlib's name
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append(("POST", self.path, self.headers.get("Authorization")))
            body = json.dumps({"version": "v1", "tier": "gpu", "bytes": 1}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    finally:
        httpd.shutdown()
        thread.join(10)


def test_admin_key_goes_only_to_configured_servers(flow_env, monkeypatch):
    from tasks.serving import hydrate_user

    monkeypatch.setenv("INFERSCALE_ADMIN_KEY", "adm1n-secret")
    monkeypatch.delenv("INFERSCALE_SERVER_URLS", raising=False)
    with recording_server() as (url, seen):
        state = hydrate_user(url, "ann", return_state=True)
        assert state.is_failed()
        assert "INFERSCALE_SERVER_URLS" in str(state.result(raise_on_failure=False))
        assert seen == []  # nothing reached the unlisted server, key or not

        monkeypatch.setenv("INFERSCALE_SERVER_URLS", json.dumps([url]))
        assert hydrate_user(url, "ann")["version"] == "v1"
        assert seen == [("POST", "/admin/hydrate", "Bearer adm1n-secret")]
