"""The worker's reads of non-resident users' facts (no engine: a real local store, the
real reader and resident store): success, token checks, failures, cancellation, and the
staging memory always given back."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from builders import make_inputs
from inferscale.artifacts.publish import publish
from inferscale.hydrate.fetch import FactReader
from inferscale.hydrate.slab import hydrate
from inferscale.hydrate.store import ResidentStore
from inferscale.vllm_plugin.fetches import Fetches
from inferscale.vllm_plugin.metadata import FetchSpec

FP = "fp-test"


def setup(local_store, **store_kw):
    memory, facts, lineage = make_inputs("ann", 6, dtype=torch.bfloat16)
    version = publish(local_store, "ann", memory, facts, lineage, embeddings=False).version
    store = ResidentStore("cpu", 1 << 20, 1 << 20, dtype=torch.float32, **store_kw)
    fetches = Fetches(store, FactReader(local_store, FP), FP, timeout_s=5)
    whole = hydrate(local_store, "ann", FP)
    return store, fetches, whole, version


def spec(whole, version, chunks, start=0, req="r1", expected=None):
    tokens = [t for c in chunks for t in whole.token_ids[c]]
    end = len(tokens)
    return FetchSpec(req, "ann", version, chunks, start, end, np.arange(start, end),
                     [0], expected if expected is not None else tokens[start:end])


def wait_done(fetches, n=1):
    out = []
    deadline = time.monotonic() + 30
    while len(out) < n:
        out += fetches.done()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return out


def test_a_read_gives_the_chunks_in_the_engine_dtype_and_layout(local_store):
    store, fetches, whole, version = setup(local_store)
    chunks = ["prefix", list(whole.index)[4], list(whole.index)[2]]
    fetches.submit(spec(whole, version, chunks))
    (got,) = wait_done(fetches)
    assert got.error is None and got.resident.tier == "storage"
    want = torch.cat([whole.chunk(c) for c in chunks]).float()
    assert torch.equal(got.resident.slab, want)
    assert got.resident.slab.permute(1, 2, 0, 3, 4).is_contiguous()  # CPU: layer-major
    assert got.nbytes == sum(whole.chunk(c).numel() * 2 for c in chunks)
    assert fetches.reads == 1 and fetches.bytes_read == got.nbytes
    store.release(got.resident.region)
    assert store._staging_used == {"host": 0, "gpu": 0}


def test_token_ids_that_differ_from_the_prompt_fail_the_read(local_store):
    store, fetches, whole, version = setup(local_store)
    chunks = ["prefix", list(whole.index)[1]]
    bad = spec(whole, version, chunks)
    bad.expected = [t + 1 for t in bad.expected]
    fetches.submit(bad)
    (got,) = wait_done(fetches)
    assert got.resident is None and "does not carry the memory's token ids" in got.error
    assert fetches.failures == 1 and store._staging_used == {"host": 0, "gpu": 0}


def test_missing_versions_and_chunks_fail_cleanly(local_store):
    store, fetches, whole, version = setup(local_store)
    fetches.submit(spec(whole, "0" * 32, ["prefix"], req="a"))
    s = spec(whole, version, ["prefix"], req="b")
    s.chunks = ["prefix", "no-such-fact"]
    fetches.submit(s)
    got = {g.spec.req_id: g for g in wait_done(fetches, 2)}
    assert "ArtifactNotFound" in got["a"].error and "KeyError" in got["b"].error
    assert store._staging_used == {"host": 0, "gpu": 0}


def test_a_cancelled_read_returns_its_memory(local_store):
    store, fetches, whole, version = setup(local_store)
    fetches.submit(spec(whole, version, ["prefix", list(whole.index)[3]]))
    fetches.cancel({"r1", "unrelated"})
    (got,) = wait_done(fetches)
    assert got.error == "cancelled" and got.resident is None and fetches.failures == 0
    assert store._staging_used == {"host": 0, "gpu": 0}


def test_a_read_larger_than_the_staging_reserve_fails(local_store):
    store, fetches, whole, version = setup(local_store, staging_bytes=64)
    fetches.submit(spec(whole, version, ["prefix", list(whole.index)[3]]))
    (got,) = wait_done(fetches)
    assert "staging reserve" in got.error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_reads_land_in_device_staging_memory(local_store):
    memory, facts, lineage = make_inputs("ann", 6, dtype=torch.bfloat16)
    version = publish(local_store, "ann", memory, facts, lineage, embeddings=False).version
    store = ResidentStore("cuda", 1 << 20, 1 << 20, dtype=torch.bfloat16)
    fetches = Fetches(store, FactReader(local_store, FP), FP)
    whole = hydrate(local_store, "ann", FP)
    chunks = ["prefix", list(whole.index)[5]]
    fetches.submit(spec(whole, version, chunks))
    (got,) = wait_done(fetches)
    dev = store._arenas["gpu"].buffer
    slab = got.resident.slab
    assert got.error is None and slab.is_cuda and slab.is_contiguous()
    assert dev.data_ptr() <= slab.data_ptr() < dev.data_ptr() + dev.numel()
    assert torch.equal(slab.cpu(), torch.cat([whole.chunk(c) for c in chunks]))
    store.release(got.resident.region)
    assert store._staging_used == {"host": 0, "gpu": 0}
