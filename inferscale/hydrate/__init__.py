"""Stage 5, hydrate: a published artifact -> a verified KV slab in the serving worker.

- :mod:`inferscale.hydrate.slab`: :func:`~inferscale.hydrate.slab.hydrate`, one version's
  kv.arrow read in one pass with its checksum fused in (memory-mapped, pinned host or
  device memory);
- :mod:`inferscale.hydrate.resident`: :class:`~inferscale.hydrate.resident.Resident` (one
  user's verified slab, chunk index and token ids) and the worker's
  :class:`~inferscale.hydrate.resident.ResidentStore` (gpu/host tiers, byte budgets, LRU);
- :mod:`inferscale.hydrate.loader`: admin hydrations and background reloads into that
  store.

Nothing here imports vLLM: the vLLM plugin (:mod:`inferscale.vllm_plugin`) drives it.
"""
