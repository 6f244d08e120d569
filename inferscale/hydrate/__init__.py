"""Stage 5, hydrate: published artifacts -> verified KV in the serving worker.

- :mod:`inferscale.hydrate.slab`: :func:`~inferscale.hydrate.slab.hydrate`, one version's
  kv.arrow read in one pass with its checksum fused in;
- :mod:`inferscale.hydrate.fact_reader`: single facts' rows read by byte range and verified
  (a request whose user is in neither tier);
- :mod:`inferscale.hydrate.resident`: :class:`~inferscale.hydrate.resident.Resident`, one
  user's verified slab, chunk index and token ids;
- :mod:`inferscale.hydrate.arena`: tier memory taken once, handed out as regions with
  fences;
- :mod:`inferscale.hydrate.store`: the worker's
  :class:`~inferscale.hydrate.store.ResidentStore` (gpu/host tiers, byte budgets, LRU,
  staging reserves);
- :mod:`inferscale.hydrate.loader`: admin hydrations and bandwidth-bounded background
  reloads into that store.

Nothing here imports vLLM: the vLLM plugin (:mod:`inferscale.vllm_plugin`) drives it.
"""
