"""Client of a running ``inferscale serve``'s admin API (:mod:`inferscale.serve.app`).

``POST /admin/hydrate {"user", "version", "tier"}`` loads a user's artifact into the
engine (``tier``: ``gpu`` = device memory, ``host`` = pinned host memory; ``facts``: only
its facts and retrieval index, into the server);
``POST /admin/evict {"user"}`` drops it; ``GET /admin/status`` lists what is resident.
Off loopback the server wants ``Authorization: Bearer <INFERSCALE_ADMIN_KEY>``.

The admin key is a secret: :func:`admin_client_for` attaches it only for a server on the
configured allow-list (``INFERSCALE_SERVER_URLS``, by default this host's own server), and
refuses any other URL a run or a command line names while a key is configured.

Errors are :class:`AdminError` with ``transient`` set when retrying may help (the server
could not be reached, timed out, or answered 429/502/503/504) and unset when it will not
(unknown user, bad request, refused key, a damaged artifact: 4xx and other 5xx).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable
from urllib.parse import urlsplit

import httpx

from inferscale.types import HYDRATE_TARGETS, HydrateTarget, check_tier

TRANSIENT_STATUS = frozenset({408, 429, 502, 503, 504})


class AdminError(RuntimeError):
    """An admin call that failed; ``status`` is None when no answer came back."""

    def __init__(self, message: str, *, status: int | None = None, transient: bool = False):
        super().__init__(message)
        self.status, self.transient = status, transient


@dataclass(frozen=True)
class AdminClient:
    """``base_url``: the server's root, e.g. ``http://127.0.0.1:8000``."""

    base_url: str
    admin_key: str | None = field(default=None, repr=False)
    timeout_s: float = 600.0  # hydrating a large user reads and copies gigabytes

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"server URL must be http(s)://..., got {self.base_url!r}")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        url = self.base_url.rstrip("/") + path
        try:
            with httpx.Client(timeout=self.timeout_s, trust_env=False) as client:
                resp = client.request(method, url, json=body, headers=headers)
        except httpx.TransportError as exc:
            raise AdminError(f"{method} {url}: {type(exc).__name__}: {exc}",
                             transient=True) from exc
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except ValueError:
                detail = resp.text
            raise AdminError(f"{method} {url}: HTTP {resp.status_code}: {detail}",
                             status=resp.status_code,
                             transient=resp.status_code in TRANSIENT_STATUS)
        return resp.json()

    def hydrate(self, user: str, *, version: str = "latest",
                tier: HydrateTarget = "gpu") -> dict:
        """Load ``user``'s ``version`` into ``tier`` (``facts``: its facts alone); the
        server's answer (version, bytes...)."""
        check_tier(tier, HYDRATE_TARGETS)
        return self._call("POST", "/admin/hydrate",
                          {"user": user, "tier": tier, "version": version})

    def evict(self, user: str) -> dict:
        return self._call("POST", "/admin/evict", {"user": user})

    def status(self) -> dict:
        return self._call("GET", "/admin/status")


class AdminKeyRefused(ValueError):
    """A server URL that is not allowed to receive the admin key."""


def origin(url: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of an http(s) URL, lowercased, with the default port."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"server URL must be http(s)://host[:port], got {url!r}")
    return scheme, parts.hostname.lower(), parts.port or (443 if scheme == "https" else 80)


def admin_client_for(server_url: str, admin_key: str | None, allowed: Iterable[str],
                     **kwargs: Any) -> AdminClient:
    """An :class:`AdminClient` for ``server_url`` carrying ``admin_key`` only when the URL's
    origin is one of ``allowed`` (``Settings.admin_urls()``). With a key configured, any
    other URL raises :class:`AdminKeyRefused` before anything is sent; without a key
    there is no secret to protect and any URL is fine (loopback servers need none)."""
    if admin_key and origin(server_url) not in {origin(u) for u in allowed}:
        raise AdminKeyRefused(
            f"{server_url} is not a configured server (INFERSCALE_SERVER_URLS): refusing to "
            "send INFERSCALE_ADMIN_KEY there")
    return AdminClient(server_url, admin_key, **kwargs)
