"""Prefect flows of InferScale (deployed from ``prefect.yaml``, see docs/orchestration.md).

- ``encode.encode_users``: ingest -> facts -> KV -> publish for the given users
- ``nightly.nightly_reencode``: re-encode the users whose logs changed since LATEST
- ``backfill.backfill_model``: encode every user for a (new) model; resumable
- ``hydrate.hydrate_serving``: load users' latest artifacts into a running server
"""

from inferscale.settings import offline_environment

offline_environment()  # before any library that reads these variables at import
