"""How the connector's halves count and log what failed inside them.

Nothing escapes into vLLM's step: a failure in a scheduler hook degrades to "0 external
tokens" (the request prefills), a failed load is recomputed by vLLM. Each half keeps one
:class:`Failures`, which counts them (``load_failures`` and ``scheduler_errors`` in the
worker's status) and logs each with its cause, the traceback only the first time a
cause is seen.

Callers: :mod:`inferscale.vllm_plugin.scheduler` and :mod:`inferscale.vllm_plugin.worker`.
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
