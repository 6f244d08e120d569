"""A stand-in for ``MemoryServer`` behind the HTTP layer, for the tests of that layer
(the app's and the Ray gateway's: auth order, validation, status codes)."""

from __future__ import annotations

from inferscale.serve.engine import Generation
from inferscale.serve.server import Prepared


class RecordingServer:
    """Stands in for ``MemoryServer`` behind the HTTP layer (whose own behaviour these
    tests check: auth order, validation, status codes) and records what reached it."""

    mode, max_tokens, users = "kv", 16, {}

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    async def answer(self, user, question, *, k=None, max_tokens=None, temperature=0.0,
                     mode=None, ignore_eos=False, shed=True) -> dict:
        self.calls.append(("answer", dict(user=user, question=question, k=k,
                                          max_tokens=max_tokens, temperature=temperature,
                                          mode=mode, ignore_eos=ignore_eos, shed=shed)))
        return {"generation": Generation([7], "ok", 0.0, 0.0, 3, 0, 0, "stop"),
                "info": {"user": user}}

    async def request(self, user, question, k=None, mode=None, max_tokens=None,
                      shed=True):
        """The streaming path's first half (``MemoryServer.request``)."""
        self.calls.append(("request", dict(user=user, question=question, k=k, mode=mode,
                                           max_tokens=max_tokens, shed=shed)))
        return Prepared([1], None, "salt", {"user": user})

    async def answer_stream(self, prepared, started, *, max_tokens=None, temperature=0.0,
                            ignore_eos=False):
        """The streaming path's second half: one text piece, then the answer."""
        self.calls.append(("answer_stream", dict(max_tokens=max_tokens,
                                                 temperature=temperature,
                                                 ignore_eos=ignore_eos)))
        yield "ok"
        yield {"generation": Generation([7], "ok", 0.0, 0.0, 3, 0, 0, "stop"),
               "info": dict(prepared.info)}

    async def hydrate(self, user, tier="gpu", version="latest") -> dict:
        self.calls.append(("hydrate", dict(user=user, tier=tier, version=version)))
        return {"user": user, "tier": tier, "version": version}

    async def evict(self, user) -> bool:
        self.calls.append(("evict", dict(user=user)))
        return True

    async def status(self) -> dict:
        self.calls.append(("status", {}))
        return {"mode": self.mode, "users": []}
