"""The cached tasks' results are stored as Arrow IPC, never pickled: round trips through
the Prefect serializers, and what a result record holds."""

from __future__ import annotations

import base64
import json

import pytest
import torch

from builders import make_inputs
from inferscale.facts.extractor import FactsResult
from tasks.results import EncodedKVSerializer, FactsResultSerializer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_encoded_kv_round_trip(dtype):
    memory, _, _ = make_inputs("maya", 5, dtype=dtype)
    memory.stats = {"facts": 5}
    memory.calibration = {"granularity": "head", "temperatures": [[1.0, 1.25], [0.9, 1.0]]}
    for i, c in enumerate(memory.chunks[1:]):  # the prefix keeps None
        c.content_key = f"{i:064x}"
    ser = EncodedKVSerializer()
    blob = ser.dumps(memory)
    raw = base64.b64decode(blob)
    assert not raw.startswith(b"\x80") and b"cloudpickle" not in raw  # no pickle inside
    back = ser.loads(blob)
    assert back.model_fingerprint == memory.model_fingerprint
    assert back.encoder_config == memory.encoder_config and back.stats == {"facts": 5}
    assert back.calibration == memory.calibration
    assert [c.chunk_id for c in back.chunks] == [c.chunk_id for c in memory.chunks]
    assert [c.content_key for c in back.chunks] == [c.content_key for c in memory.chunks]
    for a, b in zip(back.chunks, memory.chunks):
        assert a.token_ids == b.token_ids
        assert a.kv.dtype == dtype and torch.equal(a.kv, b.kv) and a.kv.is_contiguous()


def test_facts_round_trip_and_foreign_blobs():
    _, facts, _ = make_inputs("maya", 4)
    result = FactsResult("maya", facts, "h" * 64, "st:x:4", 3, {"D1:1": 2}, {"calls": 1})
    ser = FactsResultSerializer()
    back = ser.loads(ser.dumps(result))
    assert back == result and back.table.schema.metadata == facts.schema.metadata
    with pytest.raises(ValueError, match="expected a facts result"):
        ser.loads(EncodedKVSerializer().dumps(make_inputs("maya", 1)[0]))
    with pytest.raises(ValueError, match="not an Arrow IPC stream"):
        ser.loads(base64.b64encode(b"\x80\x04 a pickle, say"))


def test_result_records_name_the_serializer():
    """What Prefect writes to result storage: JSON naming our serializer, Arrow inside;
    and reading it back goes through our ``loads`` (found by its type)."""
    from prefect._internal.result_records import ResultRecord, ResultRecordMetadata

    memory, _, _ = make_inputs("maya", 2)
    record = ResultRecord(metadata=ResultRecordMetadata(serializer=EncodedKVSerializer()),
                          result=memory)
    data = record.serialize()
    body = json.loads(data)
    assert body["metadata"]["serializer"] == {"type": "inferscale-encoded-kv-arrow"}
    back = ResultRecord.deserialize(data).result
    assert torch.equal(back.chunks[1].kv, memory.chunks[1].kv)
