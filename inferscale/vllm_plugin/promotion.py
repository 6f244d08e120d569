"""Which users the scheduler reloads: a miss promotes its user (a whole-user reload) only
when the user is asked for more often than the residents it would displace (admission in
the manner of TinyLFU); :class:`Reloads` keeps the orders, pending and backing off.

A request of a user in neither tier is served all the same: its facts are read from
storage or prefilled (:mod:`inferscale.serve.cold_split`). Promoting the whole user (a
background reload of every fact into the host tier, about ten times the bytes of one
request's facts) pays only if the user comes back before it is dropped again. Under a
long-tailed popularity (thousands of users, most asked for now and then) promoting every
miss drops users asked for more often than the one promoted, and the reloads take the
storage bandwidth that the misses' own reads need: on an H100 with 200 users, 33 of them
resident, promoting every miss kept about one reload of 2.6 GB a second going and starved
the misses' reads (``benchmarks/results/load-h100-llama31-8b-run1-u200.json``).

So the scheduler counts each user's requests (a count that halves every ``half_life_s``)
and, once the tiers are full, promotes a missed user only when its count is at least
``min_requests`` (1.5 by default: a second request within a half-life, since counts decay
between requests) and exceeds the least-asked resident's by ``margin`` (1.0: one request
more). The tiers are full once a resident was dropped for room, or once the workers report
that the host tier (where users are dropped) has no room for another user of the size of
the one just added: the serving task places users up to the budgets at start, so the
first misses then would each drop one. A user that becomes resident counts at least
``min_requests``: the users the serving task placed (its most active) are not displaced by
a miss with two requests before their own requests have been counted. Both matter under a
stationary long tail: on an H100 with 2,000 users, 67 of them resident, two requests of a
user from the tail within minutes displaced placed residents, 39 reloads of ~1.3 GB in
the 4 rps step, and 43.5 / 49.3% of the requests at 4 / 12 rps were computed where 41.6%
started in storage (``benchmarks/results/load-h100-llama31-8b-run6-u2000.json``).
Replaying such arrivals against this class (``python -m benchmarks.promotion``: Zipf 1.0,
16 + 51 placed users, least recently used dropped) kept 58.8 / 58.1% of requests in the
tiers at 4 / 12 rps with 18 reloads in all, against 54.9 / 51.6% and 140 by the rule
before (``benchmarks/results/promotion-replay-u2000-h100.json``).
Until the tiers are full every miss is promoted: they have room. A resident removed for
any other reason (an operator's eviction, an old version replaced) leaves room, so the
tiers are not full from then until an addition or a drop says so again (a new version is
reported removed-then-added: its addition's ``full`` decides).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from typing import Iterable

from inferscale.vllm_plugin.config import ConnectorConfig
from inferscale.vllm_plugin.metadata import FailedReload, ReloadOrder

log = logging.getLogger("vllm.inferscale.connector")
Key = tuple[str, str]  # user, version


class Promotions:
    """Decayed request counts per user and the admission rule (module doc). Bounded:
    past ``max_users`` the user seen least recently is forgotten (its count has decayed
    the most). Engine-core thread only."""

    def __init__(self, half_life_s: float = 300.0, min_requests: float = 1.5,
                 margin: float = 1.0, max_users: int = 100_000):
        if not half_life_s > 0 or not min_requests >= 0 or not margin >= 0 or max_users < 1:
            raise ValueError("need half_life_s > 0, min_requests >= 0, margin >= 0 and "
                             "max_users >= 1")
        self.half_life_s, self.min_requests, self.margin = half_life_s, min_requests, margin
        self.max_users = max_users
        self._counts: OrderedDict[str, tuple[float, float]] = OrderedDict()  # user -> n, at
        self.full = False  # the tiers have no room: admission applies
        self.admitted = 0
        self.declined = 0

    def count(self, user: str, now: float | None = None) -> float:
        """``user``'s requests, each weighing half as much per ``half_life_s`` of age."""
        n, at = self._counts.get(user, (0.0, 0.0))
        if not n:
            return 0.0
        now = time.monotonic() if now is None else now
        return n * math.exp2(-max(0.0, now - at) / self.half_life_s)

    def seen(self, user: str, now: float | None = None) -> None:
        """One request of ``user``."""
        now = time.monotonic() if now is None else now
        self._set(user, self.count(user, now) + 1.0, now)

    def resident(self, user: str, now: float | None = None) -> None:
        """``user`` became resident: it counts at least ``min_requests`` from now."""
        now = time.monotonic() if now is None else now
        mine = self.count(user, now)
        if mine < self.min_requests:
            self._set(user, self.min_requests, now)

    def _set(self, user: str, n: float, now: float) -> None:
        self._counts[user] = (n, now)
        self._counts.move_to_end(user)
        while len(self._counts) > self.max_users:
            self._counts.popitem(last=False)

    def dropped(self) -> None:
        """A resident was dropped to make room for another, or the tiers have no room
        left for another user: the tiers are full."""
        self.full = True

    def freed(self) -> None:
        """A resident was removed, not for room (evicted, or its version replaced)."""
        self.full = False

    def admit(self, user: str, residents: Iterable[str], now: float | None = None) -> bool:
        """Whether a miss of ``user`` should promote it, given the users resident now."""
        ok = True
        if self.full:
            now = time.monotonic() if now is None else now
            mine = self.count(user, now)
            coldest = min((self.count(r, now) for r in residents if r != user), default=0.0)
            ok = mine >= self.min_requests and mine >= coldest + self.margin and mine > coldest
        if ok:
            self.admitted += 1
        else:
            self.declined += 1
        return ok


