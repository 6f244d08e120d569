"""Which users need (re-)encoding for a model: their logs against their ``LATEST`` version.

A user is up to date for a run (a :class:`~inferscale.encode.identity.RunIdentity`: the
facts config and the encoding) when ``LATEST`` under its model's fingerprint names a
version whose parent log hash is the content hash of the user's current turns and whose
record is the run's (:meth:`~inferscale.encode.identity.RunIdentity.changed_settings`;
the compute dtype and device are not compared: KV encoded on another device is as
current). Anything else needs encoding: no version yet (``new``), the conversation
changed (``log-changed``), the encoder settings changed (``encoder-changed``), the facts
config changed or was not recorded (``facts-changed``: another ``fact_mode``, embedder,
extraction LLM...; versions published before the facts config was recorded are
re-encoded once), or ``LATEST``/its manifest cannot be read (``unreadable``: damaged,
malformed or of another schema; the encode then writes a new version or reports the
store's error for that user). Planning a user that fails in any other way is that
user's failure (``failed``, with the error; not encoded): one user's manifest never
stops the planning of the others.

Only ``LATEST`` and one manifest per user are read, so an unchanged user costs two small
reads. Facts are not extracted: they are a function of the turns and the facts config
(and are cached).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Mapping

from inferscale.artifacts.layout import ArtifactError, StoreConfig
from inferscale.artifacts.read import latest_version, read_manifest
from inferscale.encode.identity import FACTS_RECORD, RunIdentity

log = logging.getLogger(__name__)

Reason = Literal["new", "log-changed", "encoder-changed", "facts-changed", "unreadable",
                 "up-to-date", "failed"]


@dataclass(frozen=True)
class UserPlan:
    """What to do for one user: the reason, and the version ``LATEST`` names (if any)."""

    user: str
    log_hash: str
    reason: Reason
    latest: str | None = None
    detail: str = ""

    @property
    def needs_encoding(self) -> bool:
        return self.reason not in ("up-to-date", "failed")


def plan_user(store: StoreConfig, run: RunIdentity, user: str, log_hash: str) -> UserPlan:
    """Compare one user's current log hash and the run's settings with their ``LATEST``."""
    model_fp = run.model_fingerprint
    try:
        latest = latest_version(store, user, model_fp)
        if latest is None:
            return UserPlan(user, log_hash, "new")
        manifest = read_manifest(store, user, model_fp, latest)
    except (ArtifactError, OSError) as exc:  # a damaged store: that user only
        log.warning("user %s: LATEST unreadable under model %s: %s", user, model_fp, exc)
        return UserPlan(user, log_hash, "unreadable", detail=f"{type(exc).__name__}: {exc}")
    if manifest.parents.get("log") != log_hash:
        return UserPlan(user, log_hash, "log-changed", latest,
                        f"log {manifest.parents.get('log', '')[:12]} -> {log_hash[:12]}")
    changed = run.changed_settings(manifest.encoder_config)
    if changed:
        facts_only = all(c.split(".")[0] == FACTS_RECORD for c in changed)
        return UserPlan(user, log_hash, "facts-changed" if facts_only else "encoder-changed",
                        latest, ", ".join(changed))
    return UserPlan(user, log_hash, "up-to-date", latest)


def plan_users(store: StoreConfig, run: RunIdentity,
               log_hashes: Mapping[str, str]) -> dict[str, UserPlan]:
    """:func:`plan_user` for every user of ``log_hashes`` (user -> turns content hash),
    each on its own: a user whose planning raises is planned ``failed`` with the error."""
    plans = {}
    for user, h in sorted(log_hashes.items()):
        try:
            plans[user] = plan_user(store, run, user, h)
        except Exception as exc:  # noqa: BLE001 - that user's failure only
            log.error("user %s: planning failed: %s: %s", user, type(exc).__name__, exc)
            plans[user] = UserPlan(user, h, "failed", detail=f"{type(exc).__name__}: {exc}")
    return plans
