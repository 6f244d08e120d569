"""Prefect tasks of InferScale: thin wrappers over ``inferscale`` that add caching
(compute, on content hashes), retries (I/O only), concurrency slots and lineage records.

- ``ingest``: read and validate logs, quarantine bad records (I/O, retried)
- ``model``: the serving model's fingerprint (converts the embedded model once)
- ``facts``: one user's facts (compute, cached)
- ``encode``: one user's pre-RoPE KV (compute, cached)
- ``publish``: publish a version to the artifact store (I/O, retried)
- ``lineage``: one Prefect table artifact per published version, and its asset
- ``user``: one user's whole chain, the unit the flows fan out
- ``store``: LATEST and manifest reads that decide what to encode (I/O, retried)
- ``serving``: hydrate users into a running server (HTTP, retried)
"""

from inferscale.settings import offline_environment

offline_environment()  # before any library that reads these variables at import
