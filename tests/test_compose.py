"""Request composition: memory-line text, the layout of injected facts and text tail."""

import pytest

from inferscale.compose import ComposeError, Composer, memory_layout, memory_text


def test_memory_text():
    assert memory_text("Caroline", "I went.", "2023-05-08T13:56:00") == \
        "[2023-05-08] Caroline: I went."
    assert memory_text("Caroline", "I went.") == "Caroline: I went."


RANKED = ["d", "b", "a", "e", "c"]  # best first
SOURCE = {"a": 0, "b": 1, "c": 2, "d": 3, "e": 4}


@pytest.mark.parametrize("order,tail,injected,tail_out", [
    ("relevance", 0, ["d", "b", "a", "e", "c"], []),
    ("relevance", 2, ["a", "e", "c"], ["b", "d"]),  # the best fact right before the question
    ("relevance_last", 2, ["c", "e", "a"], ["b", "d"]),
    ("chronological", 2, ["a", "c", "e"], ["b", "d"]),
    ("chronological", 0, ["a", "b", "c", "d", "e"], []),
    ("relevance", 9, [], ["c", "e", "a", "b", "d"]),  # a tail longer than k: all as text
])
def test_memory_layout(order, tail, injected, tail_out):
    assert memory_layout(RANKED, order, tail, SOURCE) == (injected, tail_out)


@pytest.mark.parametrize("tail_max_k,injected,tail_out", [
    (5, ["a", "e", "c"], ["b", "d"]),  # k = 5 <= 5: the tail
    (4, ["d", "b", "a", "e", "c"], []),  # k = 5 > 4: every fact injected
    (0, ["a", "e", "c"], ["b", "d"]),  # 0: the tail at every k
])
def test_memory_layout_tail_only_where_memory_is_short(tail_max_k, injected, tail_out):
    assert memory_layout(RANKED, "relevance", 2, SOURCE, tail_max_k) == (injected, tail_out)


def test_memory_layout_errors():
    with pytest.raises(ComposeError, match="order"):
        memory_layout(RANKED, "random")
    with pytest.raises(ComposeError, match="source"):
        memory_layout(RANKED, "chronological")


@pytest.mark.slow
def test_compose_with_a_text_tail(smollm2):
    composer = Composer(smollm2.tokenizer)
    prefix = composer.prefix_ids()
    facts = [composer.fact_ids(t) for t in ("Rex is a dog.", "Rex likes snow.", "Ann is 9.")]
    ids, m = composer.compose([prefix, facts[0]], "Who is Rex?", [facts[1], facts[2]])
    assert m == len(prefix) + len(facts[0])  # the tail is not memory: the request computes it
    assert ids == prefix + facts[0] + facts[1] + facts[2] + composer.query_ids("Who is Rex?")
    plain, m0 = composer.compose([prefix] + facts, "Who is Rex?")
    assert plain == ids and m0 == len(ids) - len(composer.query_ids("Who is Rex?"))
