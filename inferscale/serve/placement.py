"""Where a user's requests are served when several replicas serve: rendezvous hashing
over the replicas' stable slots, and the routing keys the gateway tags requests with.

**Slots, not replica ids.** A replica's slot is its Ray Serve rank (0 .. N-1 of its
deployment). Ray Serve gives a replacement replica a new replica id but the lowest free
rank, which is the dead replica's: a restarted replica takes back its slot, and so its
users. Hashing over replica ids would re-home every user of a restarted replica for
good.

**Home.** A user's ranking of the live slots is the slots sorted by
``score(user, slot)`` (a 64-bit BLAKE2b of both), highest first: its *home* is the
first, its *second choice* the next (rendezvous, or highest-random-weight, hashing).
Adding a slot moves exactly the users whose score for the new slot beats every old one,
about ``1/(N+1)`` of them, all onto the new slot; removing a slot (a dead replica) moves
only its users, each to its second choice, and they come back when the slot does. Every
router computes the same ranking from the key and the slots alone: gateways and proxies
agree without sharing any state.

**Keys** (Ray Serve's ``multiplexed_model_id`` of a request; user ids never contain
``/``, :func:`inferscale.types.check_user_id`, so control keys cannot collide):

- ``<user>``: the user's home; its second choice when the home is overloaded;
- ``/home/<user>``: the user's home only (the admin endpoints: hydrate);
- ``/slot/<n>``: the replica of slot ``n`` (status, metrics, evict everywhere); when
  no live replica holds slot ``n``, any replica, which answers that it is not ``n``;
- no key (``""``): any replica (requests without a user).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Literal

from inferscale.types import user_id_problem

HOME_PREFIX = "/home/"
SLOT_PREFIX = "/slot/"
Kind = Literal["any", "user", "home", "slot"]


def score(user: str, slot: int) -> int:
    """The rendezvous weight of ``slot`` for ``user`` (stable across processes and
    Python versions, unlike ``hash``)."""
    digest = hashlib.blake2b(f"{user}\x00{slot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def ranking(user: str, slots: Iterable[int]) -> list[int]:
    """``slots`` in ``user``'s order of preference: home first, then second choice, ..."""
    return sorted(set(slots), key=lambda s: (score(user, s), -s), reverse=True)


def home(user: str, slots: Iterable[int]) -> int:
    """``user``'s home among ``slots`` (ValueError when there is none)."""
    order = ranking(user, slots)
    if not order:
        raise ValueError("no slots to place a user on")
    return order[0]


@dataclass(frozen=True)
class Route:
    """A parsed routing key: ``kind`` and its ``user`` or ``slot``."""

    kind: Kind
    user: str | None = None
    slot: int | None = None


def user_key(user: str | None) -> str:
    return "" if user is None else user


def home_key(user: str) -> str:
    return HOME_PREFIX + user


def slot_key(slot: int) -> str:
    if slot < 0:
        raise ValueError("slots are >= 0")
    return f"{SLOT_PREFIX}{slot}"


def parse_key(key: str | None) -> Route:
    """The route a key asks for; ValueError for a key none of the forms above gives."""
    if not key:
        return Route("any")
    if key.startswith(SLOT_PREFIX):
        digits = key[len(SLOT_PREFIX):]
        if not digits.isascii() or not digits.isdigit() or len(digits) > 9:
            raise ValueError(f"bad slot key {key[:40]!r}")
        return Route("slot", slot=int(digits))
    user, kind = (key[len(HOME_PREFIX):], "home") if key.startswith(HOME_PREFIX) else (key, "user")
    problem = user_id_problem(user)
    if problem is not None:
        raise ValueError(f"bad routing key {key[:40]!r}: user id {problem}")
    return Route(kind, user=user)  # type: ignore[arg-type]


def choices(route: Route, slots: Iterable[int]) -> list[int] | None:
    """The slots ``route`` may be served by, preferred first; None: any slot. A user's
    request gets [home, second choice] (the second only while the home is overloaded:
    the router tries the list in order), ``/home/`` keys their home alone, slot keys
    that slot if it is live, else any replica (which answers that it is not that
    slot: the gateway asks with the slot it wants, and nothing waits for a dead one)."""
    live = sorted(set(slots))
    if route.kind == "any":
        return None
    if route.kind == "slot":
        return [route.slot] if route.slot in live else None
    order = ranking(route.user or "", live)
    return order[:1] if route.kind == "home" else order[:2]
