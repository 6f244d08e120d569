"""One user's pre-RoPE KV with the serving model, cached on content hashes."""

from __future__ import annotations

import pyarrow as pa
from prefect import task

from inferscale.encode.encoder import EncodedMemory
from inferscale.encode.identity import EncodingIdentity
from inferscale.pipeline.config import PipelineConfig
from inferscale.pipeline.steps import compact, encode_user_kv
from tasks.caching import CACHE_EXPIRATION, encode_cache_key
from tasks.results import EncodedKVSerializer


@task(name="encode-kv", task_run_name="encode-kv-{user}", cache_key_fn=encode_cache_key,
      cache_expiration=CACHE_EXPIRATION, persist_result=True,
      result_serializer=EncodedKVSerializer())
def encode_kv(cfg: PipelineConfig, user: str, turns: pa.Table, facts: pa.Table,
              identity: EncodingIdentity, previous: str | None = None) -> EncodedMemory:
    """:func:`inferscale.pipeline.steps.encode_user_kv`, its K/V compacted for the cache
    (Arrow IPC, never a pickle). ``previous`` is not part of the cache key: reuse gives
    the same bytes. No retries: compute."""
    return compact(encode_user_kv(cfg, user, turns, facts, identity, previous))
