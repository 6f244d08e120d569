"""Stage 3, encode: facts -> relocatable pre-RoPE KV with the serving model.

- :mod:`inferscale.encode.identity`: the encoder config and the identity of an encoding
  (config, model, compute dtype and device), from which version ids, cache keys,
  staleness and content keys derive;
- :mod:`inferscale.encode.rope`: rotating stored pre-RoPE keys to any positions;
- :mod:`inferscale.encode.encoder`: the context-window encoder (each fact after its
  window of preceding turns, K captured before rotary embedding);
- :mod:`inferscale.encode.batches`: its forward passes' batches and block masks;
- :mod:`inferscale.encode.capture`: the K/V capture of those passes (any contexts
  followed by any chunks: :func:`~inferscale.encode.capture.encode_segments`);
- :mod:`inferscale.encode.content_keys`: what a fact's K/V is a function of, hashed (a
  later version reuses the K/V of every fact whose key it needs).

The model (:mod:`inferscale.models`) and the prompt format (:mod:`inferscale.compose`)
are shared with the earlier stages and the server.
"""
