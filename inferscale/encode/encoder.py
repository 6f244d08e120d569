"""Context-window encoder: facts -> relocatable pre-RoPE KV.

A fact extracted from turn ``t`` is encoded in one forward pass over a context and then
the fact's tokens; only the fact's K and V are kept, for every layer. The context
(``EncoderConfig.context``) is, by default (``"memory"``), the serving prefix
(chat-template head + instruction, at positions 0..P-1, so every fact shares the serving
attention sink) followed by the ``w`` turns before ``t`` written as memory lines
(``- [date] Speaker: text``), exactly as the served memory list writes facts: the encoding
context looks like the serving context. ``"transcript"`` (the original encoder) writes
the window as raw transcript with nothing before it; ``"prefix"`` puts the serving prefix
before a raw window. With raw-turn facts and a window reaching back to the first turn,
``"memory"`` is exactly the joint prefill of the chronological memory list.

K is exactly the tensor that enters the model's ``apply_rotary_pos_emb`` (after ``k_norm``
where the architecture has one, e.g. Qwen3); V is the tensor that enters the attention
function, exactly what a KV cache would store. ``key_temperature`` != 1 divides the
stored fact keys (breaking the limiting case's exactness); ``key_calibration`` divides
them by temperatures fitted on the user's own facts (:mod:`inferscale.encode.calibration`,
off by default). The layout fields (``memory_order``, ``text_tail``, ``tail_max_k``) are
composer settings the artifact carries (:func:`inferscale.compose.memory_layout`); they
change the encoding only through the calibration's probes.

Batch invariance and reuse (``EncoderConfig.batch_invariant``, the default): every fact
gets an unpadded forward pass of its own, ``[context | fact]``, so its K/V bits depend
only on its content key's inputs (:mod:`inferscale.encode.content_keys`); given a previous
version's rows by key (``reuse``), :func:`encode_facts` takes every fact whose key is
there and encodes only the rest, byte-identical to encoding everything. With
``batch_invariant=False`` facts are packed into padded batches and facts of one turn
share a pass ``[window | fact_1 | fact_2 | ...]`` with a block mask (positions restarting
at ``len(window)``); such chunks get no content key and are never reused.

The general form is :func:`inferscale.encode.capture.encode_segments`: any context token
ids followed by chunks (:class:`~inferscale.encode.batches.Segment`; batching and the
block mask are :mod:`inferscale.encode.batches`).
The window form (:func:`encode_facts`) builds contexts from turns; :func:`encode_limiting`
the "limiting case" (each fact's context = the whole memory before it), the reference
injection must reproduce; :meth:`EncodedMemory.stored_as` stores one encoding in another
dtype.
The output (:class:`EncodedMemory`: each chunk's token-major rows ``[T, 2, L, H, D]``,
the layout ``kv.arrow`` stores) goes to :func:`inferscale.artifacts.publish.publish`.

Edge cases (stated): ``w = 0`` encodes the fact after the serving prefix (``"memory"``,
``"prefix"``) or alone at positions ``0..len-1`` (``"transcript"``); windows stop at the
start of the conversation; a window longer than ``max_window_tokens`` keeps its most
recent tokens (the prefix is always kept); a longer fact than ``max_fact_tokens`` is
truncated to its first ``max_fact_tokens`` tokens (:meth:`Composer.fact_ids`); an empty fact is a
:class:`~inferscale.compose.ComposeError`.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import torch

from inferscale.compose import Composer, memory_text
from inferscale.encode.batches import Segment
from inferscale.encode.calibration import KeyCalibration, calibrate, choose_probes
from inferscale.encode.capture import EncodedChunk, encode_segments, kv_shape, prefill_qk
from inferscale.encode.content_keys import content_key, key_identity, matching_rows
from inferscale.encode.identity import EncodeError, EncoderConfig, EncodingIdentity
from inferscale.kv_quant import is_quantized, quantize
from inferscale.types import PREFIX_ID, ChunkKV, KVGeometry

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class TurnText:
    """One conversation turn as the window sees it (``timestamp``: ISO, or None)."""

    speaker: str
    text: str
    timestamp: str | None = None


@dataclass(frozen=True)
class FactSpec:
    """A fact to encode: its id, text, the index of its source turn and, when the facts
    table already fixed them, its token ids (used as is, never re-tokenized)."""

    fact_id: str
    text: str
    source_index: int
    token_ids: tuple[int, ...] | None = None


@dataclass
class EncodedMemory:
    """Encoder output for one user: chunk 0 is the instruction prefix."""

    chunks: list[EncodedChunk]
    model_fingerprint: str
    encoder_config: dict
    stats: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)  # KeyCalibration.record(), when on
    # the KV geometry of the model that computed the chunks (publishing checks them
    # against it); None where no model said (results cached before it was recorded)
    geometry: KVGeometry | None = None

    def stored_as(self, dtype: str) -> "EncodedMemory":
        """This encoding (float K/V) stored in ``dtype`` instead, as the encoder stores
        that dtype: converted, or quantized per chunk for fp8 (captured in a float dtype,
        then quantized), the encoder config's ``dtype`` saying so. One encoding, several
        storage formats. Content keys are dropped: they name the stored dtype too."""
        chunks = []
        for c in self.chunks:
            if c.scales is not None:
                raise ValueError("stored_as converts float encodings only")
            if is_quantized(dtype):
                kv, scales = quantize(c.kv)  # [T, 2, L, H, D] fp8, [2, L, H]
            else:
                kv, scales = c.kv.to(getattr(torch, dtype)), None
            chunks.append(EncodedChunk(c.chunk_id, c.token_ids, kv, scales=scales))
        return EncodedMemory(chunks, self.model_fingerprint,
                             {**self.encoder_config, "dtype": dtype}, self.stats,
                             self.calibration, self.geometry)


# ------------------------------------------------------------------ the window form


def window_segments(turns: Sequence[TurnText], facts: Sequence[FactSpec], composer: Composer,
                    cfg: EncoderConfig) -> list[Segment]:
    """Segments for ``facts``: each fact's context then the fact, one segment per fact in
    the order given (``cfg.batch_invariant``), or one per source turn holding all its
    facts, in turn order (otherwise).

    The context is ``cfg.context``'s: the window's turns as transcript, or the serving
    prefix followed by the window's turns as memory lines (or as transcript). A window
    longer than ``max_window_tokens`` loses its oldest tokens; the prefix is always kept.
    """
    by_turn: dict[int, list[FactSpec]] = {}
    seen: set[str] = set()
    for fact in facts:
        if not 0 <= fact.source_index < len(turns):
            raise EncodeError(f"fact {fact.fact_id}: source turn {fact.source_index} is outside "
                              f"the conversation (0..{len(turns) - 1})")
        if fact.fact_id in seen or fact.fact_id == PREFIX_ID:
            raise EncodeError(f"duplicate or reserved fact id {fact.fact_id!r}")
        seen.add(fact.fact_id)
        by_turn.setdefault(fact.source_index, []).append(fact)
    turn_ids: dict[int, list[int]] = {}
    as_memory = cfg.context == "memory"

    def turn_tokens(i: int) -> list[int]:
        if i not in turn_ids:
            t = turns[i]
            if as_memory:
                turn_ids[i] = composer.fact_ids(memory_text(t.speaker, t.text, t.timestamp),
                                                cfg.max_fact_tokens)
            else:
                turn_ids[i] = composer._encode(cfg.turn_template.format(speaker=t.speaker,
                                                                        text=t.text))
        return turn_ids[i]

    head = composer.prefix_ids() if cfg.context in ("memory", "prefix") else []
    contexts: dict[int, tuple[int, ...]] = {}
    for t in by_turn:
        window = [tok for i in range(max(0, t - cfg.window), t) for tok in turn_tokens(i)]
        if len(window) > cfg.max_window_tokens:
            window = window[len(window) - cfg.max_window_tokens:]
        contexts[t] = tuple(head + window)

    def chunk(f: FactSpec) -> tuple[str, tuple[int, ...]]:
        return (f.fact_id, tuple(f.token_ids) if f.token_ids
                else tuple(composer.fact_ids(f.text, cfg.max_fact_tokens)))

    if cfg.batch_invariant:
        return [Segment(contexts[f.source_index], (chunk(f),)) for f in facts]
    return [Segment(contexts[t], tuple(chunk(f) for f in group))
            for t, group in sorted(by_turn.items())]


def encode_facts(model: torch.nn.Module, tokenizer: Any, turns: Sequence[TurnText],
                 facts: Sequence[FactSpec], identity: EncodingIdentity, progress: bool = True,
                 reuse: Mapping[str, ChunkKV] | None = None) -> EncodedMemory:
    """Encode the instruction prefix and every fact with its window of preceding turns,
    as ``identity`` says (:class:`EncodeError` when ``model`` does not compute in its
    dtype and device kind); the output records ``identity``.

    ``reuse``: the stored rows of a previous version by content key
    (:func:`inferscale.artifacts.read.read_kv_rows`); a chunk whose key is there is
    taken from it (no forward pass), the others encoded;
    ignored unless ``batch_invariant``. Returns chunks in order: the prefix first,
    then facts in the order given; ``stats`` count facts ``reused`` and ``encoded`` and
    the ``forward_tokens`` actually run.

    A quantized stored dtype (``float8_e4m3fn``) captures K/V in the model's compute dtype
    and quantizes each chunk after the key temperature (:func:`inferscale.kv_quant.quantize`:
    the same bits as quantizing that dtype's artifact).
    """
    from tqdm.auto import tqdm

    identity.check_model(model)
    cfg = identity.encoder
    composer = Composer(tokenizer, cfg.instruction)
    prefix = Segment((), ((PREFIX_ID, tuple(composer.prefix_ids())),))
    segments = [prefix] + window_segments(turns, facts, composer, cfg)
    keys: dict[str, str] = {}
    chunks: dict[str, EncodedChunk] = {}
    quantized = is_quantized(cfg.dtype)  # captured in the compute dtype, quantized last
    out_dtype = next(model.parameters()).dtype if quantized else cfg.torch_dtype
    t0 = time.perf_counter()
    calibration, probed = (_calibrate(model, composer, turns, facts, cfg, out_dtype)
                           if cfg.key_calibration != "none" else (None, {}))
    calibration_s = time.perf_counter() - t0
    fresh: list[EncodedChunk] = []  # encoded unscaled for the calibration: not again
    todo = segments
    if cfg.batch_invariant:
        key_ident = key_identity(identity, model, calibration and calibration.digest())
        geometry = kv_shape(model)
        todo = []
        for seg in segments:
            ((chunk_id, ids),) = seg.chunks
            keys[chunk_id] = key = content_key(key_ident, seg.context, ids)
            hit = matching_rows(chunk_id, (reuse or {}).get(key),
                                (len(ids), 2, *geometry), cfg.torch_dtype)
            if chunk_id in probed:
                fresh.append(probed[chunk_id])
            elif hit is not None:
                chunks[chunk_id] = EncodedChunk(chunk_id, list(ids), hit.kv, content_key=key,
                                                scales=hit.scales)
            else:
                todo.append(seg)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    bar = tqdm(total=sum(len(s.chunks) for s in todo), desc="encoding facts", unit="fact",
               disable=not progress)
    for c in itertools.chain(fresh, encode_segments(
            model, todo, out_dtype=out_dtype, pad_id=pad_id, progress=bar,
            batch_tokens=None if cfg.batch_invariant else cfg.batch_tokens)):
        keys_of = c.kv[:, 0]  # [T, L, H, D]: divided in place (the chunk's own rows)
        if cfg.key_temperature != 1.0 and c.chunk_id != PREFIX_ID:  # reused rows are scaled
            keys_of.copy_((keys_of.float() / cfg.key_temperature).to(keys_of.dtype))
        elif calibration is not None and c.chunk_id != PREFIX_ID:
            keys_of.copy_(calibration.apply(keys_of))
        if quantized:
            c.kv, c.scales = quantize(c.kv)
        c.content_key = keys.get(c.chunk_id)
        chunks[c.chunk_id] = c
    bar.close()
    ordered = [chunks[PREFIX_ID]] + [chunks[f.fact_id] for f in facts]
    ran = {cid for s in todo for cid, _ in s.chunks} | {c.chunk_id for c in fresh}
    n_encoded = len(ran - {PREFIX_ID})
    stats = {
        "facts": len(facts), "fact_tokens": sum(len(c.token_ids) for c in ordered[1:]),
        "forward_tokens": sum(s.length for s in todo), "encoded": n_encoded,
        "reused": len(facts) - n_encoded, "prefix_reused": PREFIX_ID not in ran,
    }
    if calibration is not None:
        stats.update(calibration_seconds=round(calibration_s, 2), calibration_facts=len(probed),
                     **{f"calibration_{k}": v for k, v in calibration.stats.items()})
    if reuse is not None and cfg.batch_invariant:
        log.info("encoded %d facts, reused %d of the previous version's %d keyed chunks",
                 stats["encoded"], stats["reused"], len(reuse))
    return EncodedMemory(ordered, identity.model_fingerprint, identity.record(), stats,
                         calibration.record() if calibration is not None else {},
                         kv_shape(model))


def encode_limiting(model: torch.nn.Module, prefix: Sequence[int],
                    facts: Sequence[tuple[str, Sequence[int]]], model_fingerprint: str,
                    dtype: torch.dtype = torch.float32) -> EncodedMemory:
    """The limiting case: the prefix (chunk :data:`~inferscale.types.PREFIX_ID`), then
    every fact ``(fact id, token ids)`` encoded with the prefix and all the facts before
    it as its context, in the order given: exactly the K/V of one prefill of the whole
    memory list. Injected in that order it must reproduce that prefill token for token
    in float32: the reference the connector's tests and the equivalence benchmark check
    injection against. ``dtype``: the K/V's (and the config's) dtype."""
    segments = [Segment((), ((PREFIX_ID, tuple(prefix)),))]
    before = list(prefix)
    for fid, ids in facts:
        segments.append(Segment(tuple(before), ((fid, tuple(ids)),)))
        before += ids
    chunks = {c.chunk_id: c for c in encode_segments(model, segments, out_dtype=dtype,
                                                     batch_tokens=8192)}
    return EncodedMemory([chunks[PREFIX_ID]] + [chunks[fid] for fid, _ in facts],
                         model_fingerprint, {"limiting_case": True, "dtype": str(dtype)},
                         geometry=kv_shape(model))


def _calibrate(model: torch.nn.Module, composer: Composer, turns: Sequence[TurnText],
               facts: Sequence[FactSpec], cfg: EncoderConfig, out_dtype: torch.dtype
               ) -> tuple[KeyCalibration, dict[str, EncodedChunk]]:
    """``cfg.key_calibration``'s temperatures for this memory, and the unscaled chunks of
    the facts its probes inject (each encoded alone, as ``batch_invariant`` does)."""
    ids = {f.fact_id: tuple(f.token_ids) if f.token_ids
           else tuple(composer.fact_ids(f.text, cfg.max_fact_tokens)) for f in facts}
    probes = choose_probes([f.fact_id for f in facts], ids,
                           {f.fact_id: f.source_index for f in facts}, cfg)
    if not probes:  # too little memory to probe: nothing to correct
        L, H, _ = kv_shape(model)
        return KeyCalibration(cfg.key_calibration, [[1.0] * H for _ in range(L)],
                              {"probes": 0}), {}
    used = {f for p in probes for f in p.injected}
    segs = window_segments(turns, [f for f in facts if f.fact_id in used], composer,
                           replace(cfg, batch_invariant=True))
    probed = {c.chunk_id: c for c in encode_segments(model, segs, out_dtype=out_dtype,
                                                     batch_tokens=None)}
    return calibrate(model, composer, probes, ids, {f.fact_id: f.text for f in facts},
                     {f: c.kv[:, 0] for f, c in probed.items()}, cfg.key_calibration,
                     lambda x, rows_from: prefill_qk(model, x, rows_from)), probed

