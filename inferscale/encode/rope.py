"""Chunked RoPE: rotate stored pre-RoPE keys to any virtual positions.

Keys are stored before rotary embedding. Because ``<R_a q, R_b k> = <q, R_{b-a} k>``, a
stored key rotated to position ``p`` scores exactly as if it had been prefilled at ``p``.

Tables come from the model itself: :meth:`RotaryTables.from_model` calls the model's own
rotary-embedding module (so ``default``, ``llama3``, ``linear``, ``dynamic``, ``yarn`` and
whatever else transformers implements behave exactly as in the model, attention scaling
included); :meth:`RotaryTables.from_config` builds that same module from a config when no
model is loaded. Partial rotary (``rot_dim < head_dim``) rotates the first ``rot_dim``
channels and passes the rest through. Both half-split ("neox", Llama/Qwen) and
interleaved ("gptj") layouts are supported.

All arithmetic is fp32; outputs come back in the input dtype.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch


class RopeError(ValueError):
    """A rotary configuration or tensor shape that cannot be used."""


def _find_rotary_module(model: torch.nn.Module) -> torch.nn.Module:
    for name in ("model.rotary_emb", "rotary_emb", "model.language_model.rotary_emb"):
        mod: Any = model
        for part in name.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        if mod is not None:
            return mod
    for mod in model.modules():
        if hasattr(mod, "inv_freq") and callable(mod):
            return mod
    raise RopeError(f"{type(model).__name__} has no rotary embedding module")


def _rotary_class_for(config: Any) -> type:
    model_type = getattr(config, "model_type", "llama")
    try:
        mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        mod = importlib.import_module("transformers.models.llama.modeling_llama")
    classes = [getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding")]
    # Prefer the plain "<Arch>RotaryEmbedding" over variants (e.g. multimodal).
    classes.sort(key=lambda c: len(c.__name__))
    if not classes:
        raise RopeError(f"transformers has no rotary embedding for model type {model_type!r}")
    return classes[0]


@dataclass
class RotaryTables:
    """Cos/sin producer for one model; ``cos_sin(positions)`` -> two ``[T, rot_dim]``.

    ``module`` is the model's rotary-embedding module (its forward takes
    ``(x, position_ids)`` and returns cos, sin ``[1, T, rot_dim]`` with any attention
    scaling applied). ``head_dim`` is the full key width.
    """

    module: torch.nn.Module
    head_dim: int
    interleaved: bool = False

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "RotaryTables":
        cfg = model.config
        cfg = getattr(cfg, "text_config", None) or cfg
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(_find_rotary_module(model), head_dim)

    @classmethod
    def from_config(cls, config: Any, device: str | torch.device = "cpu") -> "RotaryTables":
        cfg = getattr(config, "text_config", None) or config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        module = _rotary_class_for(cfg)(cfg).to(device)
        return cls(module, head_dim)

    @property
    def device(self) -> torch.device:
        buf = next(iter(self.module.buffers()), None)
        return buf.device if buf is not None else torch.device("cpu")

    @torch.no_grad()
    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for integer ``positions [T]`` -> fp32 ``[T, rot_dim]`` each."""
        pos = positions.to(self.device, torch.long).reshape(1, -1)  # [1, T]
        dummy = torch.empty(0, dtype=torch.float32, device=self.device)
        cos, sin = self.module(dummy, pos)
        cos, sin = cos[0].float(), sin[0].float()  # [T, rot_dim]
        if cos.shape[-1] > self.head_dim:
            raise RopeError(f"rotary width {cos.shape[-1]} exceeds head_dim {self.head_dim}")
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``rot_dim`` channels of ``x [..., D]`` by ``cos, sin [..., rot_dim]``.

    ``cos``/``sin`` must broadcast against ``x[..., :rot_dim]``. Computed in fp32,
    returned in ``x.dtype``. ``interleaved=False`` is the half-split layout
    (``rotate_half``), ``True`` the pairwise GPT-J layout.
    """
    rot = cos.shape[-1]
    if rot > x.shape[-1] or rot % 2:
        raise RopeError(f"rotary width {rot} does not fit head_dim {x.shape[-1]}")
    xf = x[..., :rot].float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        c, s = cos[..., 0::2], sin[..., 0::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        half = rot // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        rotated_half = torch.cat((-x2, x1), dim=-1)
        out = xf * cos + rotated_half * sin
    if rot == x.shape[-1]:
        return out.to(x.dtype)
    return torch.cat((out.to(x.dtype), x[..., rot:]), dim=-1)


def rotate_keys(keys: torch.Tensor, positions: torch.Tensor, tables: RotaryTables,
                token_dim: int = 1) -> torch.Tensor:
    """Rotate pre-RoPE keys to ``positions``.

    ``keys``: ``[L, T, H, D]`` (``token_dim=1``) or ``[T, L, H, D]`` (``token_dim=0``:
    the K half of stored token-major rows, as the connector gathers them);
    ``positions``: ``[T]`` integers, any values (virtual positions need not be
    contiguous). Works on CPU and CUDA, fp32 or bf16 input; the result has the input
    dtype and device.
    """
    if keys.dim() != 4:
        raise RopeError(f"keys must be 4-D [L, T, H, D] or [T, L, H, D], got {tuple(keys.shape)}")
    if keys.shape[token_dim] != positions.numel():
        raise RopeError(f"{positions.numel()} positions for {keys.shape[token_dim]} tokens")
    cos, sin = tables.cos_sin(positions)  # [T, rot]
    cos, sin = cos.to(keys.device), sin.to(keys.device)
    shape = [1, 1, 1, cos.shape[-1]]
    shape[token_dim] = -1
    return apply_rotary(keys, cos.reshape(shape), sin.reshape(shape), tables.interleaved)
