"""The probe loop (mpi/poll.py): the C prober of its own extension (``_probe.c``) where built, the Python one
under SHMSTORE_PURE_PYTHON; both say False when nothing comes within the limit and True once a message waits.
On COMM_SELF: runs at any rank count."""
from __future__ import annotations

import pytest
from mpi4py import MPI

from shmstore.mpi import poll


@pytest.mark.parametrize("pure", [False, True])
def test_a_prober_finds_a_waiting_message_and_gives_up_after_its_limit(monkeypatch, pure):
    monkeypatch.setenv("SHMSTORE_PURE_PYTHON", "1" if pure else "0")
    if pure:
        assert poll._probe_wait() is None
    comm = MPI.COMM_SELF.Dup()
    try:
        probe = poll.prober(comm)
        assert probe(MPI.ANY_SOURCE, 5, 0.0, 1e-4, 0.01) is False
        req = comm.isend(b"x", dest=0, tag=5)
        assert probe(MPI.ANY_SOURCE, 5, 1e-4, 1e-4, 5.0, 1e-3) is True
        assert comm.recv(source=0, tag=5) == b"x"
        req.wait()
    finally:
        comm.Free()


def test_the_kernel_extension_knows_no_mpi():
    fast = pytest.importorskip("shmstore.kernel._fast")
    assert not hasattr(fast, "probe_wait")
