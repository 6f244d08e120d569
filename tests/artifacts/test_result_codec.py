"""Arrow IPC forms of cached task results: the encoder's output and the facts round-trip
whole (K/V bits, content keys, stats), and nothing but these layouts is read."""

import pytest
import torch

from inferscale.artifacts.result_codec import encoded_from_ipc, encoded_to_ipc
from tests.builders import make_inputs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_encoded_memory_round_trips_with_content_keys(dtype):
    memory, _, _ = make_inputs("ana", 4, dtype=dtype)
    for i, c in enumerate(memory.chunks[1:]):
        c.content_key = f"{i:064x}"  # the prefix keeps None
    memory.stats = {"facts": 4, "encoded": 3, "reused": 1}
    back = encoded_from_ipc(encoded_to_ipc(memory))
    assert [c.chunk_id for c in back.chunks] == [c.chunk_id for c in memory.chunks]
    assert [c.content_key for c in back.chunks] == [c.content_key for c in memory.chunks]
    for a, b in zip(memory.chunks, back.chunks):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)  # [L, T, H, D]
        assert b.keys.dtype == dtype
    assert (back.model_fingerprint, back.encoder_config, back.stats) == (
        memory.model_fingerprint, memory.encoder_config, memory.stats)


def test_other_bytes_are_refused():
    with pytest.raises(ValueError, match="not an Arrow IPC stream"):
        encoded_from_ipc(b"\x80\x04pickle")
