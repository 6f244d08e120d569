"""Result serializers of the cached compute tasks: Arrow IPC, never pickle.

Prefect keeps a persisted task result in result storage, by default pickled; the facts
and KV tasks' results are cached there for days and often on shared storage, where a
pickle would let whoever can write it run code in the next run that loads it. These
serializers store them as Arrow IPC (:mod:`inferscale.artifacts.result_codec`), base64-wrapped as
Prefect's result records expect. Prefect finds them by their ``type`` when it reads a
record; importing this module (the tasks do) registers them.
"""

from __future__ import annotations

import base64
from typing import Any

from prefect.serializers import Serializer
from pydantic import Field

from inferscale.artifacts.result_codec import (
    encoded_from_ipc, encoded_to_ipc, facts_from_ipc, facts_to_ipc,
)


class EncodedKVSerializer(Serializer):
    """``tasks.encode.encode_kv``'s result (an ``EncodedMemory``) as Arrow IPC."""

    type: str = Field(default="inferscale-encoded-kv-arrow", frozen=True)

    def dumps(self, obj: Any) -> bytes:
        return base64.b64encode(encoded_to_ipc(obj))

    def loads(self, blob: bytes) -> Any:
        return encoded_from_ipc(base64.b64decode(blob))


class FactsResultSerializer(Serializer):
    """``tasks.facts.extract_facts``'s result (a ``FactsResult``) as Arrow IPC."""

    type: str = Field(default="inferscale-facts-arrow", frozen=True)

    def dumps(self, obj: Any) -> bytes:
        return base64.b64encode(facts_to_ipc(obj))

    def loads(self, blob: bytes) -> Any:
        return facts_from_ipc(base64.b64decode(blob))
