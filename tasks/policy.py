"""Retry policy of the I/O tasks: retry what may succeed next time, nothing else.

Tasks that read logs from remote URIs, publish to the artifact store, call the Prefect
API or the serving engine's admin API take ``**IO_RETRIES``; compute tasks (facts,
encoding) take none: a failure there is a bug or bad input, and running it again costs
minutes for the same error.

Transient: connection and timeout errors (``ConnectionError``, ``TimeoutError``,
``httpx.TransportError``), an :class:`~inferscale.serve.admin_client.AdminError` marked
transient (429/5xx gateway answers), botocore connection/throttling errors, and other
``OSError`` without an errno or with one of the "try again" errnos. Not transient: a
missing or refused path (``FileNotFoundError``, ``PermissionError``,
``NotADirectoryError``...), full disks, bad inputs (``ValueError``), damaged artifacts
(:class:`~inferscale.artifacts.layout.ArtifactError`).
"""

from __future__ import annotations

import errno
from typing import Any

IO_RETRY_DELAYS = [2, 10, 30]

_RETRY_ERRNOS = {errno.EAGAIN, errno.EBUSY, errno.ECONNRESET, errno.ECONNABORTED,
                 errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EPIPE, errno.EIO,
                 errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EINTR}
_NOT_TRANSIENT = (FileNotFoundError, FileExistsError, PermissionError, NotADirectoryError,
                  IsADirectoryError)


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the operation that raised ``exc`` may succeed (module docstring)."""
    import httpx

    from inferscale.artifacts.layout import ArtifactError
    from inferscale.serve.admin_client import AdminError

    if isinstance(exc, AdminError):
        return exc.transient
    if isinstance(exc, ArtifactError):
        return False
    if isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError)):
        return True
    mod = type(exc).__module__ or ""
    if mod.startswith(("botocore", "aiobotocore")):
        name = type(exc).__name__
        return any(w in name for w in ("Connection", "Timeout", "Throttl", "ReadTimeout"))
    if isinstance(exc, _NOT_TRANSIENT):
        return False
    if isinstance(exc, OSError):
        return exc.errno is None or exc.errno in _RETRY_ERRNOS
    return False


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """``retry_condition_fn`` of the I/O tasks: retry only transient errors."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - classified, never swallowed
        return is_transient(exc)
    return False


IO_RETRIES: dict[str, Any] = dict(retries=len(IO_RETRY_DELAYS),
                                  retry_delay_seconds=IO_RETRY_DELAYS,
                                  retry_condition_fn=retry_transient)
