"""Lineage in Prefect: one table artifact per published version, keyed per (user, model),
and the (user, model) folder declared as an asset materialized from the logs.

The key (:func:`inferscale.artifacts.lineage_view.artifact_key`) collects every version of a user's
memory for one model; each table lists the version, its parents (log and facts hashes),
the previous version, the model fingerprint, encoder config, sizes, checksums and where
the files are. In the open-source UI, ``/artifacts/key/<key>`` shows them as a timeline,
each linked to the run that made it. The asset events feed Prefect Cloud's lineage graph
(the open-source server records them in its event feed).

Recording is idempotent: a version is recorded only when the key's newest table does not
already describe it, so a rerun after a crash adds what is missing and nothing twice.
"""

from __future__ import annotations

from typing import Any, Sequence

from prefect import get_client, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.assets import Asset, AssetProperties, add_asset_metadata, materialize

from inferscale.artifacts.lineage_view import (
    artifact_key, asset_key, location_uri, version_markdown, version_of_rows, version_rows,
)
from inferscale.artifacts.read import list_versions, read_manifest
from inferscale.pipeline.config import PipelineConfig
from tasks.policy import IO_RETRIES

_BATCH = 200


def recorded_versions(keys: Sequence[str]) -> dict[str, str | None]:
    """The version that each key's newest artifact describes (None: nothing recorded)."""
    from prefect.client.schemas.filters import (
        ArtifactCollectionFilter, ArtifactCollectionFilterKey,
    )

    out: dict[str, str | None] = {k: None for k in keys}
    keys = list(out)
    with get_client(sync_client=True) as client:
        for i in range(0, len(keys), _BATCH):
            chunk = keys[i:i + _BATCH]
            found = client.read_latest_artifacts(
                artifact_filter=ArtifactCollectionFilter(
                    key=ArtifactCollectionFilterKey(any_=chunk)),
                limit=len(chunk))
            for col in found:
                out[col.key] = version_of_rows(col.data) if col.type == "table" else None
    return out


def _previous(cfg: PipelineConfig, user: str, model_fp: str, manifest: Any) -> str | None:
    older = [m.version for m in list_versions(cfg.store(), user, model_fp)
             if (m.created, m.version) < (manifest.created, manifest.version)]
    return older[-1] if older else None


def _record_one(cfg: PipelineConfig, user: str, model_fp: str, version: str,
                asset: str) -> str:
    store = cfg.store()
    manifest = read_manifest(store, user, model_fp, version)
    previous = _previous(cfg, user, model_fp, manifest)
    key = artifact_key(user, model_fp)
    create_table_artifact(version_rows(store, manifest, previous), key=key,
                          description=version_markdown(store, manifest, previous))
    add_asset_metadata(asset, {
        "user": user, "version": version, "previous_version": previous,
        "parents": manifest.parents, "model_fingerprint": model_fp,
        "encoder_config": manifest.encoder_config, "counts": manifest.counts,
        "files": {n: {"bytes": e.bytes, "xxh3_128": e.xxh3_128}
                  for n, e in manifest.files.items()},
        "artifact_key": key,
    })
    return key


def _materializer(cfg: PipelineConfig, user: str, model_fp: str, sources: Sequence[str]):
    uri = location_uri(cfg.store(), user, model_fp)
    asset = Asset(key=asset_key(uri), properties=AssetProperties(
        name=f"memory of {user} for model {model_fp[:12]}", url=uri,
        description="InferScale memory artifact versions (facts + pre-RoPE KV) of one user "
                    "for one model"))
    return asset.key, materialize(
        asset, asset_deps=[asset_key(s) for s in sources], name="record-version",
        task_run_name=f"record-version-{user}", persist_result=False)(_record_one)


@task(name="record-lineage", persist_result=False, **IO_RETRIES)
def record_lineage(cfg: PipelineConfig, model_fp: str, versions: dict[str, str],
                   sources: Sequence[str] = ()) -> dict[str, str]:
    """Record each ``user -> version`` (the version ``LATEST`` names) unless its key already
    shows it; ``sources`` are the logs it came from (upstream assets). Returns
    ``user -> artifact key``. The flows also record the users they skip, so a version
    published just before a crash still gets its record on the rerun."""
    keys = {u: artifact_key(u, model_fp) for u in versions}
    recorded = recorded_versions(list(keys.values()))
    logger = get_run_logger()
    for user, version in sorted(versions.items()):
        if recorded.get(keys[user]) == version:
            continue
        asset, record = _materializer(cfg, user, model_fp, sources)
        record(cfg, user, model_fp, version, asset)
        logger.info("user %s: version %s recorded under artifact key %s", user, version,
                    keys[user])
    return keys
