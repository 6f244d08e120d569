"""InferScale: long-term user memory as relocatable pre-RoPE KV, injected into vLLM.

The library never imports Prefect; ``flows/`` and ``tasks/`` wrap it.
"""

__version__ = "0.1.0"
