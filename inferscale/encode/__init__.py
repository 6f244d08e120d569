"""Stage 3, encode: facts -> relocatable pre-RoPE KV with the serving model.

- :mod:`inferscale.encode.models`: model specs -> checkpoints, loading, fingerprints;
- :mod:`inferscale.encode.compose`: ``[instruction prefix | facts | query]`` token ids,
  the same offline (encoder, fact extraction) and online (the server);
- :mod:`inferscale.encode.rope`: rotating stored pre-RoPE keys to any positions;
- :mod:`inferscale.encode.encoder`: the context-window encoder (each fact after its
  window of preceding turns, K captured before rotary embedding);
- :mod:`inferscale.encode.batches`: its forward passes' batches and block masks;
- :mod:`inferscale.encode.content_keys`: what a fact's K/V is a function of, hashed (a
  later version reuses the K/V of every fact whose key it needs).
"""
