"""What a run is: the encoder config, and the one identity every decision derives from.

:class:`EncoderConfig` is how facts are encoded (window, context, stored dtype...).
:class:`EncodingIdentity` is everything besides a user's turns and facts that decides
the bytes of their encoded KV: that config, the model fingerprint, and the dtype and
device kind the model computes in (bf16 on CUDA rounds differently from float32 on
CPU). :class:`RunIdentity` adds what decides the facts themselves (the facts config's
:meth:`~inferscale.facts.extractor.FactsConfig.identity`: fact mode, embedder, limits,
the extraction LLM): everything besides a user's turns that decides a published version.
From it alone come

- the run's record (:meth:`RunIdentity.record`): stored in every manifest as
  ``encoder_config`` (the encoder's record, :meth:`EncodingIdentity.record`, and the
  facts config under ``facts``) and hashed into the version id
  (:func:`inferscale.artifacts.publish.version_id`), so the version a run expects and
  the version it publishes are one computation;
- the staleness decision (:meth:`RunIdentity.changed_settings`: the encoder settings
  and the facts config; KV computed on another device is as current), so the nightly
  and backfill flows re-encode a user after a ``fact_mode`` change as ``inferscale
  encode`` does;
- the task cache keys: of the facts step its facts part, of the KV step its encoding
  part (:meth:`EncodingIdentity.to_dict`; the facts enter that key through their
  content hash);
- the content keys of reusable facts (:func:`inferscale.encode.content_keys.key_identity`,
  which adds the exact numerics of the model that runs).

Serving reads a version's layout settings from its record with :func:`served_layout`,
with the same values for fields an older record lacks as staleness uses.

The encoder checks that the model it is given computes in the identity's dtype and
device kind (:meth:`EncodingIdentity.check_model`), so a version can never be recorded
under another identity than the one its bytes come from.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

from inferscale.compose import DEFAULT_INSTRUCTION, ComposeError
from inferscale.types import (
    DEFAULT_CONTEXT, DEFAULT_KEY_CALIBRATION, DEFAULT_MEMORY_ORDER, DEFAULT_TAIL_MAX_K,
    DEFAULT_TEXT_TAIL, DEFAULT_WINDOW, ENCODER_CONTEXTS, KEY_CALIBRATIONS, KV_DTYPES,
    MEMORY_ORDERS, torch_dtype)

if TYPE_CHECKING:
    from inferscale.facts.extractor import FactsConfig

# Fields added after versions were published, and the value a record without one
# implicitly has (how such versions were encoded and are served): staleness compares a
# record's missing field with it, and serving reads it (served_layout).
_IMPLICIT = {"memory_order": "relevance", "text_tail": 0, "key_calibration": "none",
             "tail_max_k": 0}
# Of those, the ones left out of the record (manifest, version id, content keys) at
# their implicit value, so a version published before them keeps its id and stays
# current; any other value is recorded and compared like every field.
_OMITTED_AT_IMPLICIT = ("key_calibration", "tail_max_k")
# The key of the facts config in a run's record.
FACTS_RECORD = "facts"


class EncodeError(ValueError):
    """Bad encoder input or a model the encoder cannot capture K/V from."""


@dataclass(frozen=True)
class EncoderConfig:
    """How facts are encoded; part of an artifact's identity (its version hash)."""

    window: int = DEFAULT_WINDOW
    dtype: str = "bfloat16"  # stored K/V dtype; compute happens in the model's dtype
    max_fact_tokens: int = 256
    max_window_tokens: int = 4096
    batch_tokens: int = 16384  # padded tokens per forward pass (batch_invariant=False)
    instruction: str = DEFAULT_INSTRUCTION
    turn_template: str = "{speaker}: {text}\n"
    # What each fact is encoded after (inferscale.encode.encoder): "memory" (serving
    # prefix, then the window as memory lines), "transcript" (the raw window,
    # ``turn_template``, alone), "prefix" (serving prefix, then the raw window).
    context: str = DEFAULT_CONTEXT
    # Stored keys of facts are divided by this (1.0 = exact); the prefix is never scaled.
    key_temperature: float = 1.0
    # Per-layer ("layer") or per-layer-and-KV-head ("head") temperatures computed from the
    # user's own memory at encode time (inferscale.encode.calibration); "none": off (exact).
    key_calibration: str = DEFAULT_KEY_CALIBRATION
    # How the server lays out a request's memory (composer settings kept with the artifact):
    # ``memory_order`` of the injected facts ("relevance": best first; "relevance_last":
    # best last; "chronological": by source turn), and ``text_tail``: the m most relevant
    # facts are prefilled as text right before the question instead of injected.
    memory_order: str = DEFAULT_MEMORY_ORDER
    text_tail: int = DEFAULT_TEXT_TAIL
    # The tail only where memory is short: used when at most this many facts are retrieved
    # (0: at every k); above it every retrieved fact is injected.
    tail_max_k: int = DEFAULT_TAIL_MAX_K
    batch_invariant: bool = True  # one pass per fact: content keys, reuse

    def __post_init__(self) -> None:
        if self.context not in ENCODER_CONTEXTS:
            raise EncodeError(f"context must be one of {ENCODER_CONTEXTS}, "
                              f"got {self.context!r}")
        if not self.key_temperature > 0:
            raise EncodeError(f"key_temperature must be > 0, got {self.key_temperature}")
        if self.memory_order not in MEMORY_ORDERS:
            raise EncodeError(f"memory_order must be one of {MEMORY_ORDERS}, "
                              f"got {self.memory_order!r}")
        if self.text_tail < 0:
            raise EncodeError(f"text_tail must be >= 0, got {self.text_tail}")
        if self.tail_max_k < 0:
            raise EncodeError(f"tail_max_k must be >= 0, got {self.tail_max_k}")
        if self.key_calibration not in KEY_CALIBRATIONS:
            raise EncodeError(f"key_calibration must be one of {KEY_CALIBRATIONS}, "
                              f"got {self.key_calibration!r}")
        if self.key_calibration != "none" and self.key_temperature != 1.0:
            raise EncodeError("key_calibration computes the key temperatures: "
                              "key_temperature must stay 1.0 with it")
        if self.window < 0:
            raise EncodeError(f"window must be >= 0, got {self.window}")
        if self.dtype not in KV_DTYPES:
            raise EncodeError(f"dtype must be one of {sorted(KV_DTYPES)}, got {self.dtype!r}")
        if self.max_fact_tokens < 1 or self.max_window_tokens < 0:
            raise EncodeError("max_fact_tokens must be >= 1 and max_window_tokens >= 0")
        if self.batch_tokens < self.max_fact_tokens:
            raise EncodeError("batch_tokens must hold at least one fact")

    @property
    def torch_dtype(self) -> Any:
        return torch_dtype(self.dtype)

    def to_dict(self) -> dict:
        """Every field, except the later ones at their implicit value
        (:data:`_OMITTED_AT_IMPLICIT`)."""
        return {k: v for k, v in asdict(self).items()
                if not (k in _OMITTED_AT_IMPLICIT and v == _IMPLICIT[k])}


