"""What a flow run returns: its report, persisted as JSON; a run that failed some users
ends Failed with the report in an exception.

Prefect 3.7.7 turns a Failed state's data into the exception its engine raises when the
run ends (``prefect.states.get_state_exception``): an exception, a string, a state or
nothing; any other data, such as a report dict, is ``TypeError: Unexpected result for
failed state`` in the worker. So :func:`failed_run` puts the report in a
:class:`UsersFailed` (``.report``). The engine raises it like any failed flow's exception:
the run stays Failed (not Crashed) and its process exits with status 1, as for every
Failed run.

The flows persist their result (``persist_result=True``) in Prefect's result storage with
:data:`RESULT_SERIALIZER`: JSON, a :class:`UsersFailed` as its message and report, the
exception of a flow that raised as Prefect's JSON writes it (its type and message); never
a pickle, whose loading would run whatever its writer put there. A deployment run's
report is then read from its state, ``state.result(raise_on_failure=False)`` (the
report, or a :class:`UsersFailed` holding it), wherever that storage can be read.
"""

from __future__ import annotations

from typing import Any

from prefect.serializers import (
    JSONSerializer, prefect_json_object_decoder, prefect_json_object_encoder,
)
from prefect.states import Failed, State

_MARK = "__inferscale_users_failed__"


class UsersFailed(Exception):
    """A run that failed some users; ``report`` is the run's report (a dict, as the
    flow returns when every user succeeds)."""

    def __init__(self, message: str, report: dict[str, Any]):
        super().__init__(message, report)
        self.message, self.report = message, report

    def __str__(self) -> str:
        return self.message


def failed_run(message: str, report: dict[str, Any]) -> State:
    """The state a flow returns when some users failed (after the others finished)."""
    return Failed(message=message, data=UsersFailed(message, report))


def encode_object(obj: Any) -> Any:
    """``json.dumps(default=...)``: a :class:`UsersFailed` as its message and report;
    anything else as Prefect's JSON serializer writes it (the exception of a flow that
    raised: its type and message)."""
    if isinstance(obj, UsersFailed):
        return {_MARK: {"message": obj.message, "report": obj.report}}
    return prefect_json_object_encoder(obj)


def decode_object(obj: dict[str, Any]) -> Any:
    """``json.loads(object_hook=...)``: the inverse of :func:`encode_object`."""
    inner = obj.get(_MARK) if len(obj) == 1 else None
    if isinstance(inner, dict) and set(inner) == {"message", "report"}:
        return UsersFailed(inner["message"], inner["report"])
    return prefect_json_object_decoder(obj)


# readers import the hooks by these names (a module loaded by path would have another)
RESULT_SERIALIZER = JSONSerializer(object_encoder="flows.results.encode_object",
                                   object_decoder="flows.results.decode_object")

# the options of every flow: the report persisted, as JSON
PERSISTED = {"persist_result": True, "result_serializer": RESULT_SERIALIZER}
