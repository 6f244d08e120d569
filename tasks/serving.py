"""Hydrate users into a running ``inferscale serve`` through its admin API (retried)."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from inferscale.serve.admin_client import admin_client_for
from inferscale.types import HydrateTarget
from tasks.policy import IO_RETRIES


@task(name="hydrate-user", task_run_name="hydrate-{user}", persist_result=False,
      **IO_RETRIES)
def hydrate_user(server_url: str, user: str, *, version: str = "latest",
                 tier: HydrateTarget = "gpu") -> dict[str, Any]:
    """``POST /admin/hydrate`` for ``user``; the admin key comes from
    ``INFERSCALE_ADMIN_KEY`` in the worker's environment (never a flow parameter) and is
    sent only to a server on ``INFERSCALE_SERVER_URLS`` (another ``server_url`` fails the
    task, not retried). Retries only transient failures (unreachable server,
    429/502/503/504). Called once per user by the hydrate flow."""
    from inferscale.settings import Settings

    settings = Settings()
    key = settings.admin_key.get_secret_value() if settings.admin_key else None
    client = admin_client_for(server_url, key, settings.admin_urls())
    answer = client.hydrate(user, version=version, tier=tier)
    get_run_logger().info("user %s hydrated to %s: %s", user, tier, answer)
    return answer
