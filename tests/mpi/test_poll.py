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


def test_service_idle_nap_is_short_only_where_a_core_is_spare(monkeypatch):
    """An idle node service probes every 50 us where the host has a core to spare (a request after a pause is
    answered within ~100 us), every 1 ms where ranks fill the cores; SHMSTORE_SERVICE_IDLE_US decides where set."""
    import os

    from shmstore import config
    from shmstore.errors import ConfigError
    from shmstore.mpi.poll import idle_nap
    monkeypatch.delenv("SHMSTORE_SERVICE_IDLE_US", raising=False)
    cores = os.cpu_count() or 1
    assert idle_nap(cores) == pytest.approx(1e-3) and idle_nap(cores + 3) == pytest.approx(1e-3)
    if cores > 1:
        assert idle_nap(cores - 1) == pytest.approx(50e-6)
    monkeypatch.setenv("SHMSTORE_SERVICE_IDLE_US", "200")
    assert config.service_idle() == pytest.approx(200e-6) and idle_nap(cores + 3) == pytest.approx(200e-6)
    for bad in ("-5", "1e7", "soon"):
        monkeypatch.setenv("SHMSTORE_SERVICE_IDLE_US", bad)
        with pytest.raises(ConfigError, match="SHMSTORE_SERVICE_IDLE_US"):
            idle_nap(1)
