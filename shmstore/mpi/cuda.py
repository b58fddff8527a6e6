"""Is the MPI library CUDA-aware? Asked once, overridable.

``MPIX_Query_cuda_support()`` (MPICH and Open MPI both export it) answers
for the library this process has loaded: found through ctypes, first in
the process's global symbols, then in each ``libmpi*`` mapped into it
(``/proc/self/maps``). ``SHMSTORE_CUDA_AWARE=1`` or ``0`` overrides the
answer (a site whose MPI is CUDA-aware but does not export the query, or
to force staging); ``auto`` (or unset) asks. Neither pip wheel of MPICH or
Open MPI is CUDA-aware: device buffers are then staged through pinned host
memory (``staging.py``).
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable

from ..config import cuda_aware_override

__all__ = ["cuda_aware", "query_mpi", "mpi_libraries"]

_ANSWER: list[bool] = []


def mpi_libraries(maps: Iterable[str]) -> list[str]:
    """Paths of the MPI libraries among the lines of a ``/proc/<pid>/maps`` file, in order, once each."""
    out: list[str] = []
    for line in maps:
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        name = os.path.basename(path)
        if name.startswith("libmpi") and ".so" in name and path not in out:
            out.append(path)
    return out


def query_mpi() -> bool:
    """What the loaded MPI library says (``MPIX_Query_cuda_support() != 0``); False if it cannot say."""
    candidates: list[ctypes.CDLL] = [ctypes.CDLL(None)]
    try:
        with open("/proc/self/maps") as f:
            paths = mpi_libraries(f)
    except OSError:
        paths = []
    for path in paths:
        try:
            candidates.append(ctypes.CDLL(path))
        except OSError:
            continue
    for lib in candidates:
        fn = getattr(lib, "MPIX_Query_cuda_support", None)
        if fn is not None:
            fn.restype, fn.argtypes = ctypes.c_int, []
            return bool(fn())
    return False


def cuda_aware() -> bool:
    """Whether device buffers may go straight to MPI here (asked once per process; after MPI_Init)."""
    if not _ANSWER:
        forced = cuda_aware_override()
        _ANSWER.append(forced if forced is not None else query_mpi())
    return _ANSWER[0]
