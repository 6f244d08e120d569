"""A memory server's prompts composed outside its request path (no awaits, no engine
needed): the TTFT benchmark times the engine alone, and the load benchmark's peer sends
stock vLLM the prompts InferScale's prompt mode composes."""

from __future__ import annotations

import sys


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
