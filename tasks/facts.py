"""One user's facts (Mem0 extraction, or raw turns), cached on content hashes."""

from __future__ import annotations

import pyarrow as pa
from prefect import task

from inferscale.facts.extractor import FactsConfig, FactsResult
from inferscale.pipeline.config import PipelineConfig
from inferscale.pipeline.steps import extract_user_facts
from tasks.caching import CACHE_EXPIRATION, facts_cache_key
from tasks.results import FactsResultSerializer


@task(name="extract-facts", task_run_name="extract-facts-{user}", cache_key_fn=facts_cache_key,
      cache_expiration=CACHE_EXPIRATION, persist_result=True,
      result_serializer=FactsResultSerializer())
def extract_facts(cfg: PipelineConfig, facts_cfg: FactsConfig, user: str, turns: pa.Table,
                  model_fp: str) -> FactsResult:
    """:func:`inferscale.pipeline.steps.extract_user_facts`, cached (Arrow IPC, never a
    pickle). No retries: compute."""
    return extract_user_facts(cfg, facts_cfg, user, turns, model_fp)
