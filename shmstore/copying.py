"""Bulk copies into shared memory, split over threads when large.

One thread's memcpy does not saturate memory bandwidth; ``np.copyto``
releases the GIL, so a large copy split into a few chunks on a small pool of
threads runs faster (Ray's store does the same). Copies below
``PARALLEL_MIN`` stay on the calling thread.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["copy_into", "copy_many", "PARALLEL_MIN"]

PARALLEL_MIN = 16 << 20
_NTHREADS = max(1, min(4, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_pool_pid = 0


def _get_pool() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(_NTHREADS - 1, thread_name_prefix="shmstore-copy")
            _pool_pid = os.getpid()
        return _pool


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    step = -(-n // parts)
    step = (step + 4095) & ~4095
    return [(i, min(n, i + step)) for i in range(0, n, step)]


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst`` (same shape); parallel for large contiguous arrays."""
    n = src.nbytes
    if n < PARALLEL_MIN or _NTHREADS == 1 or not _flat_ok(dst, src):
        np.copyto(dst, src, casting="no")
        return
    d = dst.ravel(order="K").view(np.uint8)
    s = src.ravel(order="K").view(np.uint8)
    spans = _chunks(n, _NTHREADS)
    futures = [_get_pool().submit(np.copyto, d[a:b], s[a:b]) for a, b in spans[1:]]
    a, b = spans[0]
    np.copyto(d[a:b], s[a:b])
    for f in futures:
        f.result()


def copy_many(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Copy each ``(dst, src)`` pair of flat uint8 arrays; shares large totals among threads."""
    total = sum(s.nbytes for _, s in pairs)
    if total < PARALLEL_MIN or _NTHREADS == 1:
        for d, s in pairs:
            np.copyto(d, s)
        return
    big = [(d, s) for d, s in pairs if s.nbytes >= PARALLEL_MIN]
    small = [(d, s) for d, s in pairs if s.nbytes < PARALLEL_MIN]
    groups: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(_NTHREADS)]
    sizes = [0] * _NTHREADS
    for d, s in sorted(small, key=lambda p: -p[1].nbytes):
        i = sizes.index(min(sizes))
        groups[i].append((d, s))
        sizes[i] += s.nbytes
    futures = [_get_pool().submit(_copy_group, g) for g in groups[1:] if g]
    _copy_group(groups[0])
    for d, s in big:
        copy_into(d, s)
    for f in futures:
        f.result()


def _copy_group(group: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for d, s in group:
        np.copyto(d, s)


def _flat_ok(dst: np.ndarray, src: np.ndarray) -> bool:
    both_c = dst.flags.c_contiguous and src.flags.c_contiguous
    both_f = dst.flags.f_contiguous and src.flags.f_contiguous
    return (both_c or both_f) and dst.dtype == src.dtype
