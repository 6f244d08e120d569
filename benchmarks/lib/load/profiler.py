"""py-spy profiles of the load benchmark's server during chosen steps (``benchmarks.load
--profile-dir``): vLLM's engine-core process (scheduler, connector, and on one GPU the
model runner: the engine steps), vLLM's worker processes where there are any (the CPU
build, tensor parallelism) and the API server process (uvicorn's event loop, retrieval,
composition),
each sampled by ``py-spy record --nonblocking`` (the process is never paused) for the
first ``--profile-seconds`` of the step's arrivals. A profile that cannot be taken (no
py-spy, no permission to read the process) is reported in the row, never fatal.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from benchmarks.lib.load.server_process import engine_core_pid, worker_pids


class Profiler:
    """Starts and collects the py-spy recorders of one step."""

    def __init__(self, args, server_pid: int):
        self.args, self.server_pid = args, server_pid
        self.exe = args.py_spy or shutil.which("py-spy")
        self.dir = Path(args.profile_dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def wanted(self, users: int, mode: str) -> bool:
        return users in self.args.profile_users and mode in self.args.profile_modes

    def start(self, users: int, mode: str, rate: float, span_s: float) -> dict:
        """Start recording; returns the handle to pass to :meth:`finish`."""
        if not self.exe:
            return {"error": "py-spy not found (--py-spy)"}
        engine = engine_core_pid(self.server_pid)
        targets = {"engine": engine, "server": self.server_pid,
                   **{f"worker{i}": pid for i, pid in enumerate(worker_pids(self.server_pid))}}
        seconds = max(1, int(min(self.args.profile_seconds, span_s)))
        procs = {}
        for name, pid in targets.items():
            if pid is None:
                continue
            stem = f"pyspy-u{users}-{mode}-{rate:g}rps-{name}"
            out = self.dir / f"{stem}.{self.args.profile_format}"
            log = open(self.dir / f"{stem}.log", "wb")
            cmd = [self.exe, "record", "--nonblocking", "--threads", "--idle",
                   "--rate", str(self.args.profile_hz), "--duration", str(seconds),
                   "--format", self.args.profile_format, "--output", str(out),
                   "--pid", str(pid)]
            procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT),
                           out, log, pid)
        return {"procs": procs, "seconds": seconds, "engine_pid": engine}

    def finish(self, handle: dict) -> dict:
        """Wait for the recorders; what the row records (files, pids, failures)."""
        if "procs" not in handle:
            return handle
        out: dict = {"seconds": handle["seconds"], "files": {}, "pids": {}}
        for name, (proc, path, log, pid) in handle["procs"].items():
            try:
                rc = proc.wait(handle["seconds"] + 60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            log.close()
            out["pids"][name] = pid
            if rc == 0 and path.exists():
                out["files"][name] = path.name
            else:
                tail = Path(log.name).read_text(errors="replace")[-300:]
                out.setdefault("errors", {})[name] = f"rc {rc}: {tail.strip()}"
        if handle.get("engine_pid") is None:
            out.setdefault("errors", {})["engine"] = "engine-core process not found"
        return out
