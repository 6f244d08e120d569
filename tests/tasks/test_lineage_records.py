"""Lineage records on the real server: one table artifact per published version under the
(user, model) key, never twice, each pointing at the version before it; the version's
folder declared as an asset materialized from the logs."""

from __future__ import annotations

import pytest

from builders import make_inputs
from prefect_env import artifacts_with_key, table_rows

pytestmark = pytest.mark.slow


def test_record_each_version_once(prefect_server, tmp_path):
    from prefect import flow, get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    from inferscale.artifacts.lineage_view import (
        artifact_key, asset_key, location_uri, version_of_rows,
    )
    from inferscale.artifacts.publish import publish
    from inferscale.artifacts.read import read_manifest
    from inferscale.encode.identity import EncoderConfig
    from inferscale.pipeline.config import PipelineConfig
    from tasks.lineage import record_lineage

    cfg = PipelineConfig(home=tmp_path, model="m", device="cpu", model_dtype="float32",
                         encoder=EncoderConfig(), artifact_root=str(tmp_path / "store"),
                         storage_options={})
    store = cfg.store()
    user, fp = "Zoë.Q", "fp-lineage-test"  # not a plain slug: the key gets a hash suffix
    key = artifact_key(user, fp)
    log_src = str(tmp_path / "logs" / "day 1.jsonl")  # a space: not allowed in asset keys

    @flow
    def record(versions):
        return record_lineage(cfg, fp, versions, [log_src])

    mem, facts, lineage = make_inputs(user, 3, seed=1, fp=fp)
    v1 = publish(store, user, mem, facts, lineage).version
    assert record({user: v1}) == {user: key}
    assert record({user: v1}) == {user: key}  # again: already recorded, nothing added
    assert [version_of_rows(table_rows(a)) for a in artifacts_with_key(key)] == [v1]

    mem, facts, lineage = make_inputs(user, 4, seed=2, fp=fp)
    v2 = publish(store, user, mem, facts, lineage).version
    record({user: v2})
    arts = artifacts_with_key(key)
    assert [version_of_rows(table_rows(a)) for a in arts] == [v1, v2]
    rows = {r["field"]: r["value"] for r in table_rows(arts[-1])}
    m2 = read_manifest(store, user, fp, v2)
    assert rows["previous version"] == v1 and rows["user"] == user
    assert rows["parent: log"] == m2.parents["log"] == lineage.log_hash
    assert rows["parent: facts"] == lineage.facts_hash
    assert rows["files"] == location_uri(store, user, fp, v2)
    assert f"`{v2}`" in arts[-1].description and "`" + v1 + "`" in arts[-1].description

    # LATEST moved back to v1 (its inputs published again): the key shows v1 on top again
    mem, facts, lineage = make_inputs(user, 3, seed=1, fp=fp)
    assert publish(store, user, mem, facts, lineage).version == v1
    record({user: v1})
    assert [version_of_rows(table_rows(a)) for a in artifacts_with_key(key)] == [v1, v2, v1]

    # asset materializations: the (user, model) folder, upstream the log file
    asset = asset_key(location_uri(store, user, fp))
    with get_client(sync_client=True) as client:
        for _ in range(60):  # events are written asynchronously
            page = client.read_events(filter=EventFilter(
                event=EventNameFilter(name=["prefect.asset.materialization.succeeded"]),
                resource=EventResourceFilter(id=[asset])), limit=50)  # the default 100 is refused
            if len(page.events) >= 3:
                break
            import time

            time.sleep(0.5)
    assert len(page.events) == 3
    payload_versions = sorted(e.payload["version"] for e in page.events)
    assert payload_versions == sorted([v1, v2, v1])
    related = {r.id for e in page.events for r in e.related}
    assert asset_key(log_src) in related and " " not in asset_key(log_src)
