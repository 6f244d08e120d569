"""The server's own detokenization gives vLLM's text from a short prompt suffix.

The reference is what vLLM 0.26 / 0.32 do: a ``DecodeStream`` primed with the whole
prompt, special tokens skipped. SmolLM2's real tokenizer (byte-level BPE: tokens that are
partial UTF-8 characters, 17 special tokens), hostile prompts and outputs (multibyte
text cut anywhere, specials, ids past the vocabulary as the ``-shape`` models' dummy
weights emit).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferscale.serve.detokenize import MAX_SUFFIX, TextStream, backend_of, prime_ids

TEXTS = ["Caroline went to the LGBTQ support group on 7 May 2023.",
         "Melanie's kids: 🦄 naïve café — 東京 ✓",
         "<|im_start|>user\nWhat did I say?<|im_end|>"]


@pytest.fixture(scope="module")
def backend(inferscale_home):
    from transformers import AutoTokenizer

    from inferscale.models import resolve_checkpoint

    tok = AutoTokenizer.from_pretrained(resolve_checkpoint("embedded", inferscale_home))
    return backend_of(tok)


def reference(backend, prompt: list[int], outputs: list[int]) -> str:
    """vLLM's text: the stream primed with the whole prompt; an id the tokenizer cannot
    take adds nothing."""
    from tokenizers.decoders import DecodeStream

    stream, out = DecodeStream(ids=prompt, skip_special_tokens=True), []
    for t in outputs:
        try:
            out.append(stream.step(backend, t) or "")
        except (OverflowError, TypeError):
            pass
    return "".join(out)


def test_backend_of_finds_the_fast_tokenizer_and_refuses_others(backend):
    from tokenizers import Tokenizer

    assert isinstance(backend, Tokenizer)
    assert backend_of(backend) is backend
    assert backend_of(object()) is None


def test_a_long_prompt_is_primed_with_a_short_suffix(backend):
    prompt = backend.encode(" ".join(TEXTS * 60)).ids  # [~1,800]
    assert len(prompt) > 1000
    ids = prime_ids(backend, prompt)
    assert 4 <= len(ids) < MAX_SUFFIX and ids == prompt[-len(ids):]
    assert "\ufffd" not in backend.decode(ids)


def test_a_suffix_never_starts_inside_a_character(backend):
    prompt = backend.encode("東京" * 40).ids  # every few ids a character's bytes are split
    ids = prime_ids(backend, prompt)
    assert "\ufffd" not in backend.decode(ids) and ids == prompt[-len(ids):]


def test_steps_that_add_no_text_come_back_empty_then_whole(backend):
    prompt = backend.encode("Hello").ids
    emoji = backend.encode(" 🦄").ids  # several byte tokens, text only once all came
    assert len(emoji) > 1
    stream = TextStream(backend, prompt)
    pieces = [stream.step([t]) for t in emoji]
    assert pieces[:-1] == [""] * (len(emoji) - 1) and pieces[-1] == " 🦄"


vocab = st.integers(0, 49151)  # SmolLM2's vocabulary, specials (0..16) included
hostile = st.one_of(vocab, st.integers(0, 16), st.integers(49152, 128255))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(min_size=0, max_size=120), cut=st.integers(0, 40),
       extra=st.lists(vocab, max_size=30), outputs=st.lists(hostile, max_size=40))
def test_the_text_is_vllms_whatever_the_prompt_and_output(backend, text, cut, extra, outputs):
    prompt = backend.encode(text).ids
    prompt = prompt[:max(0, len(prompt) - cut)] + extra  # cut anywhere, then any ids
    stream = TextStream(backend, prompt)
    ours = "".join(stream.step([t]) for t in outputs)
    assert ours == reference(backend, prompt, outputs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.sampled_from(TEXTS), outputs=st.lists(hostile, max_size=40),
       sizes=st.lists(st.integers(1, 5), min_size=1, max_size=12))
def test_ids_in_bunches_give_the_same_text(backend, text, outputs, sizes):
    """vLLM's deltas carry several ids when steps are batched (or speculated)."""
    prompt = backend.encode(text * 30).ids
    one = TextStream(backend, prompt)
    single = "".join(one.step([t]) for t in outputs)
    many, i, got = TextStream(backend, prompt), 0, []
    for n in sizes * (len(outputs) + 1):
        if i >= len(outputs):
            break
        got.append(many.step(outputs[i:i + n]))
        i += n
    assert "".join(got) == single == reference(backend, prompt, outputs)
