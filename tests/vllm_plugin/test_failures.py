"""Fallback reasons: every refusal of the scheduler half carries the reason it was decided
for (an enum, never parsed from its words), and the reason reaches the server through
the reply's params (no engine: the real ``ConnectorScheduler`` fed residency reports,
asked about vLLM's own ``Request``s)."""

from __future__ import annotations

import pytest

from inferscale.vllm_plugin.config import PARAMS_KEY, ConnectorConfig
from inferscale.vllm_plugin.failures import Fallback, FallbackReason
from inferscale.vllm_plugin.metadata import (
    ColdSplit, MemoryReply, ResidencyReport, ResidentAdded, ResidentInfo,
)
from inferscale.vllm_plugin.scheduler import ConnectorScheduler

FP = "a" * 32
PREFIX, FACT = (1, 2, 3), (4, 5)


def request(req_id: str, params: dict, prompt: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {PARAMS_KEY: params}})
    return Request(req_id, prompt, sp, None)


def fallback_of(sched: ConnectorScheduler, req) -> Fallback | None:
    """The fallback the server reads back from the finished request's params."""
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    _, params = sched.request_finished(req, [])
    return MemoryReply.from_params(params).fallback


def report(*changes) -> "object":
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(kv_connector_worker_meta=ResidencyReport(list(changes)))


def test_each_refusal_has_its_reason():
    sched = ConnectorScheduler(ConnectorConfig(model_fingerprint=FP), block_size=16)
    held = ResidentInfo("ann", "v2", FP, {"prefix": PREFIX, "f1": FACT})
    other_model = ResidentInfo("bob", "v1", "b" * 32, {"prefix": PREFIX, "f1": FACT})
    sched.update_connector_output(report(ResidentAdded(0, held), ResidentAdded(0, other_model)))
    prompt = [*PREFIX, *FACT, 9, 9]
    cases = [
        (FallbackReason.NOT_RESIDENT, {"user": "carl", "version": "v1", "chunks": ["prefix"]},
         prompt),
        (FallbackReason.STALE_VERSION, {"user": "ann", "version": "v1", "chunks": ["prefix"]},
         prompt),
        (FallbackReason.FINGERPRINT_MISMATCH,
         {"user": "bob", "version": "v1", "chunks": ["prefix"]}, prompt),
        (FallbackReason.TOKEN_MISMATCH,
         {"user": "ann", "version": "v2", "chunks": ["prefix", "f1"]}, [*PREFIX, 7, 7, 9]),
        (FallbackReason.TOKEN_MISMATCH,
         {"user": "ann", "version": "v2", "chunks": ["prefix", "nope"]}, prompt),
        (FallbackReason.TOKEN_MISMATCH, {"user": "ann", "version": "v2", "chunks": []}, prompt),
        (FallbackReason.CONNECTOR_ERROR, {"user": "ann", "version": "v2", "chunks": 5}, prompt),
    ]
    for i, (reason, params, ids) in enumerate(cases):
        fallback = fallback_of(sched, request(f"r{i}", params, ids))
        assert fallback is not None and fallback.reason is reason, (params, fallback)
        assert fallback.detail  # and says it in words
    # the memory the view allows is admitted: no fallback
    ok = request("ok", {"user": "ann", "version": "v2", "chunks": ["prefix", "f1"]}, prompt)
    assert sched.get_num_new_matched_tokens(ok, 0) == (len(PREFIX) + len(FACT), False)
    assert MemoryReply.from_params(sched.request_finished(ok, [])[1]).fallback is None


def test_a_user_only_some_ranks_hold_counts_as_not_resident_and_is_not_read():
    """Tensor parallelism: rank 0 holds the user, rank 1 not (yet). Its reason is the
    label of a user nobody holds, but unlike such a user its facts are not read from
    storage (the ranks that hold it would then hold two sources): that is decided where
    the refusal is, not by its words."""
    config = ConnectorConfig(model_fingerprint=FP, artifact_root="/nowhere")
    sched = ConnectorScheduler(config, block_size=16, tp_size=2)
    sched.update_connector_output(report(ResidentAdded(0, ResidentInfo(
        "ann", "v2", FP, {"prefix": PREFIX, "f1": FACT}))))
    ref = {"user": "ann", "version": "v2", "chunks": ["prefix", "f1"],
           "lengths": [len(PREFIX), len(FACT)]}
    fallback = fallback_of(sched, request("r", ref, [*PREFIX, *FACT, 9]))
    assert fallback == Fallback(FallbackReason.NOT_RESIDENT,
                                "user not resident on every rank (1 of 2 hold it)")
    # nobody holds carl: the same reason, and his facts are read from storage
    carl = sched.get_num_new_matched_tokens(request("c", {**ref, "user": "carl"},
                                                    [*PREFIX, *FACT, 9]), 0)
    assert carl == (len(PREFIX) + len(FACT), True)


def test_the_reason_travels_as_its_value():
    reply = MemoryReply(0, Fallback(FallbackReason.LOAD_ERROR, "memory load failed (x)"),
                        cold=ColdSplit(0, 3, True))
    params = reply.to_params()
    assert params[PARAMS_KEY]["fallback_reason"] == "load_error"
    assert params[PARAMS_KEY]["fallback"] == "memory load failed (x)"
    assert MemoryReply.from_params(params) == reply
    assert "fallback_reason" not in MemoryReply().to_params()[PARAMS_KEY]


@pytest.mark.parametrize("value", ["something new", None, 3, ["x"]])
def test_a_reason_this_side_does_not_know_is_other(value):
    """A reply from another release may carry a reason this server does not know: it is
    counted as ``other``, its words kept."""
    body = {"fallback": "a new kind of refusal", "fallback_reason": value}
    assert MemoryReply.from_params({PARAMS_KEY: body}).fallback == \
        Fallback(FallbackReason.OTHER, "a new kind of refusal")
    assert FallbackReason.of(value) is FallbackReason.OTHER
