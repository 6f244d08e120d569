"""How vLLM finds and configures the plugin: the module paths resolve, the settings survive
the trip through ``kv_connector_extra_config`` and bad settings are refused."""

from __future__ import annotations

import importlib

import pytest

from inferscale.types import GPU_BUDGET_BYTES, HOST_BUDGET_BYTES
from inferscale.vllm_plugin.config import (
    CONNECTOR_CLASS, CONNECTOR_MODULE, WORKER_EXTENSION, ConnectorConfig, kv_transfer_config,
)


def test_the_names_vllm_loads_exist():
    from inferscale.vllm_plugin.compat import KVConnectorBase_V1

    connector = getattr(importlib.import_module(CONNECTOR_MODULE), CONNECTOR_CLASS)
    assert issubclass(connector, KVConnectorBase_V1)
    module, _, name = WORKER_EXTENSION.rpartition(".")
    extension = getattr(importlib.import_module(module), name)
    assert all(callable(getattr(extension, m)) for m in (
        "inferscale_attach", "inferscale_hydrate", "inferscale_evict", "inferscale_status",
        "inferscale_set_budgets", "inferscale_verify_next", "inferscale_verify_last_load"))


def test_fault_injection_lives_in_the_tests_only():
    """The production worker extension has no fault endpoint; the tests' engines load a
    subclass that adds them, by the dotted path vLLM resolves in the worker."""
    from fault_injection import FAULT_EXTENSION

    from inferscale.vllm_plugin.worker_ext import InferScaleWorkerExtension

    assert not [m for m in dir(InferScaleWorkerExtension) if "fault" in m]
    module, _, name = FAULT_EXTENSION.rpartition(".")
    faults = getattr(importlib.import_module(module), name)
    assert issubclass(faults, InferScaleWorkerExtension)
    assert callable(faults.inferscale_fault_drop_slab) and \
        callable(faults.inferscale_fault_drop_on_rank)


def test_settings_round_trip_through_the_extra_config():
    cfg = ConnectorConfig("fp", "s3://b/p", {"key": "k"}, 1, 2, "gpu", False)
    transfer = kv_transfer_config(cfg)
    assert transfer["kv_connector"] == CONNECTOR_CLASS
    assert transfer["kv_connector_module_path"] == CONNECTOR_MODULE
    assert (transfer["kv_role"], transfer["kv_load_failure_policy"]) == ("kv_consumer",
                                                                        "recompute")
    assert ConnectorConfig.from_extra_config(transfer["kv_connector_extra_config"]) == cfg
    default = ConnectorConfig("fp")
    assert (default.gpu_budget_bytes, default.host_budget_bytes) == (GPU_BUDGET_BYTES,
                                                                     HOST_BUDGET_BYTES)


@pytest.mark.parametrize("extra, match", [
    ({}, "model_fingerprint"),
    ({"model_fingerprint": "fp", "reload_tier": "disk"}, "reload_tier"),
    ({"model_fingerprint": "fp", "gpu_budget_bytes": -1}, "budgets"),
    ({"model_fingerprint": "fp", "budget": 1}, "unknown"),
    ({"model_fingerprint": "fp", "promote_half_life_s": 0}, "promote_half_life_s"),
    ({"model_fingerprint": "fp", "promote_half_life_s": float("nan")}, "promote_half_life_s"),
    ({"model_fingerprint": "fp", "promote_min_requests": -1}, "promote_min_requests"),
    ({"model_fingerprint": "fp", "promote_min_requests": float("nan")}, "promote_min_requests"),
    ({"model_fingerprint": "fp", "promote_min_requests": "2"}, "not supported"),
    ({"model_fingerprint": "fp", "promote_margin": -1}, "promote_margin"),
    ({"model_fingerprint": "fp", "promote_margin": float("nan")}, "promote_margin"),
    ({"model_fingerprint": "fp", "promote_margin": "1"}, "not supported"),
    ({"model_fingerprint": "fp", "reload_part_bytes": 0}, "reload_part_bytes"),
    ({"model_fingerprint": "fp", "reload_part_bytes": -1}, "reload_part_bytes"),
])
def test_bad_settings_are_refused(extra, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ConnectorConfig.from_extra_config(extra)


def test_direct_io_travels_from_the_settings_to_every_store_the_worker_reads(
        monkeypatch, tmp_path):
    """INFERSCALE_STORAGE_DIRECT_IO -> StoreConfig -> ConnectorConfig -> the extra config
    vLLM carries -> the worker's loader (whole users) and fact reader (single facts)."""
    from vllm.config import ModelConfig, VllmConfig

    from inferscale.artifacts.layout import StoreConfig
    from inferscale.models import embedded_checkpoint
    from inferscale.settings import Settings
    from inferscale.vllm_plugin.worker import ConnectorWorker

    monkeypatch.setenv("INFERSCALE_ARTIFACT_ROOT", str(tmp_path))
    assert StoreConfig.from_settings(Settings()).direct_io is False  # the default
    monkeypatch.setenv("INFERSCALE_STORAGE_DIRECT_IO", "true")
    store = StoreConfig.from_settings(Settings())
    assert store.direct_io is True and store.root == str(tmp_path)
    extra = kv_transfer_config(ConnectorConfig.from_store(
        store, model_fingerprint="fp", staging_bytes=1 << 20,
        device_staging_bytes=1 << 20))["kv_connector_extra_config"]
    config = ConnectorConfig.from_extra_config(extra)
    assert config.direct_io is True and config.store() == store
    checkpoint = embedded_checkpoint(Settings().home)
    vllm_config = VllmConfig(model_config=ModelConfig(model=str(checkpoint), dtype="float32"))
    worker = ConnectorWorker(config, vllm_config)
    assert worker.loader.direct_io is True
    assert worker.fetches.reader.store == store
    with pytest.raises(ValueError, match="direct_io"):
        ConnectorConfig.from_extra_config({**extra, "direct_io": "yes"})


def test_the_reloads_part_size_reaches_the_worker_s_loader():
    """``reload_part_bytes`` travels through the extra config to the loader, which reads
    every background reload in parts of that size (tests/hydrate/test_loader.py)."""
    from vllm.config import ModelConfig, VllmConfig

    from inferscale.models import embedded_checkpoint
    from inferscale.settings import Settings
    from inferscale.vllm_plugin.worker import ConnectorWorker

    assert ConnectorConfig("fp").reload_part_bytes == 8 << 20
    extra = kv_transfer_config(ConnectorConfig(
        "fp", reload_part_bytes=1 << 20, staging_bytes=1 << 20,
        device_staging_bytes=1 << 20))["kv_connector_extra_config"]
    checkpoint = embedded_checkpoint(Settings().home)
    vllm_config = VllmConfig(model_config=ModelConfig(model=str(checkpoint), dtype="float32"))
    worker = ConnectorWorker(ConnectorConfig.from_extra_config(extra), vllm_config)
    assert worker.loader.reload_part_bytes == 1 << 20


def test_the_serving_docs_list_every_connector_setting():
    """docs/serving.md's ``kv_connector_extra_config`` names each ConnectorConfig field,
    no other, and says how many there are (it once listed 9 of 16)."""
    import re
    from dataclasses import fields
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    block = doc.split('"kv_connector_extra_config": {', 1)[1].split("\n}", 1)[0]
    keys = re.findall(r'"(\w+)":', re.sub(r"#.*", "", block))
    names = [f.name for f in fields(ConnectorConfig)]
    assert sorted(keys) == sorted(names) and len(keys) == len(set(keys))
    assert f"ConnectorConfig's {len(names)} fields" in block
