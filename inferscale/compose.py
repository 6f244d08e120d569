"""Prompt composition: ``[instruction prefix | fact_1 | ... | fact_k | query]``.

The same token ids are used offline and online: each fact is tokenized once, on its own
(:meth:`Composer.fact_ids`), stored with the artifact, and the serving path concatenates
the stored ids; the concatenated text is never re-tokenized. Memory occupies virtual
positions ``0 .. m-1``; the query starts at ``m``.

The chat template of the model decides the wrapper: the prefix is everything the
template emits before the system message content plus the instruction; the query
segment closes the system message, opens the user turn, holds the question and opens
the assistant turn. Models without a chat template get a plain-text layout.

Only that template emits control tokens. Everything else — facts, questions, the
instruction, the encoder's window of turns — is text: a tokenizer's added tokens
(``<|im_start|>``, ``<|im_end|>``...) written in it stay plain text, so a log line or a
question cannot open a second system turn. The tokenizer's own switch for that
(``split_special_tokens``) flips a flag on the shared Rust tokenizer per call, which
another thread's call can flip back; so text is tokenized with a private copy of the
backend whose added tokens are never parsed. Text without added-token text gets the
ids a plain ``tokenizer.encode(..., add_special_tokens=False)`` gives: control tokens are
hard boundaries for the tokenizer, and the text between two of them is tokenized the
same way either way.

The fact extractor (fact token ids), the encoder and the server share it, so it sits
below every stage.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from inferscale.types import MEMORY_ORDERS

DEFAULT_INSTRUCTION = (
    "You are a helpful assistant with a long-term memory of the user. "
    "Answer the user's question using these remembered facts when they are relevant.\n"
)
_SYS, _USR = "\x00SYSTEM\x00", "\x00USER\x00"
_TEXT = "\x00TEXT\x00"


def memory_text(speaker: str, text: str, timestamp: str | None = None) -> str:
    """A conversation turn as a memory line's text: ``"[2023-05-08] Caroline: text"``.

    The one format shared by raw-turn facts (:mod:`inferscale.facts.extractor`) and
    encoder windows written as memory lines (:mod:`inferscale.encode.encoder`).
    """
    line = f"{speaker}: {text}"
    return f"[{timestamp[:10]}] {line}" if timestamp else line


def memory_layout(ranked: Sequence[str], order: str = "relevance", text_tail: int = 0,
                  source_index: Mapping[str, int] | None = None, tail_max_k: int = 0
                  ) -> tuple[list[str], list[str]]:
    """Split retrieved facts (``ranked``: best first) into (injected, tail), both in the
    order they are served.

    ``tail``: the ``text_tail`` best facts, best last (right before the question), which
    the request prefills as text; ``injected``: the others in ``order`` ("relevance":
    best first, "relevance_last": best last, "chronological": by ``source_index``).
    ``tail_max_k`` > 0: the tail only when at most that many facts were retrieved (short
    memory is cheap to prefill); above it every fact is injected.
    """
    if order not in MEMORY_ORDERS:
        raise ComposeError(f"memory order must be one of {MEMORY_ORDERS}, got {order!r}")
    if tail_max_k and len(ranked) > tail_max_k:
        text_tail = 0
    tail = list(reversed(ranked[:text_tail]))
    injected = list(ranked[text_tail:])
    if order == "relevance_last":
        injected.reverse()
    elif order == "chronological":
        if source_index is None:
            raise ComposeError("chronological order needs the facts' source turn indices")
        injected.sort(key=lambda f: source_index[f])
    return injected, tail


class ComposeError(ValueError):
    """Input that cannot be composed (empty fact, template without a system role...)."""


@dataclass(frozen=True)
class Composer:
    """Turns instruction, facts and a question into token ids for one tokenizer.

    ``instruction`` is part of the encoder config: artifacts store the prefix KV made
    from it, so changing it makes a new artifact version.
    """

    tokenizer: Any
    instruction: str = DEFAULT_INSTRUCTION
    fact_template: str = "- {text}\n"
    _pieces: tuple[str, str, str] = field(init=False, repr=False, compare=False)
    _controls: dict[str, int] = field(init=False, repr=False, compare=False)
    _control_re: re.Pattern | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pieces", self._template_pieces())
        controls = _added_tokens(self.tokenizer)
        object.__setattr__(self, "_controls", controls)
        object.__setattr__(self, "_control_re", re.compile(
            "(" + "|".join(map(re.escape, sorted(controls, key=len, reverse=True))) + ")")
            if controls else None)
        _text_encoder(self.tokenizer)  # made now, not on the first request

    def _template_pieces(self) -> tuple[str, str, str]:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(
                [{"role": "system", "content": _SYS}, {"role": "user", "content": _USR}],
                tokenize=False, add_generation_prompt=True,
            )
            if _SYS in text and _USR in text and text.index(_SYS) < text.index(_USR):
                head, rest = text.split(_SYS, 1)
                middle, tail = rest.split(_USR, 1)
                return head, middle, tail
        bos = tok.bos_token or ""
        return bos, "\nQuestion: ", "\nAnswer:"

    def _encode(self, text: str) -> list[int]:
        """Token ids of ``text`` that never holds a control token (the text of one is
        tokenized as plain text)."""
        return _text_encoder(self.tokenizer)(text)

    def _join(self, *parts: tuple[str, bool]) -> list[int]:
        """Token ids of the concatenated ``(text, is_template)`` parts: control tokens
        are read from template parts only. Text between two control tokens is tokenized
        as one run across parts, as the tokenizer does with the whole string (so text
        without control-token text gets the ids of a plain ``encode``)."""
        ids: list[int] = []
        run: list[str] = []
        for text, template in parts:
            pieces = self._control_re.split(text) if template and self._control_re else [text]
            for i, piece in enumerate(pieces):
                if i % 2 == 0:
                    run.append(piece)
                else:  # a control token of the template
                    ids += self._encode("".join(run))
                    run = []
                    ids.append(self._controls[piece])
        return ids + self._encode("".join(run))

    def prefix_ids(self) -> list[int]:
        """Template head + instruction: the first memory segment, at positions 0..P-1."""
        return self._join((self._pieces[0], True), (self.instruction, False))

    def fact_ids(self, text: str, max_tokens: int | None = None) -> list[int]:
        """One fact's token ids, tokenized on its own (fixed once, stored, reused).

        Empty facts are an error; facts longer than ``max_tokens`` are truncated to
        their first ``max_tokens`` tokens (the closing newline is kept).
        """
        if not text or not text.strip():
            raise ComposeError("empty fact text")
        head, tail = self.fact_template.format(text=_TEXT).split(_TEXT, 1)
        ids = self._join((head, True), (text.strip(), False), (tail, True))
        if max_tokens is not None and len(ids) > max_tokens:
            tail = self._encode("\n")
            ids = ids[: max(1, max_tokens - len(tail))] + tail
        return ids

    def query_ids(self, question: str) -> list[int]:
        """The segment after memory: close the system turn, the question, open the answer."""
        if not question or not question.strip():
            raise ComposeError("empty question")
        _, middle, tail = self._pieces
        return self._join((middle, True), (question.strip(), False), (tail, True))

    def compose(self, memory: Sequence[Sequence[int]], question: str,
                tail: Sequence[Sequence[int]] = ()) -> tuple[list[int], int]:
        """``memory`` = [prefix ids, fact ids...] -> (prompt ids, memory length m).

        ``tail``: facts written as text after the memory and before the question (the
        request prefills them; they are not part of the ``m`` memory tokens)."""
        ids: list[int] = [t for chunk in memory for t in chunk]
        m = len(ids)
        return ids + [t for chunk in tail for t in chunk] + self.query_ids(question), m


def _added_tokens(tokenizer: Any) -> dict[str, int]:
    """Text -> id of every token the tokenizer parses out of text (its added tokens,
    special or not)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {tok.content: i for i, tok in decoder.items() if tok.content}


