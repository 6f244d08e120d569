"""One user's pre-RoPE KV with the serving model, cached on content hashes."""

from __future__ import annotations

import pyarrow as pa
from prefect import task

from inferscale.encode.encoder import EncodedMemory
from inferscale.pipeline import PipelineConfig, compact, encode_user_kv
from tasks.caching import CACHE_EXPIRATION, encode_cache_key
from tasks.results import EncodedKVSerializer


@task(name="encode-kv", task_run_name="encode-kv-{user}", cache_key_fn=encode_cache_key,
      cache_expiration=CACHE_EXPIRATION, persist_result=True,
      result_serializer=EncodedKVSerializer())
def encode_kv(cfg: PipelineConfig, user: str, turns: pa.Table, facts: pa.Table,
              turns_hash: str, facts_hash: str, model_fp: str,
              previous: str | None = None) -> EncodedMemory:
    """Encode ``user``'s facts (context-window encoding, ``cfg.encoder``), reusing the K/V
    of every fact whose content key is in version ``previous`` (the one ``LATEST`` names;
    the output is the same bytes either way, so ``previous`` is not part of the cache key).
    The cache key is the turns and facts hashes, the encoder identity and ``model_fp``; the
    result (the KV, compacted; ``stats`` say how many facts were reused and encoded) is
    kept in result storage as Arrow IPC (never a pickle). No retries: compute. Called by ``tasks.user.encode_user``."""
    encoded = encode_user_kv(cfg, turns, facts, progress=False, user=user, previous=previous)
    if encoded.model_fingerprint != model_fp:
        raise RuntimeError(f"the loaded model's fingerprint {encoded.model_fingerprint} is not "
                           f"the planned {model_fp} (the checkpoint changed during the run?)")
    return compact(encoded)
