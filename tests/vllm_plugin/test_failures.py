"""Fallback reasons: every sentence the scheduler half answers a refused request with
falls in the class the server's metrics count it under (no engine: the real
``ConnectorScheduler`` fed residency reports, asked about vLLM's own ``Request``s)."""

from __future__ import annotations

import pytest

from inferscale.vllm_plugin.config import PARAMS_KEY, ConnectorConfig
from inferscale.vllm_plugin.failures import FALLBACK_REASONS, fallback_reason
from inferscale.vllm_plugin.metadata import ResidencyReport, ResidentInfo
from inferscale.vllm_plugin.scheduler import ConnectorScheduler

FP = "a" * 32
PREFIX, FACT = (1, 2, 3), (4, 5)


def request(req_id: str, params: dict, prompt: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {PARAMS_KEY: params}})
    return Request(req_id, prompt, sp, None)


def fallback_of(sched: ConnectorScheduler, req) -> str | None:
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    _, params = sched.request_finished(req, [])
    return params[PARAMS_KEY].get("fallback")


def test_each_refusal_has_its_reason():
    from vllm.v1.outputs import KVConnectorOutput

    sched = ConnectorScheduler(ConnectorConfig(model_fingerprint=FP), block_size=16)
    held = ResidentInfo("ann", "v2", FP, {"prefix": PREFIX, "f1": FACT})
    other_model = ResidentInfo("bob", "v1", "b" * 32, {"prefix": PREFIX, "f1": FACT})
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=ResidencyReport(
        [(0, "add", held), (0, "add", other_model)])))  # (rank, op, payload)
    prompt = [*PREFIX, *FACT, 9, 9]
    cases = {
        "not_resident": ({"user": "carl", "version": "v1", "chunks": ["prefix"]}, prompt),
        "stale_version": ({"user": "ann", "version": "v1", "chunks": ["prefix"]}, prompt),
        "fingerprint_mismatch": ({"user": "bob", "version": "v1", "chunks": ["prefix"]}, prompt),
        "token_mismatch": ({"user": "ann", "version": "v2", "chunks": ["prefix", "f1"]},
                           [*PREFIX, 7, 7, 9]),
        "connector_error": ({"user": "ann", "version": "v2", "chunks": 5}, prompt),
    }
    seen = {}
    for i, (reason, (params, ids)) in enumerate(cases.items()):
        text = fallback_of(sched, request(f"r{i}", params, ids))
        seen[reason] = text
        assert fallback_reason(text) == reason, text
    unknown = fallback_of(sched, request("r9", {"user": "ann", "version": "v2",
                                                "chunks": ["prefix", "nope"]}, prompt))
    assert fallback_reason(unknown) == "token_mismatch", unknown
    # and the memory the view allows is admitted: no fallback, no reason
    ok = request("ok", {"user": "ann", "version": "v2", "chunks": ["prefix", "f1"]}, prompt)
    assert sched.get_num_new_matched_tokens(ok, 0) == (len(PREFIX) + len(FACT), False)
    assert fallback_reason(sched.request_finished(ok, [])[1][PARAMS_KEY].get("fallback")) is None
    assert set(seen) | {"load_error", "other"} == set(FALLBACK_REASONS)


def test_a_user_only_some_ranks_hold_counts_as_not_resident():
    """Tensor parallelism: rank 0 holds the user, rank 1 not (yet)."""
    from vllm.v1.outputs import KVConnectorOutput

    sched = ConnectorScheduler(ConnectorConfig(model_fingerprint=FP), block_size=16, tp_size=2)
    held = ResidentInfo("ann", "v2", FP, {"prefix": PREFIX, "f1": FACT})
    sched.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=ResidencyReport([(0, "add", held)])))
    text = fallback_of(sched, request("r", {"user": "ann", "version": "v2", "chunks": [
        "prefix", "f1"]}, [*PREFIX, *FACT, 9]))
    assert text == "user not resident on every rank (1 of 2 hold it)"
    assert fallback_reason(text) == "not_resident"


@pytest.mark.parametrize("text, reason", [
    ("memory load failed (NotImplementedError: Cannot copy out of meta tensor); recomputed",
     "load_error"),
    ("connector disabled after an error (KeyError: 3)", "connector_error"),
    ("something new", "other"),
    (None, None), ("", None),
])
def test_worker_and_unknown_sentences(text, reason):
    assert fallback_reason(text) == reason
