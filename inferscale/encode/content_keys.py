"""Content keys: what a fact's stored K/V is a function of, hashed.

The encoder runs every fact alone in an unpadded forward pass (batch-invariant mode,
:mod:`inferscale.encode.encoder`), so the bits of a fact's K/V depend on nothing but the
token ids of the context it is encoded after (whatever the encoder puts there: window
turns as transcript or as memory lines, the serving prefix...), its own token ids, the
encoder config, the model and the numerics of the computation. :func:`content_key`
hashes exactly those; the key is stored with the chunk in ``kv.arrow``
(:mod:`storage_schemas.kv`), and a later version of the user reuses the rows of every
chunk whose key it needs instead of encoding it again. The part of every key that is
not token ids comes from the run's :class:`~inferscale.encode.identity.EncodingIdentity`
and the exact numerics of the model that runs (:func:`key_identity`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Sequence

import numpy as np
import torch

from inferscale.encode.identity import EncodingIdentity
from inferscale.kv_quant import is_quantized
from inferscale.types import ChunkKV

KEY_FORMAT = "inferscale.content-key.v1"
log = logging.getLogger(__name__)


def numerics(model: torch.nn.Module) -> dict[str, Any]:
    """What decides the last bits of the encoder's K/V besides its inputs: the compute
    dtype and device (GPU name and SM count; CPU instruction set and intra-op thread
    count, which changes how CPU kernels split their sums: measured, different bits),
    fp32 matmul precision, torch and transformers versions and the attention kernel."""
    import transformers

    p = next(model.parameters())
    out: dict[str, Any] = {
        "dtype": str(p.dtype).removeprefix("torch."), "device": p.device.type,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "attention": getattr(model.config, "_attn_implementation", None) or "eager",
        "fp32_matmul": torch.get_float32_matmul_precision(),
    }
    if p.device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(p.device)
        out["sms"] = torch.cuda.get_device_properties(p.device).multi_processor_count
    else:
        out["cpu"] = torch.backends.cpu.get_cpu_capability()
        out["threads"] = torch.get_num_threads()
    return out


def key_identity(identity: EncodingIdentity, model: torch.nn.Module,
                 key_scales: str | None = None) -> str:
    """The part of every content key that is not token ids: the key format, the
    identity's encoder config and model fingerprint, and :func:`numerics` of ``model``
    (canonical JSON); ``key_scales``: the digest of calibrated key temperatures
    (:meth:`~inferscale.encode.calibration.KeyCalibration.digest`), which the stored keys
    are divided by, so rows are reused only under the same temperatures."""
    body = {"format": KEY_FORMAT, "encoder": identity.encoder.to_dict(),
            "model": identity.model_fingerprint, "numerics": numerics(model)}
    if key_scales:
        body["key_scales"] = key_scales
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def content_key(identity: str, context: Sequence[int], token_ids: Sequence[int]) -> str:
    """sha256 (hex) of ``identity``, then the context's and the chunk's token ids (each
    length-prefixed, int64 little-endian). The context is whatever precedes the chunk in
    its pass, token for token, so any change of what the encoder puts there changes the
    key."""
    h = hashlib.sha256(identity.encode())
    for ids in (context, token_ids):
        arr = np.asarray(ids, dtype="<i8")
        h.update(len(arr).to_bytes(8, "little"))
        h.update(arr.tobytes())
    return h.hexdigest()


def matching_rows(chunk_id: str, hit: ChunkKV | None, shape: tuple[int, ...],
                  dtype: torch.dtype) -> ChunkKV | None:
    """``hit`` (a previous version's rows under a chunk's key, and their scales
    ``[2, L, H]`` for a quantized dtype) if its rows have the chunk's ``shape``
    ``[T, 2, L, H, D]`` and the stored ``dtype`` (and the scales theirs); a key match
    implies that, so a mismatch means a damaged or foreign previous version: the chunk is
    encoded instead (``None``) and a warning says so."""
    if hit is None:
        return None
    _, _, L, H, _ = shape
    kv, scales = hit
    if not is_quantized(dtype):
        scaled_right = scales is None
    else:
        scaled_right = (scales is not None and tuple(scales.shape) == (2, L, H)
                        and scales.dtype == torch.float32)
    if tuple(kv.shape) == tuple(shape) and kv.dtype == dtype and scaled_right:
        return hit
    log.warning("chunk %s: the previous version's rows under its content key are %s %s, not "
                "%s %s; encoding it", chunk_id, tuple(kv.shape), kv.dtype, tuple(shape), dtype)
    return None
