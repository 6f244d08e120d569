"""Hydrate serving: load users' latest artifacts into a running ``inferscale serve``."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from flows.results import PERSISTED, failed_run
from inferscale.settings import Settings
from inferscale.types import HydrateTarget
from tasks.serving import hydrate_user


@flow(name="hydrate-serving", log_prints=True, **PERSISTED)
def hydrate_serving(users: list[str], server_url: str | None = None,
                    version: str = "latest", tier: HydrateTarget = "gpu") -> Any:
    """Load the listed users' artifacts into a running server through its admin API.

    One ``POST /admin/hydrate`` per user (retried when the server is unreachable or
    busy); the admin key is INFERSCALE_ADMIN_KEY in the worker's environment (not needed
    on loopback), sent only to a server named in INFERSCALE_SERVER_URLS (default: this
    host's configured server). Ends with a table (artifact key ``inferscale-hydrate``)
    of each user's result and returns the report; the run is Failed when some user could
    not be hydrated, its state carrying the report (``flows.results.UsersFailed``).
    Called by the ``hydrate`` deployment, e.g. after a backfill or before traffic moves
    to a new server.

    Args:
        users: user ids to hydrate.
        server_url: root URL of the running ``inferscale serve`` (one of
            INFERSCALE_SERVER_URLS when an admin key is configured); none = this host's
            configured server, http://INFERSCALE_HOST:INFERSCALE_PORT in the worker's
            environment (what ``inferscale hydrate`` uses).
        version: artifact version to load; "latest" = what LATEST names.
        tier: "gpu" (device memory), "host" (pinned host memory, copied per request) or
            "facts" (only the facts and retrieval index; the KV stays in storage).
    """
    logger = get_run_logger()
    server_url = server_url or Settings().server_url()
    futures = {u: hydrate_user.submit(server_url, u, version=version, tier=tier) for u in users}
    rows, failed = [], []
    for user, fut in futures.items():
        fut.wait()
        state = fut.state
        if state.is_completed():
            ans = fut.result()
            rows.append({"user": user, "status": "hydrated", "tier": tier,
                         "version": str(ans.get("version", "")),
                         "bytes": ans.get("bytes", ans.get("kv_bytes", "")),
                         "facts": ans.get("facts", ""), "error": ""})
        else:
            err = state.result(raise_on_failure=False)
            failed.append(user)
            rows.append({"user": user, "status": "failed", "tier": tier, "version": "",
                         "bytes": "", "facts": "", "error": str(err)[:300]})
            logger.error("user %s not hydrated: %s", user, err)
    create_table_artifact(rows, key="inferscale-hydrate",
                          description=f"Hydrate {len(users)} users into {server_url} ({tier})")
    result = {"server_url": server_url, "tier": tier, "users": {r["user"]: r for r in rows}}
    if failed:
        return failed_run(f"{len(failed)} of {len(users)} users not hydrated: "
                          f"{', '.join(failed[:10])}", result)
    return result
