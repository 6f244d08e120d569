"""The load benchmark's handle on its server process
(``benchmarks.lib.load.server_process``): vLLM's engine-core and worker processes found
among the server's children (the profiles sample them)."""

from __future__ import annotations

from benchmarks.lib.load.server_process import descendants, engine_core_pid, worker_pids


_PARENT = """
import subprocess, sys, time
wait = "import time; print('ready', flush=True); time.sleep(60)"
big = "x = bytearray(300 << 20); import time; print('ready', flush=True); time.sleep(60)"
kids = [subprocess.Popen([sys.executable, "-c", big if k == "big" else wait, *title],
                         stdout=subprocess.PIPE, text=True)
        for k, *title in (a.split(":", 1) for a in sys.argv[1:])]
for k in kids:
    assert k.stdout.readline().strip() == "ready"
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(60)
"""


def _server(*kids: str):
    """A stand-in server process (a plain Python parent, so this test's own children, e.g.
    the session's engine, never count) whose children are ``kind[:title]`` each
    (``big``: 300 MiB resident); returns it and its children's pids."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _PARENT, *kids], stdout=subprocess.PIPE,
                            text=True)
    return proc, [int(x) for x in proc.stdout.readline().split()]


def test_engine_core_is_found_among_the_servers_children():
    server, (small, large) = _server("wait", "big")
    try:  # no process named EngineCore: the largest Python child holds the engine
        assert set(descendants(server.pid)) == {small, large}
        assert engine_core_pid(server.pid) == large
        assert engine_core_pid(small) is None  # no children
    finally:
        server.kill()
        server.wait()
    server, (worker, named) = _server("big:VLLM::Worker", "wait:VLLM::EngineCore")
    try:  # vLLM's process titles, in the command line
        assert worker_pids(server.pid) == [worker]
        assert engine_core_pid(server.pid) == named
    finally:
        server.kill()
        server.wait()
