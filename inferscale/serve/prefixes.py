"""A server's composers, one per instruction, and their prefixes, each made once.

A user's version names the instruction its prefix KV was encoded with (its encoder
config); the server composes that user's requests after the same prefix. Its token ids,
and whether the prefix leaves room in the model's context for any request, depend on
the instruction alone: computed once per instruction here, where every first load of a
user (and every request without memory) used to tokenize it again.
"""

from __future__ import annotations

from typing import Any

from inferscale.compose import Composer
from inferscale.serve.memory_cache import MemoryRefused


class Prefixes:
    """Composers and prefix token ids by instruction (None: the default one) for one
    tokenizer and the model's context (``max_model_len``, None: unchecked). Concurrent
    callers may build one twice; the results are the same."""

    def __init__(self, tokenizer: Any, max_model_len: int | None = None):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self._composers: dict[str, Composer] = {}
        self._ids: dict[str, tuple[int, ...]] = {}
        self._query_min: int | None = None  # tokens around the shortest question

    def composer(self, instruction: str | None = None) -> Composer:
        key = instruction or ""
        if key not in self._composers:
            self._composers[key] = (Composer(self.tokenizer, instruction) if instruction
                                    else Composer(self.tokenizer))
        return self._composers[key]

    def ids(self, instruction: str | None = None) -> tuple[int, ...]:
        """The instruction's prefix token ids (:meth:`Composer.prefix_ids`)."""
        key = instruction or ""
        ids = self._ids.get(key)
        if ids is None:
            ids = self._ids[key] = tuple(self.composer(instruction).prefix_ids())
        return ids

    def servable(self, version: str, encoder_config: dict) -> tuple[int, ...]:
        """The token ids of the instruction prefix the version was encoded with, or
        MemoryRefused ``instruction`` when it is not text or when it, the question's
        template and one answer token exceed the model's context (no request could
        fit; such an instruction is not kept)."""
        instruction = encoder_config.get("instruction")
        if instruction is not None and not isinstance(instruction, str):
            raise MemoryRefused(version, "instruction", f"its instruction is a "
                                f"{type(instruction).__name__}, not text")
        prefix = self.ids(instruction)
        if self._query_min is None:  # the shortest request: a one-character question ...
            self._query_min = len(self.composer(None).query_ids("?"))
        shortest = len(prefix) + self._query_min + 1  # ... and one answer token
        limit = self.max_model_len
        if limit is not None and shortest > limit:
            self._composers.pop(instruction or "", None)
            self._ids.pop(instruction or "", None)
            raise MemoryRefused(version, "instruction",
                                f"its instruction prefix is {len(prefix)} tokens: with the "
                                f"question's template and one answer token no request fits "
                                f"the model's context ({limit} tokens)")
        return prefix
