"""Shared memory that a dead replica's engine left behind, and removing it.

vLLM's engine keeps its message queues in POSIX shared memory (``/dev/shm/psm_*``,
Python's ``multiprocessing.shared_memory``: the engine core creates them and its workers
map them; two segments, ~400 MB, on the CPU build). A graceful stop unlinks them. A
replica process that is killed (SIGKILL, the OOM killer) takes its engine with it, but
nobody unlinks the segments, and they hold their memory until the host reboots.

So each memory replica (:class:`~inferscale.serve.replicas.MemoryReplica`), once its
engine is up, records its own process (pid and start time), its engine's processes and
the segments they map (:func:`record_replica`: one JSON file per replica in this host's
record folder, refreshed by the replica's health checks). A replica that starts, and
then each of its health checks, clears what dead ones left on this host
(:func:`clear_dead`): for each record whose process is gone (no such pid, or the pid
taken by another process, told by its start time) and none of whose engine processes
lives on, it removes the recorded segments that no live process maps or holds open, then
the record. (A stop leaves its record: a graceful one has unlinked the segments, and
whatever it did not, Ray's shutdown killing a replica first for one, is cleared the same
way; the process that ran Ray clears after its shutdown too,
:func:`~inferscale.serve.replicas.stop_replicas`.) Segments are known only by what a
replica's own engine mapped, never by a name pattern or a time, so another engine's
segments on the host are never touched. A replica restarted on another node clears
nothing here; the next replica started on this node does.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Iterable

log = logging.getLogger("inferscale.serve.replicas")
SHM = Path("/dev/shm")
PREFIX = "psm_"  # multiprocessing.shared_memory's names (vLLM's message queues)


def record_folder() -> Path:
    """This host's replica records (per user): ``$TMPDIR/inferscale-<uid>/replicas``."""
    return Path(tempfile.gettempdir()) / f"inferscale-{os.getuid()}" / "replicas"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _shm_names(lines: Iterable[str]) -> set[str]:
    """The ``/dev/shm/psm_*`` names in lines of ``/proc/<pid>/maps`` or fd targets."""
    out = set()
    for line in lines:
        at = line.find(str(SHM / PREFIX))
        if at >= 0:
            out.add(line[at + len(str(SHM)) + 1:].split()[0])
    return out


def segments_of(pids: Iterable[int]) -> set[str]:
    """The segments the processes ``pids`` map or hold open (those that can be read)."""
    names: set[str] = set()
    for pid in pids:
        try:
            names |= _shm_names(Path(f"/proc/{pid}/maps").read_text().splitlines())
            fds = Path(f"/proc/{pid}/fd")
            names |= _shm_names(os.readlink(fds / fd) for fd in os.listdir(fds))
        except OSError:  # gone, or not ours to read
            continue
    return names


def in_use(names: set[str]) -> set[str]:
    """Those of ``names`` some live process maps or holds open (every process this user
    may read: a segment of another user is not ours to remove anyway)."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return names & segments_of(pids)


def _alive(pid: int, started: float) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        return (abs(proc.create_time() - started) < 0.05
                and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def record_replica(folder: Path, pid: int | None = None) -> dict:
    """Record the replica process ``pid`` (default: this one), its engine's processes
    and the segments they map, in ``folder``; returns the record."""
    import psutil

    proc = psutil.Process(pid or os.getpid())
    engine = proc.children(recursive=True)
    record = {"pid": proc.pid, "started": proc.create_time(), "boot_id": _boot_id(),
              "engine": [[p.pid, p.create_time()] for p in engine],
              "segments": sorted(segments_of([proc.pid, *(p.pid for p in engine)]))}
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{proc.pid}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(folder / f"{proc.pid}.json")
    return record


def clear_dead(folder: Path, wait_s: float = 0.0) -> list[str]:
    """Remove the segments dead replicas recorded in ``folder`` left behind (see the
    module docstring); the names removed. ``wait_s``: how long to wait for the engine
    processes of dead replicas to exit (a replica just killed takes its engine with it,
    not at once); 0: clear what can be cleared now, the rest at a later call."""
    deadline = time.monotonic() + wait_s
    removed: list[str] = []
    while True:
        waiting = _clear_once(folder, removed)
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if waiting:
        log.warning("replicas %s are gone but their engine processes are not; their shared "
                    "memory is left until they are", waiting)
    if removed:
        log.info("removed %d shared-memory segments dead replicas left: %s", len(removed),
                 removed)
    return removed


def _clear_once(folder: Path, removed: list[str]) -> list[int]:
    """One pass of :func:`clear_dead` (appending to ``removed``); the dead replicas
    whose engine processes still live."""
    waiting = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            pid, started = int(record["pid"]), float(record["started"])
            engine = [(int(p), float(t)) for p, t in record["engine"]]
            segments = {s for s in record["segments"] if s.startswith(PREFIX) and "/" not in s}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("replica record %s unreadable (%s); removed", path.name, exc)
            path.unlink(missing_ok=True)
            continue
        if record.get("boot_id") != _boot_id():  # recorded before a reboot: all gone
            path.unlink(missing_ok=True)
            continue
        if _alive(pid, started):
            continue
        if any(_alive(p, t) for p, t in engine):
            waiting.append(pid)
            continue
        busy = in_use(segments)
        for name in sorted(segments - busy):
            try:
                (SHM / name).unlink()
                removed.append(name)
            except FileNotFoundError:
                pass
        if busy:
            log.warning("replica %d is gone; segments %s are in use by live processes: "
                        "left", pid, sorted(busy))
        path.unlink(missing_ok=True)
    return waiting
