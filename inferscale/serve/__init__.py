"""Stage 7, serve: answers from user memory on the vLLM engine with the plugin.

- :mod:`inferscale.serve.engine`: :class:`~inferscale.serve.engine.MemoryEngine`, one
  ``AsyncLLM`` with the connector; generation with injected memory, admin calls through
  the engine's collective RPC;
- :mod:`inferscale.serve.retrieval`: query embedding and exact top-k over a user's facts;
- :mod:`inferscale.serve.server`: the memory server (retrieve, compose, generate);
- :mod:`inferscale.serve.app`: the OpenAI-compatible HTTP app, access policy, admin API;
- :mod:`inferscale.serve.admin_client`: a client of that admin API;
- :mod:`inferscale.serve.memory_cache`, :mod:`inferscale.serve.cold_split`: the server's
  cache of users' facts, and how a cold request splits between reading and prefilling;
- :mod:`inferscale.serve.replicas`, :mod:`inferscale.serve.placement`: memory replicas on
  Ray Serve and each user's home replica; :mod:`inferscale.serve.replica_cluster`: those
  replicas on this machine for as long as a block runs.
"""
