"""The fused injection kernels: :class:`~inferscale.vllm_plugin.kernels.writer.FusedWriter`
is the one entry point (it picks, checks and runs a kernel); the Triton kernel for CUDA
(:mod:`~inferscale.vllm_plugin.kernels.cuda`) and the Numba kernel for CPU
(:mod:`~inferscale.vllm_plugin.kernels.cpu`, :mod:`~inferscale.vllm_plugin.kernels.cpu_jit`)
sit beside it.
"""
