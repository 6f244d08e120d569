"""Headless Chromium driven through the DevTools protocol, for UI tests.

Debian's ``chromium`` with the flags that keep it off the network and out of the user's
profile (a new ``--user-data-dir``), ``--remote-debugging-port=0`` (the port it picks
is read from ``DevToolsActivePort``), one page target driven over its websocket:
navigate, evaluate JavaScript, wait for a condition, take screenshots.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1800"]


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """``with Browser(profile_dir) as b: b.open(url); b.wait_for(js); b.screenshot(p)``."""

    def __init__(self, profile_dir: Path, timeout: float = 60, width: int = 1400,
                 height: int = 1800):
        self.profile_dir = Path(profile_dir)
        self.width, self.height = width, height
        self.timeout = timeout
        self._ids = itertools.count(1)

    def __enter__(self) -> "Browser":
        binary = chromium_binary()
        if binary is None:
            raise RuntimeError("chromium is not installed (apt-get install -y chromium)")
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        (self.profile_dir / "DevToolsActivePort").unlink(missing_ok=True)
        self.log = open(self.profile_dir.parent / f"{self.profile_dir.name}.log", "ab")
        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self.profile_dir}", "--remote-debugging-port=0",
             "--remote-debugging-address=127.0.0.1", "about:blank"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._connect()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _connect(self) -> None:
        import httpx
        from websockets.sync.client import connect

        port_file = self.profile_dir / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit {self.proc.poll()})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10,
                            trust_env=False).json()
        page = next(t for t in targets if t.get("type") == "page")
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=64 << 20,
                          open_timeout=self.timeout)
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                  deviceScaleFactor=1, mobile=False)

    def __exit__(self, *exc) -> None:
        from prefect_env import kill_tree

        try:
            if getattr(self, "ws", None) is not None:
                self.ws.close()
        finally:
            kill_tree(self.proc)
            self.log.close()

    def call(self, method: str, **params: Any) -> dict:
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def eval(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                        awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"JS error: {res['exceptionDetails']}")
        return res.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float | None = None) -> Any:
        """Evaluate ``expression`` until it is truthy; its value."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"never true: {expression}")
            time.sleep(0.25)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")
        Path(path).write_bytes(base64.b64decode(data["data"]))
        return Path(path)
