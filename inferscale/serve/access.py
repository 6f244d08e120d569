"""Who may use whose memory on ``inferscale serve``, and who may use its admin API.

The rules (:class:`AccessPolicy`):

- ``INFERSCALE_API_KEYS`` (``{"key": "user"}``) set: every request needs a known bearer key,
  always, whatever else is configured; the key decides the user. A body ``user`` or a
  trusted header naming someone else is refused.
- ``INFERSCALE_TRUSTED_USER_HEADER`` set (a gateway authenticates and names the user):
  with ``INFERSCALE_GATEWAY_SECRET``, every request must carry it in
  ``X-InferScale-Gateway-Secret``; without a secret the server binds to loopback only
  (beyond loopback it refuses to start). With keys as well, the key decides and the
  header must agree.
- neither: the body's ``user`` decides, on loopback only.
- a request that uses nobody's memory (``GET /v1/models``, :meth:`check_client`) needs
  the same key or gateway secret, less the user.
- admin endpoints: ``INFERSCALE_ADMIN_KEY`` as a bearer token when set. Without one
  they are open on loopback, and only when no API keys are set: with API keys, or beyond
  loopback, the server refuses to start without an admin key.
- a request that repeats an identity header (``Authorization``, the trusted user header,
  the gateway secret) is refused (:meth:`AccessPolicy.single_headers`): which copy a proxy
  checked and which one the server would read is a guess.

Credentials are checked from the headers before the body is read (:meth:`identify`),
compared in constant time (``hmac.compare_digest``), and every user id is checked by
:func:`inferscale.types.check_user_id`. :func:`policy_from` builds the policy from the
settings; it imports nothing heavy, so ``inferscale serve`` refuses a bad configuration
before vLLM is imported.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import Any, Iterable

from inferscale.types import InvalidUserIdError, check_user_id

GATEWAY_SECRET_HEADER = "x-inferscale-gateway-secret"


class ServeError(RuntimeError):
    """A configuration the server refuses to start with."""


class DuplicateHeader(ValueError):
    """A request that carries an identity header more than once (answered 400)."""


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def same_secret(given: str | None, expected: str) -> bool:
    """Constant-time comparison of a presented secret with the configured one."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


@dataclass(frozen=True)
class Identity:
    """What a request's headers establish: ``user`` (None: none yet), whether the
    credentials bound it (then the body may not name another user) and whether an API
    key (a closed set of configured keys) established it: ``authenticated`` users' memory
    lookups are never shed under load (:mod:`inferscale.serve.memory_cache`)."""

    user: str | None
    bound: bool
    authenticated: bool = False

    def resolve(self, body_user: str | None) -> str | None:
        """The user whose memory the request may use; PermissionError or
        InvalidUserIdError (a malformed id) otherwise. ``None``: answer without memory."""
        if self.bound:
            if body_user is not None and body_user != self.user:
                raise PermissionError("these credentials may not use another user's memory")
            return self.user
        return None if body_user is None else check_user_id(body_user)


