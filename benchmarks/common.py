"""What every benchmark does the same way: record its command line and write its result."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path


def command_line(argv: list[str] | None) -> str:
    """The command that produced a result, as one could type it again."""
    args = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    return "python " + " ".join(shlex.quote(a) for a in args)


def write_result(result: dict, out: str | None) -> dict:
    """Write ``{"command", "device", "rows", "summary", ...}`` to ``out`` (if given) and
    print the summary."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"]))
    return result


def load_user(server, user: str, version: str = "latest"):
    """Read ``user``'s facts (``version``) into ``server`` (a ``MemoryServer``) now, in
    this thread, outside the request path; an explicit version is pinned."""
    memory = server.read_user(user, version)
    server.memories.put(memory, pinned=version != "latest")
    return memory


def prepare(server, user: str | None, question: str, k: int | None = None,
            mode: str | None = None) -> tuple[list[int], object, dict]:
    """``server.compose`` with the memory it holds now (read in this thread when it does
    not): (prompt ids, memory reference, info as the API's JSON), without the request
    path's awaits."""
    from inferscale.serve.backend import AnswerRequest

    mem = None
    if user is not None:
        mem = server.memories.peek(user)
        if mem is None:
            try:
                mem = load_user(server, user)
            except Exception as exc:  # noqa: BLE001 - no memory: the question alone
                print(f"user {user} has no usable memory ({exc})", file=sys.stderr)
    p = server.compose(mem, AnswerRequest(user, question, k, mode))
    return p.ids, p.ref, p.info.to_json()
