"""The text of a request's output tokens, decoded in the server from a short prompt suffix.

vLLM's own detokenizer (0.26 and 0.32) primes each request's ``tokenizers`` ``DecodeStream``
with the *whole* prompt. While generated tokens add text the stream trims itself, but a
token that adds none (a partial UTF-8 character, a skipped special token, an id the
tokenizer does not know) leaves it untrimmed, and the next step decodes the whole prompt
again. A memory prompt is ~2,700 ids, so each such token costs ~0.35 ms of the API
server's event loop, with the GIL held: 11 ms a request of 32 text-less tokens on this
project's CPU machine (``python -m benchmarks.detokenize``: 0.04 ms so). Under load on
an H100 that work, all on the loop, delayed the retrieval of requests arriving in a burst
by 50-130 ms, most likely (the 2,000-user run at 12 requests/s, benchmarks/load-runs.md,
"sixth run"; the ``-shape`` models' dummy weights emit ids past the tokenizer's vocabulary);
decoded here, the loop's lag peaked at 2.5-25 ms in the next run ("seventh run").

So the server asks vLLM for token ids only (``detokenize=False``) and decodes them here,
priming the stream with the shortest suffix of 4 to 23 prompt ids that decodes without a
replacement character (a suffix starting on a character boundary; vLLM's own rule before
it primed with everything), and with the whole prompt only when none does. The text is
the same as vLLM's (special tokens skipped, as vLLM's default), at a cost bounded by the
suffix and the output.
"""

from __future__ import annotations

from typing import Any, Iterable

REPLACEMENT = "\ufffd"
INVALID_PREFIX = "Invalid prefix encountered"  # tokenizers' error for non-monotonic text
MIN_SUFFIX, MAX_SUFFIX = 4, 24  # suffix lengths tried: MIN_SUFFIX .. MAX_SUFFIX - 1


def backend_of(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` (a transformers fast tokenizer or
    vLLM's wrapper of one), or None (a slow tokenizer: vLLM keeps detokenizing)."""
    from tokenizers import Tokenizer

    for name in ("backend_tokenizer", "_tokenizer"):
        inner = getattr(tokenizer, name, None)
        if isinstance(inner, Tokenizer):
            return inner
    return tokenizer if isinstance(tokenizer, Tokenizer) else None


def prime_ids(backend: Any, prompt_ids: list[int]) -> list[int]:
    """The prompt suffix a request's stream starts from (module doc)."""
    if len(prompt_ids) <= MIN_SUFFIX:
        return list(prompt_ids)
    for n in range(MIN_SUFFIX, min(len(prompt_ids) + 1, MAX_SUFFIX)):
        suffix = prompt_ids[-n:]
        if REPLACEMENT not in backend.decode(suffix, skip_special_tokens=True):
            return list(suffix)
    return list(prompt_ids)


class TextStream:
    """One request's output text, token by token: :meth:`step` returns the text the ids
    add (``""`` while they add none yet)."""

    def __init__(self, backend: Any, prompt_ids: list[int], skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self.backend = backend
        self._new = lambda ids: DecodeStream(ids=ids, skip_special_tokens=skip_special_tokens)
        self.stream = self._new(prime_ids(backend, prompt_ids))

    def step(self, token_ids: Iterable[int]) -> str:
        out = []
        for t in token_ids:
            try:
                piece = self.stream.step(self.backend, t)
            except (OverflowError, TypeError):  # as vLLM: an id it cannot take adds nothing
                piece = None
            except Exception as exc:  # noqa: BLE001 - as vLLM: a broken prefix, start anew
                if not str(exc).startswith(INVALID_PREFIX):
                    raise
                self.stream = self._new([])
                piece = self.stream.step(self.backend, t)
            if piece:
                out.append(piece)
        return "".join(out)
