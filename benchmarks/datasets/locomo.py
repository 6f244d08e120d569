"""LoCoMo conversations (``../shared/data/locomo/conv-*.json``, one user each): the
user's turns through the library's reader, and the questions of categories 1-4
(multi-hop, temporal, open-domain, single-hop; category 5, adversarial, has no answer in
the conversation)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from inferscale.ingest.logs import read_logs

CATEGORIES = (1, 2, 3, 4)


def turns(conversation: str | Path) -> pa.Table:
    """The conversation's one user's turns (``storage_schemas.turns``)."""
    (table,) = read_logs(str(conversation)).turns.values()
    return table


def questions(conversation: str | Path, categories=CATEGORIES,
              max_questions: int | None = None) -> list[dict]:
    """The conversation's questions of ``categories`` in file order, each ``{"id",
    "question", "answer", "category", "evidence"}``; ``max_questions`` keeps that many,
    evenly spaced over the file's order (so every category keeps its share)."""
    data = json.loads(Path(conversation).read_text())
    qa = [q for q in data.get("qa", []) if q.get("category") in categories]
    if max_questions and max_questions < len(qa):
        step = len(qa) / max_questions
        qa = [qa[int(i * step)] for i in range(max_questions)]
    return [{"id": i, "question": q["question"], "answer": str(q.get("answer", "")),
             "category": q["category"], "evidence": q.get("evidence", [])}
            for i, q in enumerate(qa)]
