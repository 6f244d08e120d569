"""How the connector's halves count and log what failed inside them.

Nothing escapes into vLLM's step: a failure in a scheduler hook degrades to "0 external
tokens" (the request prefills), a failed load is recomputed by vLLM. Each half keeps one
:class:`Failures`, which counts them (``load_failures`` and ``scheduler_errors`` in the
worker's status) and logs each with its cause, the traceback only the first time a
cause is seen.

A request whose memory was prefilled instead of injected says why (in its
``kv_transfer_params``, :class:`~inferscale.vllm_plugin.metadata.MemoryReply`): a
:class:`Fallback`, whose :class:`FallbackReason` is decided where the scheduler half
refuses the request and travels as its value; nothing reads a reason back from words.
The server types its own fallbacks (memory it did not use at all) the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any, Generic, TypeVar

# Under vLLM's logger namespace, so its handlers print these in every engine process.
log = logging.getLogger("vllm.inferscale.connector")


class Failures:
    """Counts the connector's failures and logs each once: one line with its cause, and
    the traceback the first time that cause is seen. One per connector side."""

    def __init__(self) -> None:
        self.count = 0
        self._seen: set[str] = set()

    def record(self, what: str, exc: BaseException, then: str) -> str:
        """Count and log ``exc`` (raised while doing ``what``; ``then``: what happens
        instead); returns its cause as one line."""
        self.count += 1
        cause = f"{type(exc).__name__}: {exc}"
        first = cause not in self._seen
        if first and len(self._seen) < 1000:
            self._seen.add(cause)
        log.error("%s failed (%s); %s", what, cause, then, exc_info=exc if first else None)
        return cause


class FallbackReason(StrEnum):
    """Why a request's named memory was prefilled instead of injected: what the scheduler
    half decided on, and (its value) the label of ``inferscale_fallbacks_total`` and the
    answer's ``fallback_reason``."""

    NOT_RESIDENT = "not_resident"  # no rank holds the user (or not every rank does)
    STALE_VERSION = "stale_version"  # the workers hold another version of the user
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"  # the artifact's model is not the engine's
    TOKEN_MISMATCH = "token_mismatch"  # no or unknown chunks; the prompt is not the memory's
    LOAD_ERROR = "load_error"  # the worker refused or failed the load (recomputed)
    CONNECTOR_ERROR = "connector_error"  # a scheduler hook raised, or the connector stopped
    OTHER = "other"  # a reason this side does not know (a reply from another release)

    @classmethod
    def of(cls, value: Any) -> "FallbackReason":
        """The reason whose value is ``value``; :attr:`OTHER` for any other value."""
        try:
            return cls(value)
        except (ValueError, TypeError):
            return cls.OTHER


R = TypeVar("R", bound=Enum)


@dataclass(frozen=True)
class Fallback(Generic[R]):
    """Why memory went unused for a request: ``reason``, its class (an enum: what
    behaviour and metric labels depend on), and ``detail``, the same in words (logs and
    the answer's ``fallback``), never parsed."""

    reason: R
    detail: str
