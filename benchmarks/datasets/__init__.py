"""The benchmarks' inputs: LoCoMo conversations and their questions
(:mod:`benchmarks.datasets.locomo`), and many users built from their turns
(:mod:`benchmarks.datasets.users`)."""