@dataclass(frozen=True)
class EncodingIdentity:
    """The encoder config, the model fingerprint and the compute dtype and device kind
    (``"cuda:1"`` is kept as ``"cuda"``: which GPU does not change the bits)."""

    encoder: EncoderConfig
    model_fingerprint: str
    compute_dtype: str
    compute_device: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "compute_dtype",
                           str(self.compute_dtype).removeprefix("torch."))
        object.__setattr__(self, "compute_device", str(self.compute_device).split(":")[0])
        if not self.model_fingerprint:
            raise EncodeError("an encoding identity needs the model fingerprint")

    @classmethod
    def of_model(cls, encoder: EncoderConfig, model_fingerprint: str,
                 model: Any) -> "EncodingIdentity":
        """The identity of encoding with ``model`` as it is loaded (its parameters' dtype
        and device)."""
        p = next(model.parameters())
        return cls(encoder, model_fingerprint, str(p.dtype), p.device.type)

    def record(self) -> dict:
        """The encoder config plus the compute dtype and device kind: what the manifest
        records as ``encoder_config`` and the version id hashes."""
        return {**self.encoder.to_dict(), "compute_dtype": self.compute_dtype,
                "compute_device": self.compute_device}

    def to_dict(self) -> dict:
        """Everything in the identity (a cache key's part)."""
        return {"encoding": self.record(), "model": self.model_fingerprint}

    def changed_settings(self, recorded: Mapping[str, Any]) -> list[str]:
        """The encoder settings in which a version's recorded ``encoder_config`` differs
        from this identity's (the compute dtype and device are not compared). A field a
        record lacks has its implicit value (:data:`_IMPLICIT`), so a calibrated or per-k
        config is a change against every version recorded without one, and back."""
        mine = asdict(self.encoder)
        return sorted(k for k in mine if recorded.get(k, _IMPLICIT.get(k)) != mine[k])

    def check_model(self, model: Any, fingerprint: str | None = None) -> None:
        """:class:`EncodeError` unless ``model`` computes in this identity's dtype and
        device kind (and, when given, has this identity's fingerprint)."""
        actual = EncodingIdentity.of_model(self.encoder, fingerprint or self.model_fingerprint,
                                           model)
        if actual != self:
            raise EncodeError(
                f"the model computes in {actual.compute_dtype} on {actual.compute_device} "
                f"(fingerprint {actual.model_fingerprint}), not in {self.compute_dtype} on "
                f"{self.compute_device} (fingerprint {self.model_fingerprint}) as planned")


