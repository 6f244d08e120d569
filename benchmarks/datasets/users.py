"""Many benchmark users with published artifacts, built from LoCoMo turns, their
questions and how often each one asks (the load benchmark's, ``benchmarks.load``, and
the replicas benchmark's, ``benchmarks.replicas``).

- **Facts.** The turns of every given conversation are pooled in order (conv-26's 419,
  then conv-30's 369: 788). Users come in ``groups`` memory groups: group ``g`` holds
  ``facts`` consecutive pooled turns from turn ``g * len(pool) // groups`` on (wrapping
  around), each turn one fact ``"[date] Speaker: text"`` (the pipeline's raw fact mode:
  :func:`inferscale.facts.table.raw_facts`), embedded with MiniLM.
- **Artifacts.** Every user has an artifact of its own, published into the store
  (version, manifest, facts table). Users of one group hold the same facts, so their KV
  slabs are the same bytes: the group's first user is published by
  :func:`~inferscale.artifacts.publish.publish`, the others by
  :func:`~inferscale.artifacts.publish.publish_linked`, whose KV file
  (``kv.<nonce>.arrow``) is a hard link to the first user's. A machine thus stores
  ``groups`` slabs on disk, not ``users``; the server reads them around the page cache
  (``O_DIRECT``, :mod:`benchmarks.lib.load.storage_bandwidth`), so a user sharing its
  group's file is still read from the disk, never from RAM. In the serving worker every
  user is hydrated into a slab of its own (residency, tiers and budgets count every user).
- **KV.** A real model: every pooled turn some group holds is encoded once with ``w = 0``
  (the fact right after the serving prefix, the default context without a window: it
  depends on nothing else, so one encoding serves every group), then assembled per group.
  The pipeline's default window (20 turns) changes what the KV holds, not its size, so
  not the serving cost this benchmark measures. A dummy-weight shape: random K/V of its
  geometry (generated on the GPU when there is one).
- **Questions.** A user asks LoCoMo questions (categories 1-4) of the conversations its
  facts come from: each next question comes from a conversation picked with the
  probability of its share of the user's facts, cycling through that conversation's
  questions in a shuffled order (:class:`QuestionDeck`).
- **Popularity.** User ``i`` (0-based rank) asks with probability proportional to
  ``(i + 1) ** -zipf`` (``zipf = 0``: every user equally often).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from benchmarks.datasets import locomo
from inferscale.artifacts.layout import StoreConfig
from inferscale.artifacts.publish import Lineage, publish, publish_linked
from inferscale.compose import Composer
from inferscale.encode.capture import EncodedChunk
from inferscale.encode.encoder import EncodedMemory, FactSpec, TurnText, encode_facts
from inferscale.encode.identity import EncoderConfig, EncodingIdentity
from inferscale.facts.table import facts_table, raw_facts
from inferscale.kv_quant import is_quantized, quantize
from inferscale.types import DEFAULT_TEXT_TAIL, PREFIX_ID, KVGeometry


@dataclass
class PooledTurn:
    conversation: int  # index into the conversation files
    turn_id: str
    turn_index: int
    text: str  # the fact: "[date] Speaker: text"
    token_ids: list[int]


@dataclass
class Group:
    """A memory group: the pooled turns its users hold, and its users."""

    index: int
    turns: list[int]  # indexes into the pool
    users: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"group-{self.index:03d}"


def pool_turns(conversations: list[str], tokenizer, embed, max_tokens: int = 256
               ) -> tuple[list[PooledTurn], np.ndarray]:
    """Every turn of every conversation, in order, as its raw-mode fact (``embed(texts)``
    -> their vectors): the pool and its embeddings ``[len(pool), dims]``."""
    pool, vectors = [], []
    for c, path in enumerate(conversations):
        facts = raw_facts(locomo.turns(path), tokenizer, embed, max_tokens=max_tokens)
        for r in facts.to_pylist():
            pool.append(PooledTurn(c, r["source_turn_id"], r["source_index"], r["text"],
                                   r["token_ids"]))
            vectors.append(r["embedding"])
    return pool, np.asarray(vectors, dtype=np.float32)


def make_groups(pool_size: int, groups: int, facts: int, users: int) -> list[Group]:
    """``groups`` windows of ``facts`` pooled turns, users dealt round-robin."""
    if facts > pool_size:
        raise ValueError(f"{facts} facts per user, but the conversations hold {pool_size} turns")
    if not 1 <= groups <= users:
        raise ValueError("need 1 <= groups <= users")
    out = [Group(g, [(g * pool_size // groups + i) % pool_size for i in range(facts)])
           for g in range(groups)]
    for u in range(users):
        out[u % groups].users.append(f"load-{u:04d}")
    return out


def group_facts(group: Group, user: str, pool: list[PooledTurn], embeddings: np.ndarray,
                tokenizer) -> pa.Table:
    """``user``'s facts table: the group's pooled turns in its order, sources
    ``c<conversation>:<turn id>``; fact ids are the group's (the same in every user's)."""
    sources = [{"turn_id": f"c{pool[i].conversation}:{pool[i].turn_id}", "turn_index": n}
               for n, i in enumerate(group.turns)]
    table = facts_table(group.name, [(s, pool[i].text) for s, i in zip(sources, group.turns)],
                        embeddings[group.turns], tokenizer)
    return for_user(table, user)


def for_user(table: pa.Table, user: str) -> pa.Table:
    """The same facts table with ``user`` in its user column."""
    at = table.schema.get_field_index("user")
    return table.set_column(at, table.schema.field(at),
                            pa.array([user] * table.num_rows, table.schema.field(at).type))


def encode_pool(model, tokenizer, pool: list[PooledTurn], groups: list[Group],
                fingerprint: str, dtype: str, text_tail: int = DEFAULT_TEXT_TAIL
                ) -> EncodedMemory:
    """Every pooled turn some group holds, encoded once at ``w = 0`` (chunk id ``p<i>``
    for pool index ``i``), and the prefix; ``text_tail``: the served layout's text tail,
    kept with the artifact (it does not change the encoding)."""
    cfg = EncoderConfig(window=0, dtype=dtype, text_tail=text_tail)
    turns = [TurnText("", t.text) for t in pool]
    used = sorted({i for g in groups for i in g.turns})
    specs = [FactSpec(f"p{i}", pool[i].text, i, tuple(pool[i].token_ids)) for i in used]
    return encode_facts(model, tokenizer, turns, specs,
                        EncodingIdentity.of_model(cfg, fingerprint, model), progress=True)


def group_memory(group: Group, fact_ids: list[str], encoded: EncodedMemory | None,
                 tokenizer, pool: list[PooledTurn], fingerprint: str,
                 shape: tuple[int, int, int] | None = None, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0, text_tail: int = DEFAULT_TEXT_TAIL) -> EncodedMemory:
    """The group's memory: its turns' chunks from ``encoded`` (the pool encoding), or
    random K/V ``[L, T, H, D]`` of ``shape`` when ``encoded`` is None, stored as ``dtype``
    (``torch.float8_e4m3fn``: drawn in bfloat16, each chunk quantized with its scales as
    the encoder quantizes, :func:`inferscale.kv_quant.quantize`)."""
    if encoded is not None:
        by_id = {c.chunk_id: c for c in encoded.chunks}
        chunks = [by_id[PREFIX_ID]] + [
            EncodedChunk(fid, by_id[f"p{i}"].token_ids, by_id[f"p{i}"].kv,
                         scales=by_id[f"p{i}"].scales)
            for fid, i in zip(fact_ids, group.turns)]
        return EncodedMemory(chunks, fingerprint, dict(encoded.encoder_config),
                             geometry=encoded.geometry)
    L, H, D = shape
    ids = [(PREFIX_ID, Composer(tokenizer).prefix_ids())]
    ids += [(fid, pool[i].token_ids) for fid, i in zip(fact_ids, group.turns)]
    total = sum(len(t) for _, t in ids)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(seed + group.index)
    quantized = is_quantized(dtype)
    kv = torch.randn((2, L, total, H, D), generator=g, device=device,
                     dtype=torch.bfloat16 if quantized else dtype).cpu()
    kv = kv.permute(2, 0, 1, 3, 4)  # [T, 2, L, H, D] (a view)
    chunks, at = [], 0
    for cid, t in ids:
        rows, scales = kv[at:at + len(t)], None
        if quantized:
            rows, scales = quantize(rows)  # [T, 2, L, H, D] fp8, [2, L, H]
        chunks.append(EncodedChunk(cid, list(t), rows, scales=scales))
        at += len(t)
    cfg = EncoderConfig(window=0, dtype=str(dtype).removeprefix("torch."),
                        text_tail=text_tail).to_dict()
    return EncodedMemory(chunks, fingerprint, {**cfg, "random_kv": True},
                         geometry=KVGeometry(L, H, D))


def publish_users(store: StoreConfig, groups: list[Group], pool: list[PooledTurn],
                  embeddings: np.ndarray, tokenizer, memory_of, progress=print
                  ) -> dict[str, dict]:
    """Publish every user of every group (``memory_of(group, fact_ids)`` -> the group's
    :class:`EncodedMemory`) -> user -> ``{"version", "slab_bytes"}``."""
    versions: dict[str, dict] = {}
    for group in groups:
        first, *others = group.users
        table = group_facts(group, first, pool, embeddings, tokenizer)
        fids = table.column("fact_id").to_pylist()
        lineage = Lineage(f"locomo-pool-{len(pool)}", f"{group.name}-{len(fids)}")
        res = publish(store, first, memory_of(group, fids), table, lineage, embeddings=False)
        size = res.manifest.kv["slab_bytes"]
        versions[first] = {"version": res.version, "slab_bytes": size}
        for user in others:  # the group's table with the user's name
            versions[user] = {"version": publish_linked(
                store, user, res.manifest, for_user(table, user), lineage).version,
                "slab_bytes": size}
        progress(f"published {group.name}: {len(group.users)} users, "
                 f"{res.manifest.kv['slab_bytes'] / 2**30:.2f} GiB of KV each")
    return versions


class QuestionDeck:
    """A user's questions: each next one from a conversation picked with the share of the
    user's facts it holds, cycling through that conversation's questions (shuffled)."""

    def __init__(self, questions: dict[int, list[str]], shares: dict[int, float], seed: int):
        self.rng = random.Random(seed)
        self.convs = [c for c in shares if questions.get(c)]
        if not self.convs:
            raise ValueError("no questions for this user's conversations")
        self.weights = [shares[c] for c in self.convs]
        self.decks = {c: self.rng.sample(questions[c], len(questions[c])) for c in self.convs}
        self.at = dict.fromkeys(self.convs, 0)

    def next(self) -> str:
        c = self.rng.choices(self.convs, self.weights)[0]
        q = self.decks[c][self.at[c] % len(self.decks[c])]
        self.at[c] += 1
        return q


def locomo_questions(conversations: list[str]) -> dict[int, list[str]]:
    """Questions of categories 1-4 per conversation index."""
    return {c: [q["question"] for q in locomo.questions(path)]
            for c, path in enumerate(conversations)}


def shares(group: Group, pool: list[PooledTurn]) -> dict[int, float]:
    counts: dict[int, int] = {}
    for i in group.turns:
        counts[pool[i].conversation] = counts.get(pool[i].conversation, 0) + 1
    return {c: n / len(group.turns) for c, n in counts.items()}


def popularity(users: int, zipf: float) -> np.ndarray:
    """Request probability of each user rank: ``(rank + 1) ** -zipf``, normalized."""
    w = np.arange(1, users + 1, dtype=np.float64) ** -zipf
    return w / w.sum()
