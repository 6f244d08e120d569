"""The CPU injection kernel (Numba): rotated K and V of every layer into vLLM-CPU's cache.

Imported only by :class:`inferscale.vllm_plugin.kernels.writer.FusedWriter` on a CPU
engine, through :func:`load`; the kernel's code (:mod:`~inferscale.vllm_plugin.kernels.cpu_jit`)
is compiled on first use and cached by Numba next to it (or in ``NUMBA_CACHE_DIR``).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator


def process_cpus() -> set[int]:
    """CPUs any thread of this process may run on (vLLM pins its worker's main thread to
    one core and its OpenMP threads to the others it was given)."""
    cpus: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            cpus |= os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return cpus or os.sched_getaffinity(0)


@contextmanager
def _widened_affinity() -> Iterator[set[int]]:
    """Let the calling thread (and the threads it starts) use all of the process's CPUs,
    then restore its own pinning."""
    mine = os.sched_getaffinity(0)
    cpus = process_cpus()
    os.sched_setaffinity(0, cpus)
    try:
        yield cpus
    finally:
        os.sched_setaffinity(0, mine)


def load(warm_up: Any) -> Any:
    """Import Numba and the kernel, running it on torch's own OpenMP threads.

    Numba's ``omp`` layer uses the process's libgomp, which is torch's: the kernel's
    parallel loop runs on the same thread team as the forward pass (a separate pool, such
    as Numba's workqueue, competes with torch's threads spinning between regions:
    measured 13 ms alone vs 37-64 ms inside the engine). Its thread count is set to
    torch's (Numba sets the shared team's size, so anything else would change the
    forward pass too); Numba is imported while the calling thread may use all of the
    process's CPUs, because it caps its thread count at the importing thread's affinity
    and vLLM pins the worker's main thread to one core.
    """
    import torch

    with _widened_affinity():
        import numba

        numba.config.THREADING_LAYER = "omp"
        numba.set_num_threads(max(1, min(torch.get_num_threads(),
                                         numba.config.NUMBA_NUM_THREADS)))
    from inferscale.vllm_plugin.kernels import cpu_jit

    # dynamic chunks of (layer, tile) units: a thread that loses its core for a moment
    # (the engine process polls for the step's result) does not hold up the step
    numba.set_parallel_chunksize(16)
    warm_up(cpu_jit.inject_kernel)
    if numba.threading_layer() != "omp":
        raise RuntimeError(f"Numba's threading layer is {numba.threading_layer()}, not omp")
    return cpu_jit.inject_kernel
