"""What the benchmarks share: result files, model shapes, benchmark memories, prompts
composed outside the request path, answer scores, LoCoMo variants and reports, and the
load benchmark's parts (:mod:`benchmarks.lib.load`)."""
