"""Moving device buffers over an MPI that is not CUDA-aware: through host blocks, copies overlapping sends.

The sender copies frame ``i + 1`` out of the device into one host block
while frame ``i`` is on the wire from another (``nbuf`` blocks, pinned
when CuPy is there: device-to-host copies from pageable memory are slower
and synchronous); the receiver has frame ``i + 1``'s receive posted while
it copies frame ``i`` into the device. Frames are the same ``(pos, n)``
plan as host transfers (``tags.frames``), frame ``i`` on communicator
``i % len(comms)``, so either side may stage or not independently. An
empty plan sends nothing: a zero-length buffer never reaches MPI or CUDA.

The copy functions are plain callables over host blocks, so the pipeline
itself is tested on host buffers (``tests/mpi``).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

__all__ = ["host_blocks", "send_staged", "recv_staged"]

Frame = tuple[int, int]


def host_blocks(count: int, size: int) -> list[np.ndarray]:
    """``count`` host blocks of ``size`` bytes: page-locked when CuPy is loaded, else ordinary memory."""
    import sys
    cupy = sys.modules.get("cupy")
    if cupy is None or size == 0:
        return [np.empty(size, np.uint8) for _ in range(count)]
    return [np.frombuffer(cupy.cuda.alloc_pinned_memory(size), np.uint8, size) for _ in range(count)]


def send_staged(comms: Sequence[Any], dest: int, tag: int, plan: Sequence[Frame],
                copy_out: Callable[[int, int, np.ndarray], None], nbuf: int = 2,
                blocks: list[np.ndarray] | None = None) -> None:
    """Send the frames of ``plan``, each filled into a host block by ``copy_out(pos, n, block)`` first.

    Raises:
        MPI.Exception: a send failed (outstanding sends are waited for first).
    """
    if not plan:
        return
    size = max(n for _, n in plan)
    blocks = blocks or host_blocks(nbuf, size)
    pending: list[Any] = [None] * len(blocks)
    try:
        for i, (pos, n) in enumerate(plan):
            j = i % len(blocks)
            if pending[j] is not None:
                pending[j].Wait()  # the block is free again
                pending[j] = None
            copy_out(pos, n, blocks[j][:n])
            pending[j] = comms[i % len(comms)].Isend([blocks[j][:n], MPI.BYTE], dest=dest, tag=tag)
    finally:
        MPI.Request.Waitall([r for r in pending if r is not None])


def recv_staged(comm: Any, source: int, tag: int, frames: Sequence[Frame],
                copy_in: Callable[[int, int, np.ndarray], None], nbuf: int = 2,
                blocks: list[np.ndarray] | None = None) -> None:
    """Receive ``frames`` (in order, on ``comm``) into host blocks, handing each to ``copy_in(pos, n, block)``
    while the next ones are already being received.

    Raises:
        MPI.Exception: a receive failed.
    """
    if not frames:
        return
    size = max(n for _, n in frames)
    blocks = blocks or host_blocks(nbuf, size)
    nb = len(blocks)
    reqs: list[Any] = [None] * nb
    try:
        for i in range(min(nb, len(frames))):
            reqs[i] = comm.Irecv([blocks[i][:frames[i][1]], MPI.BYTE], source=source, tag=tag)
        for i, (pos, n) in enumerate(frames):
            j = i % nb
            reqs[j].Wait()
            reqs[j] = None
            copy_in(pos, n, blocks[j][:n])
            k = i + nb
            if k < len(frames):
                reqs[j] = comm.Irecv([blocks[j][:frames[k][1]], MPI.BYTE], source=source, tag=tag)
    finally:
        live = [r for r in reqs if r is not None]
        if live:  # an error half way: do not leave receives posted into blocks about to be freed
            for r in live:
                r.Cancel()
            MPI.Request.Waitall(live)
