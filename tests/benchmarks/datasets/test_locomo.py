"""LoCoMo files read for the benchmarks: one user's turns, questions of categories 1-4."""

from __future__ import annotations

from benchmarks.datasets import locomo


def test_turns_and_questions_of_the_answerable_categories(conversations):
    turns = locomo.turns(conversations[0])
    assert turns.num_rows == 8 and set(turns["user"].to_pylist()) == {"c0"}
    qs = locomo.questions(conversations[0])
    assert [q["question"] for q in qs] == [f"c0 question {i}?" for i in (0, 1, 2, 3, 5)]
    assert [q["id"] for q in qs] == list(range(5)) and qs[4]["category"] == 2
    # a subset evenly spaced over the file's order
    assert [q["question"] for q in locomo.questions(conversations[0], max_questions=2)] == \
        ["c0 question 0?", "c0 question 2?"]
    assert [q["category"] for q in locomo.questions(conversations[0], categories=(5,))] == [5]
