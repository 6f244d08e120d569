"""The load benchmark's parts (``python -m benchmarks.load``): its setup and command
line, users' tiers and the rates it runs, its client, its server process and the
server's /metrics, the storage bandwidth under the store, profiles, statistics and
goodput, and the peer (stock vLLM)."""
