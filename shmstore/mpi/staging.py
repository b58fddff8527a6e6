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
itself is tested on host buffers (``tests/mpi/ranks``). ``wait`` waits for a list
of requests; the cluster's raises ``TransferError`` when the peer sends or
takes nothing for ``peer_timeout`` seconds (a dead rank), leaving the
requests live: the blocks of requests given up on are kept until MPI is
done with them (``abandon.py``), as MPI may still read or write them.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .abandon import give_up

__all__ = ["host_blocks", "send_staged", "recv_staged"]

Frame = tuple[int, int]
Wait = Callable[[list[Any]], object]


def host_blocks(count: int, size: int) -> list[np.ndarray]:
    """``count`` host blocks of ``size`` bytes: page-locked when CuPy is loaded, else ordinary memory."""
    import sys
    cupy = sys.modules.get("cupy")
    if cupy is None or size == 0:
        return [np.empty(size, np.uint8) for _ in range(count)]
    return [np.frombuffer(cupy.cuda.alloc_pinned_memory(size), np.uint8, size) for _ in range(count)]


def send_staged(comms: Sequence[Any], dest: int, tag: int, plan: Sequence[Frame],
                copy_out: Callable[[int, int, np.ndarray], None], nbuf: int = 2,
                blocks: list[np.ndarray] | None = None, wait: Wait = MPI.Request.Waitall) -> None:
    """Send the frames of ``plan``, each filled into a host block by ``copy_out(pos, n, block)`` first.

    Raises:
        MPI.Exception: a send failed (outstanding sends are waited for first).
        TransferError: from ``wait``: the receiver took nothing for too long.
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
                wait([pending[j]])  # the block is free again
                pending[j] = None
            copy_out(pos, n, blocks[j][:n])
            pending[j] = comms[i % len(comms)].Isend([blocks[j][:n], MPI.BYTE], dest=dest, tag=tag)
        wait([r for r in pending if r is not None])
        pending = []
    finally:
        _let_go([r for r in pending if r is not None], blocks)


def recv_staged(comm: Any, source: int, tag: int, frames: Sequence[Frame],
                copy_in: Callable[[int, int, np.ndarray], None], nbuf: int = 2,
                blocks: list[np.ndarray] | None = None, wait: Wait = MPI.Request.Waitall) -> None:
    """Receive ``frames`` (in order, on ``comm``) into host blocks, handing each to ``copy_in(pos, n, block)``
    while the next ones are already being received.

    Raises:
        MPI.Exception: a receive failed.
        TransferError: from ``wait``: the sender sent nothing for too long.
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
            wait([reqs[j]])
            reqs[j] = None
            copy_in(pos, n, blocks[j][:n])
            k = i + nb
            if k < len(frames):
                reqs[j] = comm.Irecv([blocks[j][:frames[k][1]], MPI.BYTE], source=source, tag=tag)
    # an error half way: do not leave receives posted into blocks about to be freed
    finally:
        _let_go([r for r in reqs if r is not None], blocks)


def _let_go(live: list[Any], blocks: list[np.ndarray]) -> None:
    """Give up the requests ``live`` left after an error: ``blocks`` stay allocated until MPI is done with
    every one of them (cancelled, or completed: a late peer's frame; see ``abandon.py``)."""
    if live:
        give_up(live, keep=blocks)