_text_encoders: "weakref.WeakKeyDictionary[Any, tuple[int, Callable]]" = weakref.WeakKeyDictionary()
_text_encoders_lock = threading.Lock()


def _text_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """``text -> ids`` with no added token parsed out of the text.

    A fast tokenizer: a private copy of its Rust backend with every added token marked
    special and ``encode_special_tokens`` on (so none is matched), used only here and
    never switched; the shared tokenizer is left as it is. The copy (the whole
    vocabulary) is made once per tokenizer object, again only if tokens were added
    since. Without a Rust backend: the tokenizer's ``split_special_tokens=True``, which
    such (Python) tokenizers take per call."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return lambda text: list(tokenizer.encode(text, add_special_tokens=False,
                                                  split_special_tokens=True))
    size = len(tokenizer)
    cached = _text_encoders.get(tokenizer)
    if cached is None or cached[0] != size:
        with _text_encoders_lock:
            cached = _text_encoders.get(tokenizer)
            if cached is None or cached[0] != size:
                cached = (size, _private_text_encoder(tokenizer.backend_tokenizer))
                _text_encoders[tokenizer] = cached
    return cached[1]


def _private_text_encoder(backend: Any) -> Callable[[str], list[int]]:
    from tokenizers import Tokenizer

    spec = json.loads(backend.to_str())
    for tok in spec.get("added_tokens", []):
        tok["special"] = True  # encode_special_tokens splits special added tokens only
    private = Tokenizer.from_str(json.dumps(spec))
    private.no_truncation()
    private.no_padding()
    private.encode_special_tokens = True
    return lambda text: private.encode(text, add_special_tokens=False).ids
