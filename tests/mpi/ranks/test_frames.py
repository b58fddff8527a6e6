"""How a rank waits for a transfer's frames (``poll.settle``) where it naps between its tests (ranks outnumber
cores, as in this suite's 4 ranks on 2 cores): MPICH copies a large message over CMA a piece per test, in the
receiver's own test calls, so a nap after each piece made a fetch crawl (0.2x the raw speed). A test that moved
bytes is followed by the next one at once; only tests that found nothing to do nap."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from shmstore.mpi import poll

MiB = 1 << 20


def test_a_large_frame_already_offered_is_taken_without_a_nap_per_piece(comm, monkeypatch):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    sender, receiver = 0, comm.size - 1  # one rank on each node
    hosts = comm.allgather(os.uname().nodename)
    if hosts[sender] != hosts[receiver]:  # every rank decides alike
        pytest.skip("nodes apart: over TCP the sender's own tests move the bytes too; this checks the copy a "
                    "receiver makes alone (CMA, ranks of one host)")
    raw = comm.Dup()
    try:
        size = 16 * MiB
        if comm.rank == sender:
            data = np.arange(size // 8, dtype=np.int64)
            req = raw.Isend(data, dest=receiver, tag=7)
            raw.Barrier()
            assert poll.settle([req], 60.0, False, 1e-3, 1e-3)
        elif comm.rank == receiver:
            into = np.zeros(size // 8, np.int64)
            me, naps = threading.get_ident(), []
            sleep = time.sleep

            def counted(seconds: float) -> None:
                if threading.get_ident() == me:
                    naps.append(seconds)
                sleep(seconds)

            raw.Barrier()
            deadline = time.monotonic() + 30
            while not raw.Iprobe(source=sender, tag=7):  # the sender's offer is here
                assert time.monotonic() < deadline
                sleep(1e-3)
            req = raw.Irecv(into, source=sender, tag=7)
            monkeypatch.setattr(poll.time, "sleep", counted)
            try:
                # naps of 1 ms: one after each 512 KiB piece would be 31 of them
                assert poll.settle([req], 60.0, False, 1e-3, 1e-3)
            finally:
                monkeypatch.undo()
            assert np.array_equal(into, np.arange(size // 8, dtype=np.int64))
            assert len(naps) <= 3, f"{len(naps)} naps while the frame's pieces were copied"
        else:
            raw.Barrier()
    finally:
        raw.Barrier()
        raw.Free()
