"""One OpenMP team in the process, so the engine's threads spin between kernel calls.

The kernels (qgemm.c, fused_layer.c, rowgemm.c, span_attention.c) and PyTorch share one
OpenMP runtime, PyTorch's libgomp. It keeps a team of worker threads for each thread that
opens a parallel region, for as long as that thread lives. While the teams hold no more
threads than the machine has CPUs, a worker spin-waits between regions; past that, libgomp
throttles the spin to a few iterations, and every region wakes its workers through the
operating system's scheduler instead. A decode pass is a few hundred kernel calls, each a
region: with two teams on a 2-core CPU (a model loaded on the main thread, then run on the
server's worker thread), that was ~2 voluntary context switches a region and 15-25% of the
decode time.

So the thread that builds an engine lets go of its team when the build ends
(`release_thread_team`, OpenMP 5.0's omp_pause_resource_all): whichever thread runs the
engine next holds the only team. Where the runtime is not libgomp, or lacks the call, nothing
is released.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from functools import cache

OMP_PAUSE_SOFT = 1  # omp_pause_soft: the calling thread's pool ends; a later region makes one


@cache
def _pause_resource_all() -> Callable[[int], int] | None:
    """libgomp's omp_pause_resource_all, where the process has already loaded libgomp."""
    try:
        runtime = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)  # PyTorch's, if loaded
        pause = runtime.omp_pause_resource_all
    except (OSError, AttributeError):  # another runtime, or a libgomp older than OpenMP 5.0
        return None
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause


def release_thread_team() -> bool:
    """End the calling thread's OpenMP team (its workers exit; its next parallel region makes
    a new one). True where the runtime did so."""
    pause = _pause_resource_all()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
