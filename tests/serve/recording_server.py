"""A :class:`~inferscale.serve.backend.MemoryBackend` standing in for ``MemoryServer``
behind the HTTP layer, for the tests of that layer (the app's and the Ray gateway's: auth
order, validation, status codes)."""

from __future__ import annotations

from inferscale.serve.backend import Answer, AnswerInfo, AnswerRequest
from inferscale.serve.engine import Generation


class RecordingServer:
    """A :class:`~inferscale.serve.backend.MemoryBackend` behind the HTTP layer (whose
    own behaviour these tests check: auth order, validation, status codes) that records
    what reached it: each chat request as the app built it."""

    mode = "kv"

    def __init__(self) -> None:
        self.calls: list[tuple[str, AnswerRequest | dict]] = []

    async def answer(self, request: AnswerRequest) -> Answer:
        self.calls.append(("answer", request))
        return Answer(Generation([7], "ok", 0.0, 3, 0, "stop"), AnswerInfo(request.user, "kv"))

    async def prepare(self, request: AnswerRequest) -> "RecordedRequest":
        """The streaming path's first half."""
        self.calls.append(("prepare", request))
        return RecordedRequest(request)

    async def answer_stream(self, prepared: "RecordedRequest", started: float):
        """The streaming path's second half: one text piece, then the answer."""
        yield "ok"
        yield Answer(Generation([7], "ok", 0.0, 3, 0, "stop"),
                     AnswerInfo(prepared.request.user, "kv"))

    async def hydrate(self, user, tier="gpu", version="latest") -> dict:
        self.calls.append(("hydrate", dict(user=user, tier=tier, version=version)))
        return {"user": user, "tier": tier, "version": version}

    async def evict(self, user) -> bool:
        self.calls.append(("evict", dict(user=user)))
        return True

    async def status(self) -> dict:
        self.calls.append(("status", {}))
        return {"mode": self.mode, "users": []}

    async def render_metrics(self) -> bytes:
        return b"# no metrics\n"

    def close(self) -> None:
        pass


class RecordedRequest:
    """What :meth:`RecordingServer.prepare` hands the app back (a ``Prepared``)."""

    def __init__(self, request: AnswerRequest) -> None:
        self.request, self.abort_reason = request, None
