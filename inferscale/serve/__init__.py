"""Stage 7, serve: answers from user memory on the vLLM engine with the plugin.

- :mod:`inferscale.serve.engine`: :class:`~inferscale.serve.engine.MemoryEngine`, one
  ``AsyncLLM`` with the connector; generation with injected memory, admin calls through
  the engine's collective RPC; its output text decoded by :mod:`inferscale.serve.detokenize`;
- :mod:`inferscale.serve.retrieval`: query embedding and exact top-k over a user's facts;
- :mod:`inferscale.serve.memory_cache`: the server's per-user facts and indexes
  (:mod:`inferscale.serve.user_memory`), kept fresh and bounded (its rate limit:
  :mod:`inferscale.serve.token_bucket`); :mod:`inferscale.serve.prefixes`: the
  instructions' prefixes;
- :mod:`inferscale.serve.cold_split`, :mod:`inferscale.serve.cold_requests`: the
  compute-or-load split of requests whose user is in neither tier;
- :mod:`inferscale.serve.server`: the memory server (retrieve, compose, generate) and
  :func:`~inferscale.serve.server.build_server`, the one way one is made;
- :mod:`inferscale.serve.backend`: the :class:`~inferscale.serve.backend.MemoryBackend`
  protocol the app calls, and the typed request and answer that cross it;
- :mod:`inferscale.serve.app`: the OpenAI-compatible HTTP app and admin API, with
  :mod:`inferscale.serve.access` (who may use whose memory),
  :mod:`inferscale.serve.api_models` (bodies and their bounds),
  :mod:`inferscale.serve.streaming` (streams closed down to vLLM) and
  :mod:`inferscale.serve.metrics` (``/metrics``; the event loop's lag:
  :mod:`inferscale.serve.loop_lag`);
- :mod:`inferscale.serve.replicas`: memory replicas on Ray Serve behind one endpoint
  (:mod:`~inferscale.serve.replica_set`, :mod:`~inferscale.serve.router`,
  :mod:`~inferscale.serve.placement`, :mod:`~inferscale.serve.leftovers`);
  :mod:`inferscale.serve.replica_cluster`: those replicas on this machine for as long as
  a block runs;
- :mod:`inferscale.serve.admin_client`: a client of the admin API.
"""
