"""Answer scoring for LoCoMo: the authors' token F1, per category, and an optional LLM judge.

The F1 follows the definition of the LoCoMo paper and its evaluation code
(Maharana et al., 2024): normalize both strings (drop commas, lowercase, strip
punctuation, remove the words ``a an the and``, squeeze whitespace), Porter-stem every
token (nltk's ``PorterStemmer``), then the harmonic mean of token precision and recall
over the multiset overlap. Per category, as the authors score it:

- 1 multi-hop: reference and prediction are split on commas; every reference part takes
  its best-matching prediction part, and the scores are averaged;
- 2 temporal, 4 single-hop: plain token F1 (temporal answers are dates, compared as
  tokens: "7 May 2023" and "2023-05-07" share no token);
- 3 open-domain: token F1 against the reference's first ``;``-separated alternative.

Category 5 (adversarial) is not scored here (left out of accuracy tables).

:func:`judge` asks any OpenAI-compatible endpoint whether an answer is correct (the
"LLM-as-a-judge" score Mem0's LoCoMo evaluation reports); off unless configured.

Callers: ``benchmarks.lib.locomo_report`` (scores), ``benchmarks.equivalence``
(normalized text).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Mapping, Sequence

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
_ARTICLES = re.compile(r"\b(a|an|the|and)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """LoCoMo's normalization: no commas, lowercase, no punctuation, no a/an/the/and."""
    text = str(text).replace(",", "").lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


@lru_cache(maxsize=1)
def _stemmer():
    from nltk.stem import PorterStemmer  # pure Python; needs no nltk data download

    return PorterStemmer()


def answer_tokens(text: str) -> list[str]:
    stem = _stemmer().stem
    return [stem(w) for w in normalize_answer(text).split()]


def token_f1(prediction: str, reference: str) -> float:
    """Token-overlap F1 of the stemmed, normalized strings (0 when nothing overlaps)."""
    pred, ref = answer_tokens(prediction), answer_tokens(reference)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def multi_answer_f1(prediction: str, reference: str) -> float:
    """Multi-hop F1: mean over the reference's comma-separated parts of the best part of
    the prediction."""
    preds = [p.strip() for p in str(prediction).split(",")]
    refs = [r.strip() for r in str(reference).split(",")]
    return sum(max(token_f1(p, r) for p in preds) for r in refs) / len(refs)


def locomo_f1(prediction: str, reference: object, category: int) -> float:
    """The score LoCoMo gives ``prediction`` for a question of ``category`` (1-4)."""
    reference = str(reference)
    if category == 1:
        return multi_answer_f1(prediction, reference)
    if category == 3:
        reference = reference.split(";")[0].strip()
    if category in (2, 3, 4):
        return token_f1(prediction, reference)
    raise ValueError(f"category {category} is not scored by F1 (1-4 only)")


def summarize(scores: Iterable[tuple[int, float]]) -> dict:
    """(category, score) pairs -> ``{"overall", "n", "by_category": {name: {mean, n}}}``."""
    by: dict[int, list[float]] = {}
    for cat, s in scores:
        by.setdefault(cat, []).append(s)
    allv = [s for v in by.values() for s in v]
    return {
        "overall": round(sum(allv) / len(allv), 4) if allv else None, "n": len(allv),
        "by_category": {CATEGORIES.get(c, str(c)): {"mean": round(sum(v) / len(v), 4),
                                                     "n": len(v)}
                        for c, v in sorted(by.items())},
    }


def first_line(text: str) -> str:
    """The answer as scored: the generation's first non-empty line, stripped."""
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


_MEMORY_LINE = re.compile(r"^\s*([-*]\s|\[|\d+\.\s)")


def continues_transcript(text: str, speakers: Iterable[str]) -> bool:
    """Whether a generation continues the memory/transcript instead of answering: it
    begins like a memory or list line (``- ...``, ``[2023-...``, ``1. ...``) or with a
    speaker label of the conversation (``Caroline:``). A bare date is an answer."""
    head = str(text).lstrip()
    if _MEMORY_LINE.match(head):
        return True
    return any(re.match(rf"{re.escape(s)}\s*:", head) for s in speakers if s)


def paired_bootstrap(a: Sequence[float], b: Sequence[float], n: int = 4000,
                     seed: int = 0) -> dict:
    """Mean of ``a - b`` over paired items and its 95% percentile-bootstrap interval."""
    import numpy as np

    if len(a) != len(b) or not len(a):
        raise ValueError("paired_bootstrap needs two equally long, non-empty sequences")
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, len(d), size=(n, len(d)))
    lo, hi = np.percentile(d[idx].mean(axis=1), [2.5, 97.5])
    return {"mean": round(float(d.mean()), 4), "lo": round(float(lo), 4),
            "hi": round(float(hi), 4), "n": int(len(d))}


# ---------------------------------------------------------------------- LLM judge


@dataclass(frozen=True)
class JudgeConfig:
    """An OpenAI-compatible chat endpoint that grades answers (CORRECT / WRONG)."""

    base_url: str
    model: str
    api_key: str = "EMPTY"
    timeout_s: float = 60.0


JUDGE_PROMPT = (
    "You grade answers to questions about a long conversation.\n"
    "Question: {question}\nGold answer: {reference}\nGenerated answer: {prediction}\n"
    "Be generous: the generated answer is CORRECT if it refers to the same thing as the "
    "gold answer (same date or period for time questions), even if worded differently "
    "or longer. Reply with one word: CORRECT or WRONG."
)


def judge(items: Iterable[Mapping], cfg: JudgeConfig, concurrency: int = 8) -> list[int | None]:
    """1 (correct), 0 (wrong) or None (no verdict) per item of ``question``, ``reference``,
    ``prediction``; requests run ``concurrency`` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    client = OpenAI(base_url=cfg.base_url, api_key=cfg.api_key, timeout=cfg.timeout_s)

    def one(item: Mapping) -> int | None:
        prompt = JUDGE_PROMPT.format(question=item["question"], reference=item["reference"],
                                     prediction=item["prediction"])
        try:
            out = client.chat.completions.create(
                model=cfg.model, temperature=0.0, max_tokens=4,
                messages=[{"role": "user", "content": prompt}])
        except Exception:  # noqa: BLE001 - an unreachable judge gives no verdict
            return None
        verdict = (out.choices[0].message.content or "").strip().upper()
        return 1 if verdict.startswith("CORRECT") else 0 if verdict.startswith("WRONG") else None

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, list(items)))
