"""The contracts every stage shares, each defined once.

- :data:`PREFIX_ID`: the chunk id of the instruction prefix, always a memory's first chunk
  (the KV file format's own constant, ``storage_schemas.kv.PREFIX``).
- :data:`KV_DTYPES` / :data:`KVDtype`: the dtypes a KV slab is stored in (the KV file
  format's ``ITEMSIZE`` table); :func:`torch_dtype` and :func:`dtype_name` translate
  between those names and torch dtypes (the names are torch's own attribute names).
- :data:`Tier` / :data:`TIERS`: where a hydrated user's slab lives in the serving worker:
  ``gpu`` (device memory; CPU memory on a CPU-only engine) or ``host`` (pinned host memory
  where CUDA exists). :data:`HydrateTarget` / :data:`HYDRATE_TARGETS`: those, or
  ``facts`` (an admin hydrate of the user's facts and retrieval index alone).
- :data:`GPU_BUDGET_BYTES` / :data:`HOST_BUDGET_BYTES`: the default byte budgets of those
  tiers (``INFERSCALE_GPU_BUDGET_BYTES``, ``INFERSCALE_HOST_BUDGET_BYTES``).
- :data:`ENCODER_CONTEXTS`, :data:`MEMORY_ORDERS`, :data:`KEY_CALIBRATIONS` and the
  encoder's defaults (:data:`DEFAULT_WINDOW`, :data:`DEFAULT_CONTEXT`,
  :data:`DEFAULT_MEMORY_ORDER`, :data:`DEFAULT_TEXT_TAIL`, :data:`DEFAULT_TAIL_MAX_K`,
  :data:`DEFAULT_KEY_CALIBRATION`): what each fact is encoded after, how its stored keys
  are tempered and how a request lays out its memory; the encoder config and the
  settings both default to these. They are the variant the injection rule picked on
  LoCoMo: as accurate as the prompt baseline while injecting every fact from k = 6 on
  (``benchmarks/README.md``, "Issue 27").
- :func:`check_user_id` / :func:`user_id_problem`: the one rule for user ids, applied
  wherever an id enters (log ingestion quarantines a record with a bad one; the settings'
  ``INFERSCALE_API_KEYS``; the server's bodies, gateway header and admin requests; the
  artifact store's folder names): 1..:data:`MAX_ID_CHARS` characters, no whitespace of
  any kind (Mem0 refuses ids with inner whitespace: one such user used to fail every
  user's extraction), no control, format, separator, surrogate, private-use or
  unassigned code points (Unicode categories Cc, Cf, Zl, Zp, Cs, Co, Cn: newlines, NUL,
  bidi overrides, zero-width characters), no ``/`` or ``\\``, not ``.`` or ``..``. The
  whole string is checked (no regular expression whose ``$`` accepts a trailing newline).
  Pattern characters (``*``, ``%``, ``?``, quotes) stay valid: an id is never a pattern,
  since the facts store compares every filter value literally as a bound value
  (:mod:`inferscale.facts.mem0_lancedb`), so user ``*`` is one more user, not everyone.
- :data:`VERSION_RE`: an artifact version id (32 lowercase hex digits).
- :class:`KVGeometry`: a model's KV geometry ``(layers, kv_heads, head_dim)``, what a
  slab's ``[T, 2, L, H, D]`` must be to serve that model: the encoder records the
  model's, publishing refuses chunks of another, and the serving worker refuses a slab
  of another before it reaches its store, staging memory or a kernel.
- :class:`KVFormat`: the memory layouts of KV, each named once (token-major, what the
  encoder emits and ``kv.arrow`` stores; layer-major, a CPU engine's resident store);
  :class:`ChunkKV`: one chunk's stored K/V (token-major rows, fp8 scales).

Imports only the standard library and ``storage_schemas`` (torch when a dtype is
translated), so every module, the settings and the CLI can use it.
"""

from __future__ import annotations

import re
import unicodedata
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal, Mapping, NamedTuple

from storage_schemas import kv as kv_schema

if TYPE_CHECKING:
    import torch

PREFIX_ID: str = kv_schema.PREFIX

KV_DTYPES: tuple[str, ...] = tuple(kv_schema.ITEMSIZE)
# Literal["bfloat16", "float16", "float32"], spelled from the table above
KVDtype = Literal[KV_DTYPES]  # type: ignore[valid-type]

