"""Prefect flows of InferScale (deployed from ``prefect.yaml``, see docs/orchestration.md).

- ``encode.encode_users``: ingest -> facts -> KV -> publish for the given users
- ``nightly.nightly_reencode``: re-encode the users whose logs changed since LATEST
- ``backfill.backfill_model``: encode every user for a (new) model; resumable
- ``hydrate.hydrate_serving``: load users' latest artifacts into a running server
- ``demo``: the ``inferscale-demo`` command (the encode flow in-process, then serving)

Importing this package keeps libraries offline (``offline_environment``) and points
Prefect's result storage and memo store under ``PREFECT_HOME`` when it is set
(:func:`use_prefect_home`): Prefect 3.7.7 leaves them in ``~/.prefect`` otherwise. Both
only set variables that are not set yet, and take effect for Prefect when it is imported
afterwards.
"""

import os

from inferscale.settings import offline_environment


def use_prefect_home(default: str | None = None) -> None:
    """``PREFECT_HOME`` (``default`` when unset), with result storage and the memo store
    under it unless they are set."""
    if default and not os.environ.get("PREFECT_HOME"):
        os.environ["PREFECT_HOME"] = default
    if os.environ.get("PREFECT_HOME"):
        home = os.path.expanduser(os.environ["PREFECT_HOME"])
        os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", os.path.join(home, "storage"))
        os.environ.setdefault("PREFECT_MEMO_STORE_PATH", os.path.join(home, "memo_store.toml"))


offline_environment()  # before any library that reads these variables at import
use_prefect_home()
