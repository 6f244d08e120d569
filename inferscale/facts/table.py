"""The facts table (``storage_schemas.facts``): one row per fact, whatever made the facts.

- :func:`fact_id`: a fact's stable id, a hash of (user, source turn id, normalized text);
- :func:`facts_table`: the table from (source turn, text) pairs and their embeddings:
  texts whitespace-normalized, token ids ``Composer(tokenizer).fact_ids(text,
  max_tokens)`` (fixed once, stored, reused), empty and repeated facts dropped (the
  first kept). The extractor builds every table with it, from what Mem0 stored;
- :func:`raw_text` and :func:`raw_facts`: the raw fact mode, every turn one fact
  ``"[date] Speaker: text"``. The extractor's raw mode gives Mem0 these texts (no LLM)
  and builds its table from what Mem0 stored; :func:`raw_facts` builds the same table
  without Mem0 (the embeddings from the caller's ``embed``): the same ids, texts and
  token ids, for machines or runs without Mem0 and LanceDB (the benchmarks).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping, Sequence

import pyarrow as pa

from inferscale.compose import Composer, memory_text
from storage_schemas import facts as facts_schema


def fact_id(user: str, source_turn_id: str, text: str) -> str:
    """Stable id of a fact: hash of user, source turn and whitespace/case-normalized text."""
    norm = " ".join(text.split()).casefold()
    return hashlib.sha256("\x1f".join((user, source_turn_id, norm)).encode()).hexdigest()[:32]


def raw_text(turn: Mapping[str, Any]) -> str:
    """A turn (a row of ``storage_schemas.turns``) as the raw fact mode's fact."""
    return memory_text(turn["speaker"], turn["text"], turn["timestamp"])


def facts_table(user: str, facts: Sequence[tuple[Mapping[str, Any], str]],
                embeddings: Any, tokenizer: Any, *,
                max_tokens: int = 256, dims: int | None = None) -> pa.Table:
    """``user``'s facts table: one row per ``(source turn, text)`` of ``facts`` (the turn
    a row of ``storage_schemas.turns``: its ``turn_id`` and ``turn_index`` are the
    source), with the embedding of the same position (``embeddings``: one vector per
    fact, lists or a 2-D array). ``dims``: the embedding size (default: the first
    embedding's; required when ``facts`` is empty)."""
    if len(embeddings) != len(facts):
        raise ValueError(f"{len(facts)} facts but {len(embeddings)} embeddings")
    if dims is None:
        if len(embeddings) == 0:
            raise ValueError("no facts: give the embedding size (dims)")
        dims = len(embeddings[0])
    composer = Composer(tokenizer)
    cols: dict[str, list] = {f.name: [] for f in facts_schema.schema(dims)}
    seen: set[str] = set()
    for (turn, text), vector in zip(facts, embeddings):
        text = " ".join(text.split())
        fid = fact_id(user, turn["turn_id"], text)
        if not text or fid in seen:
            continue
        seen.add(fid)
        cols["fact_id"].append(fid)
        cols["user"].append(user)
        cols["source_turn_id"].append(turn["turn_id"])
        cols["source_index"].append(turn["turn_index"])
        cols["text"].append(text)
        cols["token_ids"].append(composer.fact_ids(text, max_tokens))
        cols["embedding"].append([float(x) for x in vector])
    return pa.table(cols, schema=facts_schema.schema(dims))


def raw_facts(turns: pa.Table, tokenizer: Any, embed: Callable[[list[str]], Any], *,
              max_tokens: int = 256) -> pa.Table:
    """One user's raw-mode facts (module docstring): every turn of ``turns`` (one user's,
    any order: taken by ``turn_index``) one fact; ``embed(texts)`` -> one vector per
    text (rows of a 2-D array or lists)."""
    rows = turns.sort_by("turn_index").to_pylist()
    users = {r["user"] for r in rows}
    if len(users) != 1:
        raise ValueError(f"raw_facts takes one user's turns, got users {sorted(users)}")
    texts = [raw_text(r) for r in rows]
    return facts_table(users.pop(), list(zip(rows, texts)), list(embed(texts)), tokenizer,
                       max_tokens=max_tokens)