@dataclass(frozen=True)
class RunIdentity:
    """Everything besides a user's turns that decides a published version: ``facts``,
    the facts config's identity (:meth:`~inferscale.facts.extractor.FactsConfig.identity`,
    as JSON), and the ``encoding`` identity."""

    facts: dict[str, Any]
    encoding: EncodingIdentity

    def __post_init__(self) -> None:
        try:  # as a manifest stores it, so a record read back compares equal
            canonical = json.loads(json.dumps(dict(self.facts), sort_keys=True,
                                              allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise EncodeError(f"the facts config's identity is not JSON: {exc}") from exc
        object.__setattr__(self, "facts", canonical)

    @classmethod
    def of(cls, facts: "FactsConfig", encoding: EncodingIdentity) -> "RunIdentity":
        return cls(facts.identity(), encoding)

    @property
    def model_fingerprint(self) -> str:
        return self.encoding.model_fingerprint

    def record(self) -> dict:
        """The encoder's record and the facts config (under ``facts``): what the manifest
        records as ``encoder_config`` and the version id hashes."""
        return {**self.encoding.record(), FACTS_RECORD: self.facts}

    def changed_settings(self, recorded: Mapping[str, Any]) -> list[str]:
        """What differs between a version's recorded ``encoder_config`` and this run:
        the encoder settings (:meth:`EncodingIdentity.changed_settings`), then
        ``facts.<setting>`` for each facts setting that differs, or ``facts`` for a record
        without the facts config (versions published before it was recorded: their
        facts config is unknown, so they are re-encoded once)."""
        changed = self.encoding.changed_settings(recorded)
        theirs = recorded.get(FACTS_RECORD)
        if not isinstance(theirs, Mapping):
            return changed + [FACTS_RECORD]
        return changed + [f"{FACTS_RECORD}.{k}" for k in sorted(set(theirs) | set(self.facts))
                          if theirs.get(k) != self.facts.get(k)]


class MemoryLayout(NamedTuple):
    """How the server lays out a request's memory (:func:`inferscale.compose.memory_layout`),
    as a version records it."""

    memory_order: str
    text_tail: int
    tail_max_k: int


def served_layout(record: Mapping[str, Any]) -> MemoryLayout:
    """The memory layout a version's recorded ``encoder_config`` asks for (a field it
    lacks: its implicit value, :data:`_IMPLICIT`, as staleness reads it too);
    ComposeError for anything :func:`~inferscale.compose.memory_layout` cannot serve (an
    unknown order, a count that is not a non-negative integer), so a damaged or forged
    record is refused once, at load."""
    order, tail, tail_max_k = (record.get(k, _IMPLICIT[k]) for k in MemoryLayout._fields)
    counts = [tail, tail_max_k]
    if order not in MEMORY_ORDERS or not all(
            type(n) is int and n >= 0 for n in counts):  # noqa: E721 - bool is not a count
        raise ComposeError(f"not a memory layout: memory_order {order!r:.40}, text_tail "
                           f"{counts[0]!r:.20}, tail_max_k {counts[1]!r:.20}")
    return MemoryLayout(order, tail, tail_max_k)
