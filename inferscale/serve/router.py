"""The Ray Serve request router of the memory replicas: each request goes to the replica
that holds its user's memory (:mod:`inferscale.serve.placement`).

Ray Serve runs one router per deployment handle (in the gateway replicas, the proxy)
and calls :meth:`MemoryAffinityRouter.choose_replicas` for each request with the live
replicas; it sends the request to the first replica of the first non-empty rank whose
in-flight requests are under its ``max_ongoing_requests`` (its queue-length probe),
tries the next rank when none is, and backs off and asks again when no rank has room.
So ranks ``[[home], [second choice]]`` state the spill rule: **a user's request goes to
its home replica unless the home has ``max_ongoing_requests`` requests in flight; then to
its second choice; never to a third while both are live**. A dead replica leaves the
live set at once (Ray calls :meth:`on_replica_actor_died` on the first failed call), so
its users' second choice becomes their home until its slot comes back.

A replica's slot is read from what the replica reports: ``routing_stats["slot"]``
(:meth:`~inferscale.serve.replicas.MemoryReplica.record_routing_stats`, polled every
``request_routing_stats_period_s``: it follows a rank Ray reassigns) or, before the
first poll, ``replica_metadata["slot"]`` (recorded once when the replica became
ready). A replica that reports no slot serves only requests without a user.

Configured on the deployment as ``RequestRouterConfig(request_router_class=
"inferscale.serve.router:MemoryAffinityRouter")`` (:mod:`inferscale.serve.replicas`).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from inferscale.serve.placement import choices, parse_key

log = logging.getLogger("inferscale.serve.router")


def replica_slot(replica: Any) -> int | None:
    """The slot ``replica`` reports (its Ray Serve rank), or None before it reports."""
    for source in (replica.routing_stats, replica.replica_metadata):
        slot = (source or {}).get("slot")
        if isinstance(slot, int) and slot >= 0:
            return slot
    return None


class MemoryAffinityRouter(RequestRouter):
    """Ranks ``[[home], [second choice]]`` for a user's request, ``[[home]]`` for its
    admin calls, ``[[the slot's replica]]`` for a slot call, every replica otherwise."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        # back off between rounds when no rank had room (Ray's backoff loop spins
        # without sleeping otherwise)
        pending_request.routing_context.should_backoff = True
        key = pending_request.metadata.multiplexed_model_id
        try:
            route = parse_key(key)
        except ValueError as exc:  # the gateway never sends one: serve it anywhere
            log.warning("unroutable key: %s", exc)
            return [candidate_replicas]
        by_slot: dict[int, list[RunningReplica]] = {}
        for replica in candidate_replicas:
            slot = replica_slot(replica)
            if slot is not None:
                by_slot.setdefault(slot, []).append(replica)
        wanted = choices(route, by_slot)
        if wanted is None:
            return [candidate_replicas]
        return [by_slot[s] for s in wanted]
