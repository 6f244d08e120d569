"""The encoder's chunks -> the kv.arrow record batch: token-major slab, offsets, token ids."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from builders import expected_slab, make_inputs
from inferscale.artifacts.kv_file import build_kv_batch
from inferscale.artifacts.layout import InvalidArtifactInput
from inferscale.types import KV_DTYPES, torch_dtype
from storage_schemas import kv as kv_schema


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_batch_lays_the_chunks_out_token_major(dtype):
    memory, _, _ = make_inputs("u", 4, layers=3, heads=2, head_dim=8, dtype=torch_dtype(dtype))
    layout, batch, slab_buffer = build_kv_batch(memory, "fp-x")
    lengths = [len(c.token_ids) for c in memory.chunks]
    assert (layout.dtype, layout.layers, layout.kv_heads, layout.head_dim) == (dtype, 3, 2, 8)
    assert layout.tokens == sum(lengths) and layout.model_fingerprint == "fp-x"
    assert batch.schema.equals(layout.schema(), check_metadata=True)
    assert kv_schema.KVLayout.from_schema(batch.schema) == layout
    assert batch.column("chunk_id").to_pylist() == [c.chunk_id for c in memory.chunks]
    assert batch.column("length").to_pylist() == lengths
    assert batch.column("offset").to_pylist() == list(np.cumsum([0] + lengths[:-1]))
    assert batch.column("token_ids").to_pylist() == [c.token_ids for c in memory.chunks]
    # the kv column's values buffer is the slab itself, [T, 2, L, H, D] in the true dtype
    assert slab_buffer.size == layout.slab_bytes
    want = expected_slab(memory)
    got = torch.frombuffer(bytearray(slab_buffer.to_pybytes()), dtype=want.dtype)
    assert torch.equal(got.view(layout.shape), want)
    kv = batch.column("kv")
    assert kv.values.buffers()[1].address == slab_buffer.address
    assert kv.offsets.to_pylist() == [o * layout.row_elems for o in
                                      np.cumsum([0] + lengths).tolist()]


def test_prefix_only():
    memory, _, _ = make_inputs("u", 0)
    layout, batch, _ = build_kv_batch(memory, "fp-x")
    assert batch.num_rows == 1 and layout.tokens == len(memory.chunks[0].token_ids)


def _mutated(change):
    memory, _, _ = make_inputs("u", 3)
    change(memory.chunks)
    return memory


@pytest.mark.parametrize("change, match", [
    (lambda cs: cs.reverse(), "first chunk"),
    (lambda cs: cs.__setitem__(0, dataclasses.replace(cs[0], kv=cs[0].kv[:, 0])), "5-D"),
    (lambda cs: cs.__setitem__(0, dataclasses.replace(cs[0], kv=cs[0].kv.transpose(0, 1))),
     "5-D"),  # [2, T, L, H, D]: not token-major rows
    (lambda cs: cs.__setitem__(1, dataclasses.replace(cs[1], kv=cs[1].kv[..., :1, :])),
     "do not match"),
    (lambda cs: cs.__setitem__(1, dataclasses.replace(cs[1], kv=cs[1].kv.float())),
     "dtype differs"),
    (lambda cs: cs.__setitem__(1, dataclasses.replace(cs[1], token_ids=cs[1].token_ids[1:])),
     "token ids"),
    (lambda cs: cs.append(cs[1]), "duplicate"),
    (lambda cs: cs.__setitem__(1, dataclasses.replace(cs[1], chunk_id="")), "non-empty"),
    (lambda cs: cs.__setitem__(1, dataclasses.replace(cs[1], kv=[[0.0]])), "tensor"),
])
def test_bad_chunks_are_refused(change, match):
    with pytest.raises(InvalidArtifactInput, match=match):
        build_kv_batch(_mutated(change), "fp-x")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -0.5, 1e38, 7.6e35, 1e-45])
def test_fp8_scales_must_be_finite_and_positive(bad):
    memory, _, _ = make_inputs("u", 2, dtype=torch.float8_e4m3fn)
    memory.chunks[2].scales[1, 0, 1] = bad
    with pytest.raises(InvalidArtifactInput, match="finite and positive"):
        build_kv_batch(memory, "fp-x")


def test_unsupported_dtype_and_token_ids():
    memory, _, _ = make_inputs("u", 1, dtype=torch.float64)
    with pytest.raises(InvalidArtifactInput, match="not supported"):
        build_kv_batch(memory, "fp-x")
    memory, _, _ = make_inputs("u", 1)
    memory.chunks[1].token_ids = [2 ** 40] * len(memory.chunks[1].token_ids)
    with pytest.raises(InvalidArtifactInput, match="int32"):
        build_kv_batch(memory, "fp-x")
    with pytest.raises(InvalidArtifactInput, match="fingerprint"):
        build_kv_batch(make_inputs("u", 1)[0], "")
