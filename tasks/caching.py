"""Cache keys of the compute tasks: content hashes, never run ids.

Prefect's default cache policy includes the flow run id, so nothing would be reused by
the next run. These keys hash what decides a step's output instead, each with its part
of the run's identity (:class:`inferscale.encode.identity.RunIdentity`, what version
ids and staleness derive from too):

- facts: the turns' content hash, the facts part (the facts settings that change
  extraction, :meth:`inferscale.facts.extractor.FactsConfig.identity`) and the model
  fingerprint (the facts carry token ids of the model's tokenizer);
- KV: the turns' and the facts' content hashes and the encoding part
  (:class:`inferscale.encode.identity.EncodingIdentity`: encoder config, model, compute
  dtype and device kind); the facts config enters through the facts' hash. Not the
  previous version whose K/V rows the encoding reuses: reuse yields the same bytes as
  encoding every fact.

The package version is part of both, so a release that changes a step's output does not
reuse older results, and so is the result's class. Results are stored as Arrow IPC
(``tasks/results.py``), never pickled, in Prefect's result storage
(``PREFECT_LOCAL_STORAGE_PATH``, ``$PREFECT_HOME/storage`` by default; point it at
shared storage when tasks run on several machines).
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Any

CACHE_EXPIRATION = timedelta(days=14)


def _key(step: str, result: type, parts: dict[str, Any]) -> str:
    from inferscale import __version__

    blob = json.dumps({"step": step, "inferscale": __version__,
                       "result": f"{result.__module__}.{result.__qualname__}", **parts},
                      sort_keys=True, default=str, separators=(",", ":"))
    return f"inferscale-{step}-" + hashlib.sha256(blob.encode()).hexdigest()[:40]


def facts_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """Key of ``tasks.facts.extract_facts``."""
    from inferscale.facts.extractor import FactsResult
    from inferscale.ingest.logs import turns_hash

    return _key("facts", FactsResult, {"turns": turns_hash(parameters["turns"]),
                                       "facts": parameters["facts_cfg"].identity(),
                                       "model": parameters["model_fp"]})


def encode_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """Key of ``tasks.encode.encode_kv``."""
    from inferscale.encode.encoder import EncodedMemory
    from inferscale.facts.extractor import facts_hash
    from inferscale.ingest.logs import turns_hash

    return _key("kv", EncodedMemory, {"turns": turns_hash(parameters["turns"]),
                                      # the facts table as the encoder reads it (not
                                      # the embedder: embeddings do not change the KV)
                                      "facts": facts_hash(parameters["facts"], "kv"),
                                      "encoding": parameters["identity"].to_dict()})