class Reloads:
    """The scheduler's background reload orders: each request's user counted once
    (:meth:`seen`), misses promoted by the rule above (:meth:`miss`), newer versions and
    unfinished ranks reloaded (:meth:`order`), one order per (user, version) until the
    workers report it held or failed, and a back-off after a failure
    (``config.backoff_s``). Engine-core thread only."""

    def __init__(self, config: ConnectorConfig):
        self.config = config
        self.promotions = Promotions(config.promote_half_life_s, config.promote_min_requests,
                                     config.promote_margin)
        self._orders: dict[Key, ReloadOrder] = {}  # ordered since the last take()
        self._pending: set[Key] = set()
        self._failed: dict[Key, tuple[int, float]] = {}  # failures in a row, retry at
        self._counted: set[str] = set()  # request ids counted in promotions
        self._declined = 0  # misses not promoted since the last take()

    def seen(self, req_id: str, user: str) -> bool:
        """Count request ``req_id`` of ``user`` once (vLLM asks again for a request still
        waiting); True the first time."""
        if req_id in self._counted:
            return False
        self._counted.add(req_id)
        self.promotions.seen(user)
        return True

    def finished(self, req_id: str) -> None:
        self._counted.discard(req_id)

    def miss(self, user: str, version: str, residents: Iterable[str]) -> None:
        """A request of ``user``, whom no rank holds: promote it if the rule admits it."""
        if self.promotions.admit(user, residents):
            self.order(user, version, self.config.reload_tier)
        else:
            self._declined += 1

    def order(self, user: str, version: str, tier: str | None) -> None:
        """Reload ``user``'s ``version`` into ``tier`` (None: the tier its current version
        is on), unless ordered already or backing off after a failure."""
        key = (user, version)
        if not (self.config.auto_reload and self.config.artifact_root) or key in self._pending:
            return
        failed = self._failed.get(key)
        if failed is not None and time.monotonic() < failed[1]:
            return
        self._orders[key] = ReloadOrder(user, version, tier)
        self._pending.add(key)

    def take(self) -> tuple[list[ReloadOrder], int]:
        """The orders and the declined promotions since the last call (for the metadata)."""
        orders, declined = list(self._orders.values()), self._declined
        self._orders.clear()
        self._declined = 0
        return orders, declined

    def added(self, user: str, full: bool) -> None:
        """A rank holds ``user`` now (placed or reloaded); ``full``: its host tier has no
        room left for another user of its size."""
        self.promotions.resident(user)
        if full:
            self.promotions.dropped()

    def removed(self, user: str, version: str, for_room: bool) -> None:
        """A rank no longer holds ``user``'s ``version`` (``for_room``: dropped for room)."""
        if for_room:
            self.promotions.dropped()
        else:
            self.promotions.freed()
        self._pending.discard((user, version))

    def held(self, user: str, version: str) -> None:
        """Every rank holds ``user``'s ``version`` now."""
        self._pending.discard((user, version))
        self._failed.pop((user, version), None)

    def failed(self, reports: Iterable[FailedReload]) -> None:
        """Reloads the workers reported failed: each backs off (one failure however many
        ranks report it)."""
        failed: dict[Key, str] = {}
        for f in reports:
            failed.setdefault((f.user, f.version), f.reason)
        for key, reason in failed.items():
            failures = self._failed.get(key, (0, 0.0))[0] + 1
            wait = self.config.backoff_s(failures)
            self._failed[key] = (failures, time.monotonic() + wait)
            self._pending.discard(key)
            log.warning("reload of user %s version %s failed (%d in a row; next try in "
                        "%.0f s at the earliest): %s", key[0], key[1][:12], failures, wait,
                        reason)
