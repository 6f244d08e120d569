"""Memory replicas on this machine's own Ray instance for as long as a block runs: what
``inferscale serve --replicas N`` serves (:mod:`inferscale.serve.replicas`), driven from
Python (the replicas benchmark, the tests). A local Ray instance, Serve's proxy on
127.0.0.1 and a free port, the settings given as ``INFERSCALE_*`` variables (Ray's
worker processes inherit this process's environment when ``ray.init`` starts them);
the admin calls and scrapes a run makes, and a fault drill: a replica's process killed
(``psutil``) and its restart awaited.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_scrape(text: str) -> dict[tuple[str, tuple], float]:
    """A Prometheus scrape -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(scrape: dict, name: str, **labels: Any) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = {k: str(v) for k, v in labels.items()}
    return sum(v for (n, lab), v in scrape.items()
               if n == name and all(dict(lab).get(k) == x for k, x in want.items()))


class ReplicaCluster:
    """``with ReplicaCluster(env, replicas=2) as c:`` serves at ``c.url`` until the block
    ends (then Serve and Ray shut down, the replicas' engines with them)."""

    def __init__(self, env: dict[str, str], *, replicas: int = 2, routing: str = "memory",
                 mode: str = "kv", admin_key: str | None = None, start_timeout_s: float = 900):
        self.env, self.replicas, self.routing, self.mode = env, replicas, routing, mode
        self.admin_key = admin_key
        self.start_timeout_s = start_timeout_s
        self.url = ""
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> "ReplicaCluster":
        import ray

        from inferscale.serve.replicas import start_replicas

        # Ray's memory monitor kills workers when the whole node runs short, whoever uses
        # the memory: on a shared machine, other jobs' engines would kill these replicas
        env = {"RAY_memory_monitor_refresh_ms": "0", **self.env}
        self._saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        port = free_port()
        try:
            ray.init(address="local", include_dashboard=False, log_to_driver=False,
                     object_store_memory=256 << 20, num_cpus=max(2, os.cpu_count() or 2))
            start_replicas({"replicas": self.replicas, "routing": self.routing,
                            "mode": self.mode, "host": "127.0.0.1"}, port)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: Any) -> None:
        from inferscale.serve.replicas import stop_replicas

        try:
            stop_replicas()  # Serve, Ray, and what killed replicas left in /dev/shm
        finally:
            for k, v in self._saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    # ------------------------------------------------------------------ admin

    def http(self, timeout: float = 600) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                            trust_env=False)

    def hydrate(self, user: str, tier: str = "gpu") -> dict:
        with self.http() as h:
            r = h.post("/admin/hydrate", json={"user": user, "tier": tier})
        r.raise_for_status()
        return r.json()

    def status(self) -> dict:
        with self.http() as h:
            r = h.get("/admin/status")
        r.raise_for_status()
        return r.json()

    def scrape(self) -> dict[tuple[str, tuple], float]:
        with self.http() as h:
            r = h.get("/metrics")
        r.raise_for_status()
        return parse_scrape(r.text)

    def replica(self, slot: int) -> dict:
        return next(r for r in self.status()["replicas"] if r["replica"] == slot)

    # ------------------------------------------------------------------ faults

    def kill(self, slot: int) -> tuple[int, list[int]]:
        """SIGKILL the process of slot ``slot``'s replica (a Ray worker this cluster
        started): its pid and the pids of its children then (the engine's processes)."""
        import psutil

        pid = self.replica(slot)["pid"]
        children = [c.pid for c in psutil.Process(pid).children(recursive=True)]
        os.kill(pid, signal.SIGKILL)
        return pid, children

    def wait_back(self, slot: int, old_pid: int, timeout_s: float = 600) -> dict:
        """Wait until a new replica runs slot ``slot`` (Ray Serve's restart)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                r = self.replica(slot)
                if r.get("state") == "running" and r["pid"] != old_pid:
                    return r
            except (httpx.HTTPError, StopIteration):
                pass
            time.sleep(2)
        raise TimeoutError(f"slot {slot} did not come back within {timeout_s:g} s")
