"""The response of a streamed answer: server-sent events that close their source the
moment the response ends, however it ends.

Starlette's ``StreamingResponse`` stops iterating its body when the client goes but never
closes it. When the client went while a send was paused (a slow reader: the transport's
buffer full), the cancel lands in that send, or between two items, and the body — the
events, the answer, the engine's generation, vLLM's ``generate`` — stays suspended at its
``yield`` until the garbage collector finds it, vLLM generating on meanwhile.

:class:`ClosingStream` sends the body in a task of its own and watches for the
disconnect itself. When the client goes (or the response is cancelled from outside: a
Ray Serve gateway's request cancelled by its proxy), it says so (``on_disconnect``),
cancels the send and then closes the body, which closes each generator down the chain
(each holds the next in ``contextlib.aclosing``): vLLM aborts the request. The close
runs in a task of its own that the response waits for at most ``CLOSE_TIMEOUT_S``: a
close that does not finish is logged and left running, never holding the response (nor a
server's shutdown) with it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

from starlette.responses import StreamingResponse

log = logging.getLogger("inferscale.serve")
CLOSE_TIMEOUT_S = 30.0


class ClosingStream(StreamingResponse):
    """A ``StreamingResponse`` over an async generator that is closed when the response
    ends (see the module docstring); ``on_disconnect`` is called, before the close, when
    the client went before the end."""

    def __init__(self, content: AsyncIterator[str], *, media_type: str | None = None,
                 on_disconnect: Callable[[], None] | None = None):
        super().__init__(content, media_type=media_type)
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        sending = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(_disconnect(receive))
        gone = False
        try:
            await asyncio.wait({sending, watching}, return_when=asyncio.FIRST_COMPLETED)
            # the client went first; or (ASGI 2.4 servers) a send raised OSError for it
            gone = not sending.done() or (not sending.cancelled()
                                          and isinstance(sending.exception(), OSError))
        finally:  # also when this response is cancelled: the body is closed all the same
            watching.cancel()
            if watching.done() and not watching.cancelled():
                watching.exception()  # a receive that failed: taken as the client gone
            if gone and self.on_disconnect is not None:
                self.on_disconnect()
            closing = asyncio.ensure_future(
                _close(sending, self.body_iterator, "client_disconnected" if gone else None))
            done, _ = await asyncio.wait({closing}, timeout=CLOSE_TIMEOUT_S)
            if not done:
                log.warning("a streamed answer did not close within %.0f s; left closing",
                            CLOSE_TIMEOUT_S)
        if gone:
            return
        if not sending.cancelled() and sending.exception() is not None:
            raise sending.exception()  # as StreamingResponse: the server answers for it


async def _disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _close(sending: asyncio.Future, body: Any, why: str | None) -> None:
    """Stop the send (if it still runs; the cancel says ``why``), then close the body: a
    body already finished closes at once; one suspended at a ``yield`` closes down its
    chain."""
    if not sending.done():
        sending.cancel(why)
        await asyncio.wait({sending})
    if not sending.cancelled():
        sending.exception()  # retrieved (the response raises it when it matters)
    try:
        await body.aclose()
    except BaseException as exc:  # noqa: BLE001 - nothing waits for this task's result
        log.warning("closing a streamed answer failed: %s: %s", type(exc).__name__, exc)
