"""How the connector's halves count and log what failed inside them.

Nothing escapes into vLLM's step: a failure in a scheduler hook degrades to "0 external
tokens" (the request prefills), a failed load is recomputed by vLLM. Each half keeps one
:class:`Failures`, which counts them (``load_failures`` and ``scheduler_errors`` in the
worker's status) and logs each with its cause, the traceback only the first time a
cause is seen.

A request whose memory was prefilled instead of injected says why in its
``kv_transfer_params`` (``fallback``, a sentence written by the scheduler half);
:func:`fallback_reason` names its class (:data:`FALLBACK_REASONS`) for metrics.
"""

from __future__ import annotations

import logging

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


# Why a request's memory was prefilled, as a metric label, and the beginnings of the
# scheduler half's ``fallback`` sentences (scheduler.py) that fall in each class.
FALLBACK_REASONS = ("not_resident", "stale_version", "fingerprint_mismatch", "token_mismatch",
                    "load_error", "connector_error", "other")
_FALLBACK_PREFIXES = (
    ("user not resident", "not_resident"),
    ("stale version", "stale_version"),
    ("artifact model fingerprint differs", "fingerprint_mismatch"),
    ("prompt does not begin with the memory", "token_mismatch"),
    ("unknown chunk", "token_mismatch"),
    ("no chunks named", "token_mismatch"),
    ("memory load failed", "load_error"),  # the worker refused or failed the load
    ("connector error in", "connector_error"),  # a scheduler hook raised
    ("connector disabled", "connector_error"),
)


def fallback_reason(fallback: str | None) -> str | None:
    """The class (one of :data:`FALLBACK_REASONS`) of a request's ``fallback`` sentence;
    None when the request had no fallback."""
    if not fallback:
        return None
    for prefix, reason in _FALLBACK_PREFIXES:
        if fallback.startswith(prefix):
            return reason
    return "other"
