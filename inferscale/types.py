"""The contracts every stage shares, each defined once.

- :data:`PREFIX_ID`: the chunk id of the instruction prefix, always a memory's first chunk
  (the KV file format's own constant, ``storage_schemas.kv.PREFIX``).
- :data:`KV_DTYPES` / :data:`KVDtype`: the dtypes a KV slab is stored in (the KV file
  format's ``ITEMSIZE`` table); :func:`torch_dtype` and :func:`dtype_name` translate
  between those names and torch dtypes (the names are torch's own attribute names).
- :data:`Tier` / :data:`TIERS`: where a hydrated user's slab lives in the serving worker:
  ``gpu`` (device memory; CPU memory on a CPU-only engine) or ``host`` (pinned host memory
  where CUDA exists).
- :data:`GPU_BUDGET_BYTES` / :data:`HOST_BUDGET_BYTES`: the default byte budgets of those
  tiers (``INFERSCALE_GPU_BUDGET_BYTES``, ``INFERSCALE_HOST_BUDGET_BYTES``).

Imports only the standard library and ``storage_schemas`` (torch when a dtype is
translated), so every module, the settings and the CLI can use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from storage_schemas import kv as kv_schema

if TYPE_CHECKING:
    import torch

PREFIX_ID: str = kv_schema.PREFIX

KV_DTYPES: tuple[str, ...] = tuple(kv_schema.ITEMSIZE)
# Literal["bfloat16", "float16", "float32"], spelled from the table above
KVDtype = Literal[KV_DTYPES]  # type: ignore[valid-type]

Tier = Literal["gpu", "host"]
TIERS: tuple[Tier, ...] = ("gpu", "host")

GPU_BUDGET_BYTES = 8 << 30
HOST_BUDGET_BYTES = 32 << 30


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


def check_tier(tier: str) -> Tier:
    """``tier`` itself, or ValueError when it is not one of :data:`TIERS`."""
    if tier not in TIERS:
        raise ValueError(f"tier must be 'gpu' or 'host', got {tier!r}")
    return tier  # type: ignore[return-value]