@dataclass(frozen=True)
class AccessPolicy:
    """Maps a request to the user whose memory it may use; checks admin access."""

    api_keys: dict[str, str]
    admin_key: str | None
    trusted_user_header: str | None
    loopback: bool
    gateway_secret: str | None = None

    def __post_init__(self) -> None:
        header = self.trusted_user_header
        if not self.loopback and not (self.api_keys or header):
            raise ServeError("binding beyond loopback needs INFERSCALE_API_KEYS or "
                             "INFERSCALE_TRUSTED_USER_HEADER: refusing to start")
        if not self.loopback and header and not self.gateway_secret:
            raise ServeError("INFERSCALE_TRUSTED_USER_HEADER beyond loopback needs "
                             "INFERSCALE_GATEWAY_SECRET: refusing to start")
        if self.gateway_secret and not header:
            raise ServeError("INFERSCALE_GATEWAY_SECRET is set but "
                             "INFERSCALE_TRUSTED_USER_HEADER is not")
        if not self.loopback and not self.admin_key:
            raise ServeError("binding beyond loopback needs INFERSCALE_ADMIN_KEY: "
                             "refusing to start")
        if self.api_keys and not self.admin_key:
            raise ServeError("INFERSCALE_API_KEYS is set but INFERSCALE_ADMIN_KEY is not: the "
                             "admin endpoints would be open to anything on this host; "
                             "refusing to start")
        for key, user in self.api_keys.items():
            if not key:
                raise ServeError("INFERSCALE_API_KEYS holds an empty key")
            try:
                check_user_id(user)
            except InvalidUserIdError as exc:
                raise ServeError(f"INFERSCALE_API_KEYS: {exc}") from exc

    @property
    def identity_headers(self) -> tuple[str, ...]:
        """The (lower-case) headers that carry credentials or a user under this policy."""
        names = ["authorization", GATEWAY_SECRET_HEADER]
        if self.trusted_user_header:
            names.append(self.trusted_user_header.lower())
        return tuple(names)

    def single_headers(self, pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
        """A request's headers as a dict of lower-case names (the last of a repeated
        header that carries no identity wins); :class:`DuplicateHeader` when an identity
        header (:attr:`identity_headers`) comes more than once."""
        out: dict[str, str] = {}
        identity = self.identity_headers
        for name, value in pairs:
            key = name.lower()
            if key in identity and key in out:
                raise DuplicateHeader(f"the {name} header is sent more than once")
            out[key] = value
        return out

    def identify(self, headers: dict[str, str]) -> Identity:
        """Check the request's credentials (lower-cased ``headers`` only, before any body
        is read). PermissionError when they are missing or wrong; InvalidUserIdError
        when a gateway's header holds a malformed user id."""
        self._check_gateway(headers)
        header_user = None
        if self.trusted_user_header:
            header_user = headers.get(self.trusted_user_header.lower())
            if header_user is not None:
                check_user_id(header_user)
        if self.api_keys:
            user = self._key_user(headers)
            if header_user is not None and header_user != user:
                raise PermissionError(f"the {self.trusted_user_header} header names another "
                                      "user than the API key")
            return Identity(user, True, authenticated=True)
        if self.trusted_user_header:
            if not header_user:
                raise PermissionError(f"missing {self.trusted_user_header} header")
            return Identity(header_user, True)
        return Identity(None, False)

    def check_client(self, headers: dict[str, str]) -> None:
        """The credentials of a request that uses nobody's memory (``GET /v1/models``):
        a known API key when keys are configured, the gateway secret when one is (as
        for a chat request); PermissionError otherwise. Open when neither is set."""
        self._check_gateway(headers)
        if self.api_keys:
            self._key_user(headers)

    def _check_gateway(self, headers: dict[str, str]) -> None:
        if self.gateway_secret and not same_secret(headers.get(GATEWAY_SECRET_HEADER),
                                                   self.gateway_secret):
            raise PermissionError("missing or wrong gateway secret")

    def _key_user(self, headers: dict[str, str]) -> str:
        """The user of the request's bearer key, every configured key compared in
        constant time; PermissionError saying whether the key is missing or unknown."""
        key = _bearer(headers)
        if not key:
            raise PermissionError("missing API key (send Authorization: Bearer <key>)")
        found = None
        for known, user in self.api_keys.items():
            if same_secret(key, known):
                found = user
        if found is None:
            raise PermissionError("unknown API key")
        return found

    def check_admin(self, headers: dict[str, str]) -> None:
        if self.admin_key is None:
            if not self.loopback:
                raise PermissionError("admin endpoints are closed")
            return
        if not same_secret(_bearer(headers), self.admin_key):
            raise PermissionError("admin key required")


def policy_from(settings: Any, host: str) -> AccessPolicy:
    """The policy of a server binding ``host`` with these settings (ServeError when it
    refuses to start). Imports nothing heavy: ``inferscale serve`` checks it before vLLM
    or Ray is imported."""
    def secret(value: Any) -> str | None:
        return value.get_secret_value() if value else None

    return AccessPolicy(
        api_keys=dict(settings.api_keys), admin_key=secret(settings.admin_key),
        trusted_user_header=settings.trusted_user_header, loopback=is_loopback(host),
        gateway_secret=secret(settings.gateway_secret))


def _bearer(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None
