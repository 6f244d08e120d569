"""Stage 2, facts: a user's turns -> memory facts through Mem0, each with its source turn,
token ids and embedding.

- :mod:`inferscale.facts.extractor`: :class:`~inferscale.facts.extractor.FactExtractor`
  (one Mem0 ``Memory`` reused for every user) and the facts table's content hash;
- :mod:`inferscale.facts.table`: the facts table (fact ids, texts, token ids,
  embeddings) and the raw fact mode's facts, with or without Mem0;
- :mod:`inferscale.facts.mem0_llm`: Mem0's LLM with guided JSON, bounded facts and the
  session's date;
- :mod:`inferscale.facts.llm_server`: the local vLLM server used when no LLM endpoint
  (or OpenAI key) is configured;
- :mod:`inferscale.facts.mem0_lancedb`: LanceDB as Mem0's vector store.
"""
