"""Cache keys of the compute tasks: content hashes, never run ids.

Prefect's default cache policy includes the flow run id, so nothing would be reused by
the next run. These keys hash what decides a step's output instead:

- facts: the turns' content hash, the facts settings that change extraction
  (:func:`inferscale.pipeline.facts_identity`) and the model fingerprint (the facts
  carry token ids of the model's tokenizer);
- KV: the turns' and the facts' content hashes, the encoder config with the dtype and
  device kind of the computation (:func:`inferscale.pipeline.encode_identity`) and the
  model fingerprint. Not the previous version whose K/V rows the encoding reuses: reuse
  yields the same bytes as encoding every fact.

The package version is part of both, so a release that changes a step's output does not
reuse older results, and so is the import path of the cached result's class: results are
pickled by reference to their class, and one pickled under another module layout could
not be read back. Cached values live in Prefect's result storage
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
    from inferscale.pipeline import facts_identity

    return _key("facts", FactsResult, {"turns": parameters["turns_hash"],
                                       "facts": facts_identity(parameters["facts_cfg"]),
                                       "model": parameters["model_fp"]})


def encode_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """Key of ``tasks.encode.encode_kv``."""
    from inferscale.encode.encoder import EncodedMemory
    from inferscale.pipeline import encode_identity

    return _key("kv", EncodedMemory, {"turns": parameters["turns_hash"],
                                      "facts": parameters["facts_hash"],
                                      "encode": encode_identity(parameters["cfg"]),
                                      "model": parameters["model_fp"]})