Tier = Literal["gpu", "host"]
TIERS: tuple[Tier, ...] = ("gpu", "host")
# where an admin hydrate puts a user: its KV in a tier (with its facts), or only its facts
# and retrieval index in the server ("facts": the KV stays in storage, read or computed per
# request, and the user's first request no longer waits for its facts to be read)
HydrateTarget = Literal["gpu", "host", "facts"]
HYDRATE_TARGETS: tuple[HydrateTarget, ...] = (*TIERS, "facts")

GPU_BUDGET_BYTES = 8 << 30
HOST_BUDGET_BYTES = 32 << 30

# "transcript": the window's turns as raw transcript, nothing before them; "memory": the
# serving prefix, then the window's turns as memory lines; "prefix": the serving prefix,
# then the window as transcript.
ENCODER_CONTEXTS = ("transcript", "memory", "prefix")
# The order of a request's injected facts: best first, best last, or by source turn.
MEMORY_ORDERS = ("relevance", "relevance_last", "chronological")
# The defaults are issue 27's injection rule's pick on the H200 (w20_last_tail5_k5,
# benchmarks/results/locomo-h200-injection.json): up to 5 facts retrieved, all as text;
# from 6 on, every fact injected, the best last (right before the question).
DEFAULT_WINDOW = 20
DEFAULT_CONTEXT = "memory"
DEFAULT_MEMORY_ORDER = "relevance_last"
DEFAULT_TEXT_TAIL = 5  # the best facts prefilled as text right before the question
DEFAULT_TAIL_MAX_K = 5  # the tail only where at most this many facts are retrieved (0: always)
# The stored K/V dtype where the settings say "auto": fp8 where the encoding runs on CUDA
# (half of bf16's bytes; LoCoMo F1 within 0.005 of bf16 memory, issue 31), bfloat16 on the
# CPU (a CPU store dequantizes fp8 when it places it: no saving there).
KV_DTYPE_CUDA = "float8_e4m3fn"
KV_DTYPE_CPU = "bfloat16"


def default_kv_dtype(device: str) -> str:
    """The stored K/V dtype "auto" stands for when encoding on ``device``."""
    return KV_DTYPE_CUDA if device.startswith("cuda") else KV_DTYPE_CPU


# Offline key-temperature calibration of the stored fact keys (inferscale.encode.calibration):
# none, one temperature per layer, or one per layer and KV head.
KEY_CALIBRATIONS = ("none", "layer", "head")
DEFAULT_KEY_CALIBRATION = "none"


def torch_dtype(name: str) -> "torch.dtype":
    """``"bfloat16"`` -> ``torch.bfloat16`` (ValueError for a name not in :data:`KV_DTYPES`)."""
    if name not in KV_DTYPES:
        raise ValueError(f"KV dtype must be one of {list(KV_DTYPES)}, got {name!r}")
    import torch

    return getattr(torch, name)


def dtype_name(dtype: "torch.dtype") -> str | None:
    """``torch.bfloat16`` -> ``"bfloat16"``; None for a dtype a slab cannot be stored in."""
    name = str(dtype).removeprefix("torch.")
    return name if name in KV_DTYPES else None


def check_tier(tier: str, allowed: tuple[str, ...] = TIERS) -> str:
    """``tier`` itself, or ValueError when it is not one of ``allowed`` (:data:`TIERS`;
    :data:`HYDRATE_TARGETS` for an admin hydrate)."""
    if tier not in allowed:
        raise ValueError(f"tier must be one of {', '.join(map(repr, allowed))}, got {tier!r}")
    return tier  # type: ignore[return-value]


MAX_ID_CHARS = 128  # the longest id of any kind: user, session, turn, speaker
VERSION_RE = re.compile(r"[0-9a-f]{32}")
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


class InvalidUserIdError(ValueError):
    """A user id that breaks the rules of :func:`check_user_id`."""


def user_id_problem(user: object) -> str | None:
    """Why ``user`` is not a valid user id, or None when it is."""
    if not isinstance(user, str):
        return f"must be a string, not {type(user).__name__}"
    if not user:
        return "must not be empty"
    if len(user) > MAX_ID_CHARS:
        return f"is {len(user)} characters long; at most {MAX_ID_CHARS}"
    if user in (".", ".."):
        return "must not be '.' or '..'"
    for ch in user:
        if ch in "/\\":
            return "must not contain '/' or '\\'"
        category = unicodedata.category(ch)
        if category in _REFUSED_CATEGORIES:
            return f"contains U+{ord(ch):04X} (category {category}: control or invisible)"
        if ch.isspace():
            return f"contains whitespace (U+{ord(ch):04X}): user ids are single words"
    return None


