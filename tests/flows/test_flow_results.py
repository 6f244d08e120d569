"""A flow's result as JSON: the report, a failed run's ``UsersFailed`` with its report,
a raised exception; each read back as what was written, never through a pickle."""

from __future__ import annotations

import json

from flows.results import RESULT_SERIALIZER, UsersFailed, failed_run

REPORT = {"title": "Encode users", "counts": {"failed": 1, "published": 1},
          "users": {"maya": {"status": "published", "version": "0" * 32},
                    "tomas": {"status": "failed", "error": "NotADirectoryError: x"},
                    # user ids that look like the serializers' own markers stay data
                    "__inferscale_users_failed__": {"message": "m", "status": "failed"}}}


def test_a_failed_run_carries_its_report_as_json():
    state = failed_run("1 of 2 users failed: tomas", REPORT)
    assert state.is_failed() and state.message == "1 of 2 users failed: tomas"
    blob = RESULT_SERIALIZER.dumps(state.data)
    assert json.loads(blob)  # plain JSON: no pickle to load
    back = RESULT_SERIALIZER.loads(blob)
    assert isinstance(back, UsersFailed) and back.report == REPORT
    assert str(back) == "1 of 2 users failed: tomas"
    assert RESULT_SERIALIZER.loads(RESULT_SERIALIZER.dumps(REPORT)) == REPORT
    raised = RESULT_SERIALIZER.loads(RESULT_SERIALIZER.dumps(ValueError("no turns")))
    assert isinstance(raised, ValueError) and str(raised) == "no turns"
