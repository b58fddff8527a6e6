"""Bulk copies into shared memory, split over threads when large.

One thread's memcpy does not saturate memory bandwidth, so a large copy is
split into a few parts on a small pool of threads (Ray's store does the
same). The copies themselves run in the optional C helper ``_copy`` where it
was built: it releases the GIL and writes pieces of 64 KiB and more with
non-temporal stores, which matters for objects of many mid-sized blobs (a
state dict's arrays are too small for glibc's memcpy to stream them). Without
it, ``np.copyto`` does the copies (it releases the GIL too).
``SHMSTORE_PURE_PYTHON=1`` disables the helper, like the kernel's fast path.

Copies below ``PARALLEL_MIN`` bytes in all stay on the calling thread.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..config import pure_python

__all__ = ["copy_into", "copy_blobs", "PARALLEL_MIN", "STREAM_MIN"]

PARALLEL_MIN = 16 << 20
STREAM_MIN = 64 << 10  # the C helper's streaming-store threshold: below it, plain np.copyto
_NTHREADS = max(1, min(4, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_pool_pid = 0


def _load_helper() -> Any:
    if pure_python():
        return None
    try:
        from . import _copy  # type: ignore[attr-defined]  # built by setup.py where a compiler is
    except ImportError:
        return None
    return _copy


_helper = _load_helper()


def _get_pool() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(_NTHREADS - 1, thread_name_prefix="shmstore-copy")
            _pool_pid = os.getpid()
        return _pool


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst`` (same shape and dtype); parallel for large contiguous arrays."""
    if src.nbytes < STREAM_MIN or not _flat_ok(dst, src):
        np.copyto(dst, src, casting="no")
        return
    d = dst.ravel(order="K").view(np.uint8)
    s = src.ravel(order="K").view(np.uint8)
    n = s.nbytes
    if not n:
        return
    parts = _NTHREADS if n >= PARALLEL_MIN else 1
    step = (-(-n // parts) + 4095) & ~4095
    copy_blobs(d, [(a, s[a: a + step]) for a in range(0, n, step)])


def copy_blobs(dst: np.ndarray, items: Sequence[tuple[int, Any]]) -> None:
    """Copy each ``(offset, buffer)`` of ``items`` into the flat uint8 array ``dst`` at ``offset``.

    Buffers are C-contiguous (bytes, memoryviews, arrays); large totals are
    shared among threads, each taking a similar number of bytes.
    """
    sizes = [memoryview(b).nbytes for _, b in items]
    total = sum(sizes)
    if total < PARALLEL_MIN or _NTHREADS == 1 or len(items) == 1:
        _copy_group(dst, items)
        return
    groups: list[list[tuple[int, Any]]] = [[] for _ in range(_NTHREADS)]
    loads = [0] * _NTHREADS
    for i in sorted(range(len(items)), key=sizes.__getitem__, reverse=True):
        g = loads.index(min(loads))
        groups[g].append(items[i])
        loads[g] += sizes[i]
    futures = [_get_pool().submit(_copy_group, dst, g) for g in groups[1:] if g]
    try:
        _copy_group(dst, groups[0])
    finally:
        for f in futures:
            f.result()


def _copy_group(dst: np.ndarray, items: Sequence[tuple[int, Any]]) -> None:
    if _helper is not None:
        _helper.copy_blobs(dst, items)
        return
    for off, b in items:
        src = np.frombuffer(b, np.uint8)
        np.copyto(dst[off: off + src.nbytes], src)


def _flat_ok(dst: np.ndarray, src: np.ndarray) -> bool:
    both_c = dst.flags.c_contiguous and src.flags.c_contiguous
    both_f = dst.flags.f_contiguous and src.flags.f_contiguous
    return (both_c or both_f) and dst.dtype == src.dtype and dst.shape == src.shape
