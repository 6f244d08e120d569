"""InferScale's benchmarks: one module per measurement, each run as ``python -m
benchmarks.<name>`` from the repository root (``encode``, ``incremental``, ``hydrate``,
``retrieval``, ``ttft``, ``locomo`` and ``locomo_select``, ``equivalence``, ``load``,
``footprint``, ``replicas``, ``plots``); what they share in :mod:`benchmarks.lib`, their
inputs in :mod:`benchmarks.datasets` (vLLM's ``vllm/benchmarks`` is laid out so).
``benchmarks/README.md`` has the results and the commands that made them.

The benchmarks use the library as its users would: they import only its public API, the
modules a stage package's docstring lists (and the shared ``inferscale`` modules:
``types``, ``kv_quant``, ``settings``, ``models``, ``compose``; ``storage_schemas``) and
no name that starts with an underscore; never ``flows``, ``tasks`` or ``tests``. Their
own tests are ``tests/benchmarks/``, mirroring this package; ``tests/test_architecture.py``
checks both rules.
"""
