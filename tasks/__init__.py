"""Prefect tasks of InferScale: the steps of :mod:`inferscale.pipeline.steps`, each wrapped
with what Prefect adds: a content-hash cache (compute), retries (I/O only), a concurrency
slot, lineage records.

- ``ingest``: read and validate logs, quarantine bad records (I/O, retried)
- ``model``: the serving model's fingerprint (converts the embedded model once)
- ``facts``: one user's facts (compute, cached)
- ``encode``: one user's pre-RoPE KV (compute, cached)
- ``publish``: publish a version to the artifact store (I/O, retried)
- ``lineage``: one Prefect table artifact per published version, and its asset
- ``user``: one user's whole chain (:func:`inferscale.pipeline.chain.encode_user` with
  these tasks as its steps), the unit the flows fan out
- ``store``: LATEST and manifest reads that decide what to encode (I/O, retried)
- ``serving``: hydrate users into a running server (HTTP, retried)
"""

from inferscale.settings import offline_environment

offline_environment()  # before any library that reads these variables at import
