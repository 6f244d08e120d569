"""Prefect flows of InferScale (deployed from ``prefect.yaml``, see docs/orchestration.md).

- ``encode.encode_users``: ingest -> facts -> KV -> publish for the given users
- ``nightly.nightly_reencode``: re-encode the users whose logs changed since LATEST
- ``backfill.backfill_model``: encode every user for a (new) model; resumable
- ``hydrate.hydrate_serving``: load users' latest artifacts into a running server

Importing this package keeps libraries offline (``offline_environment``) and, when
``PREFECT_HOME`` is set, points Prefect's result storage and memo store under it too:
Prefect 3.7.7 leaves them in ``~/.prefect`` otherwise. Both only set variables that are
not set yet, and take effect for Prefect when it is imported after this package.
"""

import os

from inferscale.settings import offline_environment

offline_environment()  # before any library that reads these variables at import
if os.environ.get("PREFECT_HOME"):
    _home = os.path.expanduser(os.environ["PREFECT_HOME"])
    os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", os.path.join(_home, "storage"))
    os.environ.setdefault("PREFECT_MEMO_STORE_PATH", os.path.join(_home, "memo_store.toml"))
