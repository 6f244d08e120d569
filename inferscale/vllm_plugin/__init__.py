"""Stage 6, the vLLM plugin: memory KV injected into vLLM's paged cache.

vLLM loads it by name (:mod:`inferscale.vllm_plugin.config`: ``kv_connector_module_path``,
``worker_extension_cls``); nothing in vLLM is changed.

- :mod:`~inferscale.vllm_plugin.connector`: the KV connector, a facade over
  :mod:`~inferscale.vllm_plugin.scheduler` (which requests get memory KV) and
  :mod:`~inferscale.vllm_plugin.worker` (the resident slabs, the loads), which talk
  through :mod:`~inferscale.vllm_plugin.metadata` and count what fails inside them in
  :mod:`~inferscale.vllm_plugin.failures` (nothing escapes into vLLM's step; a request's
  memory that goes unused says why: a typed fallback);
- :mod:`~inferscale.vllm_plugin.storage_reads`: the worker's reads of non-resident users'
  facts from storage, for waiting requests;
- :mod:`~inferscale.vllm_plugin.promotion`: which misses promote their user (a whole-user
  reload), by how often users are asked for;
- :mod:`~inferscale.vllm_plugin.inject`: one step's gather, rotate and write;
  :mod:`~inferscale.vllm_plugin.kernels`: the fused kernels behind it
  (:mod:`~inferscale.vllm_plugin.kernels.writer`, their entry point;
  :mod:`~inferscale.vllm_plugin.kernels.indices`, what one launch reads besides the slab);
- :mod:`~inferscale.vllm_plugin.worker_ext`: the collective-RPC endpoints of the worker;
- :mod:`~inferscale.vllm_plugin.compat`: everything that differs between vLLM releases.

vLLM imports this package in every engine process: the package itself imports nothing.
"""
