"""Stage 2, facts: a user's turns -> memory facts through Mem0, each with its source turn,
token ids and embedding.

- :mod:`inferscale.facts.extractor`: :class:`~inferscale.facts.extractor.FactExtractor`
  (one Mem0 ``Memory`` reused for every user), the facts table and its content hash;
- :mod:`inferscale.facts.mem0_llm`: Mem0's LLM with guided JSON, bounded facts and the
  session's date;
- :mod:`inferscale.facts.llm_server`: the local vLLM server used when no LLM endpoint
  (or OpenAI key) is configured;
- :mod:`inferscale.facts.mem0_lancedb`: LanceDB as Mem0's vector store.
"""
