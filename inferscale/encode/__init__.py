"""Stage 3, encode: facts -> relocatable pre-RoPE KV with the serving model.

- :mod:`inferscale.encode.identity`: the encoder config, the identity of an encoding
  (config, model, compute dtype and device) and of a run (that and the facts config),
  from which version ids, cache keys, staleness, content keys and the layout serving
  reads from a version's record derive;
- :mod:`inferscale.encode.rope`: rotating stored pre-RoPE keys to any positions;
- :mod:`inferscale.encode.encoder`: the context-window encoder (each fact after its
  window of preceding turns, K captured before rotary embedding);
- :mod:`inferscale.encode.capture`: pre-RoPE K and V captured from a forward pass, in
  the token-major rows ``kv.arrow`` stores;
- :mod:`inferscale.encode.batches`: its forward passes' batches and block masks;
- :mod:`inferscale.encode.calibration`: per-layer (or per-head) key temperatures fitted
  at encode time (``key_calibration``);
- :mod:`inferscale.encode.content_keys`: what a fact's K/V is a function of, hashed (a
  later version reuses the K/V of every fact whose key it needs).

The model (:mod:`inferscale.models`) and the prompt format (:mod:`inferscale.compose`)
are shared with the earlier stages and the server.
"""