def check_user_id(user: object) -> str:
    """``user`` itself, or :class:`InvalidUserIdError` saying which rule it breaks."""
    problem = user_id_problem(user)
    if problem is not None:
        shown = repr(user[:40]) if isinstance(user, str) else type(user).__name__
        raise InvalidUserIdError(f"user id {shown} {problem}")
    return user  # type: ignore[return-value]


class KVGeometry(NamedTuple):
    """A model's KV geometry: ``layers`` L, ``kv_heads`` H (all of the model's, not one
    tensor-parallel rank's), ``head_dim`` D. Two slabs with the same bytes per token can
    differ in it (``[30, 6, 32]`` vs ``[30, 3, 64]``): only the model's may be served."""

    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of_config(cls, config: Any) -> "KVGeometry":
        """From a Hugging Face model config (an object or its ``config.json`` as a
        mapping; a multimodal config's ``text_config``): ``num_hidden_layers``,
        ``num_key_value_heads`` (else ``num_attention_heads``), ``head_dim`` (else
        ``hidden_size // num_attention_heads``)."""
        def get(c: Any, name: str) -> Any:
            return c.get(name) if isinstance(c, Mapping) else getattr(c, name, None)

        config = get(config, "text_config") or config
        heads = get(config, "num_attention_heads")
        return cls(int(get(config, "num_hidden_layers")),
                   int(get(config, "num_key_value_heads") or heads),
                   int(get(config, "head_dim") or get(config, "hidden_size") // heads))

    def describe(self) -> str:
        return f"[L={self.layers}, H={self.kv_heads}, D={self.head_dim}]"


class KVFormat(Enum):
    """The memory layouts of KV, each named once (as LMCache's ``MemoryFormat`` names
    its). Every KV tensor is logically token-major ``[T, 2, L, H, D]`` (token, K then V,
    layer, KV head, head dim), and is indexed so everywhere; a format is the order its
    dimensions lie in memory, outermost first (the value).

    - ``TOKEN_MAJOR``: ``[T, 2, L, H, D]`` in memory, one row per token: K of every layer,
      then V. What the encoder emits for each chunk, what ``kv.arrow`` stores (its slab,
      ``storage_schemas.kv.LAYOUT``), the task cache's form, the rows a later version
      reuses, and a resident slab on CUDA (a run of rows is one contiguous copy).
    - ``LAYER_MAJOR``: ``[2, L, T, H, D]`` in memory behind the ``[T, 2, L, H, D]`` view:
      a CPU engine's resident store (the CPU kernel streams one layer's rows per
      thread). A slab is converted to it once, when the store places it.

    A chunk's fp8 scales are ``[2, L, H]`` (K/V, layer, KV head) in either."""

    TOKEN_MAJOR = (0, 1, 2, 3, 4)
    LAYER_MAJOR = (1, 2, 0, 3, 4)

    @property
    def order(self) -> tuple[int, ...]:
        """The logical dimensions ``[T, 2, L, H, D]`` in memory order, outermost first."""
        return self.value

    def empty(self, tokens: int, geometry: tuple[int, int, int], dtype: "torch.dtype",
              device: Any = None) -> "torch.Tensor":
        """A new tensor ``[tokens, 2, L, H, D]`` (``geometry``: L, H, D) laid out in this
        format."""
        import torch

        shape = (tokens, 2, *geometry)
        dense = torch.empty([shape[i] for i in self.order], dtype=dtype, device=device)
        return dense.permute([self.order.index(i) for i in range(5)])

    def copy(self, kv: "torch.Tensor", dtype: "torch.dtype | None" = None) -> "torch.Tensor":
        """``kv`` ``[T, 2, L, H, D]`` copied (and converted to ``dtype``) in one pass into
        a new tensor of this format on its device."""
        out = self.empty(kv.shape[0], tuple(kv.shape[2:]), dtype or kv.dtype, kv.device)
        out.copy_(kv)
        return out


class ChunkKV(NamedTuple):
    """One chunk's stored K/V: ``kv`` ``[T, 2, L, H, D]`` (:attr:`KVFormat.TOKEN_MAJOR`)
    in a KV dtype, and for fp8 its ``scales`` ``[2, L, H]`` float32 (else None). What a
    version's reader hands the encoder to reuse (by content key)."""

    kv: "torch.Tensor"
    scales: "torch.Tensor | None" = None
