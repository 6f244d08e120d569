"""The one definition of a valid user id, checked wherever an id enters the system.

A user id is a string of 1..128 characters with no control, format or line/paragraph
separator characters (Unicode categories Cc, Cf, Zl, Zp: newlines, NUL, bidi overrides,
zero-width characters), no surrogates, private-use or unassigned code points (Cs, Co,
Cn), no ``/`` or ``\\``, no leading or trailing whitespace, and not ``.`` or ``..``.
The whole string is checked (there is no regular expression whose ``$`` would accept a
trailing newline).

Callers: log ingestion (a record with a bad user is quarantined), the settings
(``INFERSCALE_API_KEYS`` values), the server (a body's ``user``, a gateway's user header,
admin requests). The artifact store's folder encoding (``inferscale.store.user_dirname``)
is a separate, wider contract: it stores any id safely, including ones written before
this check existed. Standard library only.
"""

from __future__ import annotations

import unicodedata

MAX_USER_CHARS = 128
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


class InvalidUserIdError(ValueError):
    """A user id that breaks the rules of :func:`check_user_id`."""


def user_id_problem(user: object) -> str | None:
    """Why ``user`` is not a valid user id, or None when it is."""
    if not isinstance(user, str):
        return f"must be a string, not {type(user).__name__}"
    if not user:
        return "must not be empty"
    if len(user) > MAX_USER_CHARS:
        return f"is {len(user)} characters long; at most {MAX_USER_CHARS}"
    if user in (".", "..") or user != user.strip():
        return "must not be '.', '..' or begin or end with whitespace"
    for ch in user:
        if ch in "/\\":
            return "must not contain '/' or '\\'"
        category = unicodedata.category(ch)
        if category in _REFUSED_CATEGORIES:
            return f"contains U+{ord(ch):04X} (category {category}: control or invisible)"
    return None


def check_user_id(user: object) -> str:
    """``user`` itself, or :class:`InvalidUserIdError` saying which rule it breaks."""
    problem = user_id_problem(user)
    if problem is not None:
        shown = repr(user[:40]) if isinstance(user, str) else type(user).__name__
        raise InvalidUserIdError(f"user id {shown} {problem}")
    return user  # type: ignore[return-value]
