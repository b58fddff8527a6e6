"""The probe loop (mpi/poll.py): the C prober of its own extension (``_probe.c``) where built, the Python one
under SHMSTORE_PURE_PYTHON; both say False when nothing comes within the limit and True once a message waits.
On COMM_SELF: runs at any rank count."""
from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time

import pytest
from mpi4py import MPI

from shmstore.mpi import poll
from shmstore.mpi.doorbell import Doorbell

from helpers import wait_for


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


@pytest.mark.parametrize("pure", [False, True])
def test_a_ring_cuts_a_probers_nap_short_and_keeps_it_probing_for_the_rings_window(monkeypatch, pure):
    """A node service's naps are sleeps on its doorbell too: a request sent during a nap of 10 minutes is seen
    when its sender rings, and a ring with no message yet keeps the prober looking for the ring's window
    (the message may come after its ring), past the limit it was given; every ring is taken by the wake."""
    monkeypatch.setenv("SHMSTORE_PURE_PYTHON", "1" if pure else "0")
    comm = MPI.COMM_SELF.Dup()
    bell = Doorbell()
    reqs = []
    try:
        probe = poll.prober(comm)
        ring = poll.Ring(bell.sock.fileno(), 0.0, 1e-4, 1e-3, 0.3)

        def send_then_ring() -> None:
            time.sleep(0.05)  # the prober is asleep by now (or soon: the ring waits in the socket for it)
            reqs.append(comm.isend(b"x", dest=0, tag=6))
            bell.ring_self()
            bell.ring_self()

        t = threading.Thread(target=send_then_ring)
        start = time.monotonic()
        t.start()
        assert probe(MPI.ANY_SOURCE, 6, 0.0, 600.0, 1200.0, ring=ring) is True
        assert time.monotonic() - start < 60  # the ring, not the 600 s nap's end
        t.join(30)
        assert comm.recv(source=0, tag=6) == b"x"
        while select.select([bell.sock], [], [], 0)[0]:  # the second ring, where it came after the wake
            bell.sock.recv(64)
        bell.ring_self()  # two rings and no message: both taken by one wake, then probed for the ring's 0.3 s,
        bell.ring_self()  # past the 10 ms limit
        start = time.monotonic()
        assert probe(MPI.ANY_SOURCE, 6, 0.0, 600.0, 0.01, ring=ring) is False
        assert 0.3 <= time.monotonic() - start < 60
        assert not select.select([bell.sock], [], [], 0)[0]
    finally:
        for r in reqs:
            r.wait()
        bell.close()
        comm.Free()


def test_the_kernel_extension_knows_no_mpi():
    fast = pytest.importorskip("shmstore.meta._fast")
    assert not hasattr(fast, "probe_wait")


def test_service_idle_nap_is_short_only_where_a_core_is_spare(monkeypatch):
    """An idle node service probes every 50 us where the host has a core to spare (a request after a pause is
    answered within ~100 us), every 1 ms where ranks fill the cores; SHMSTORE_SERVICE_IDLE_US decides where set."""

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


def _fed(gaps: list[float]) -> poll.Pace:
    pace, t = poll.Pace(), 100.0
    for g in gaps:
        t += g
        pace.request(t)
    return pace


def test_a_service_keeps_short_naps_while_requests_stream_and_drops_them_soon_after_one_burst():
    # a loop of remote gets whose requests reach this node every 6 ms: the window grows past the gap
    assert _fed([0.006] * 20).window > 0.006 * 4
    # one fetch (a few requests within a ms) after seconds of silence: the window closes within 5 ms, so
    # that the application computing next is not probed beside 5,000 times a second for long
    assert _fed([10.0, 0.0003, 0.0005, 0.001]).window == pytest.approx(0.005, rel=0.1)
    # sporadic requests (100 ms or 30 ms apart, the application computing between them): never a stream
    assert _fed([0.1] * 10).window == _fed([0.03] * 10).window == 0.005
    # a stream that stops and comes back after a silence starts over
    assert _fed([0.006] * 20 + [5.0]).window == 0.005
    # however fast the stream, the window is at least the floor; however slow, at most the ceiling
    assert _fed([1e-5] * 50).window == 0.005 and _fed([0.019] * 200).window <= 0.5


def test_an_mpi_error_in_the_c_prober_is_mpis_own_and_the_call_names_node_rank_and_error(monkeypatch):
    """Issue 35 item 7: under Open MPI's fault tolerance a survivor's get failed with 'MPI_Iprobe failed with
    error code 75', naming no node, rank or MPI error; the fast prober now raises MPI's own error, which a
    call's handler (``except MPI.Exception``: ``Messenger.failed``) turns into a TransferError naming them, as
    the pure-Python prober's error always was."""
    from shmstore.mpi import wire as W
    from shmstore.mpi.rpc import Messenger
    code = getattr(MPI, "ERR_PROC_FAILED", MPI.ERR_OTHER)
    monkeypatch.setattr(poll, "_probe_wait", lambda: (lambda *args: -code))
    monkeypatch.setattr(poll, "_iprobe_address", lambda: 1)
    with pytest.raises(MPI.Exception) as err:
        poll.prober(MPI.COMM_SELF)(MPI.ANY_SOURCE, 1, 0.0, 1e-5, 0.01)
    assert err.value.Get_error_code() == code
    msg = Messenger(MPI.COMM_SELF, ["n7"], [3], 0.0, timeout=5.0)
    failed = msg.failed(0, W.DirGet([]), None, err.value)
    assert "node 'n7' (rank 3): MPI failed in a dir get request" in str(failed) and failed.peer == 3
    assert MPI.Get_error_string(code).splitlines()[0].strip() in str(failed)


def test_a_ring_says_whether_it_came_from_the_sleepers_own_cpu():
    """A ring carries its machine's kernel id and the ringing thread's CPU (doorbell.Bells.sent); the C prober
    tells a ring from the CPU it runs on (a loopback ring wakes the service there: the service then naps at once
    after answering, leaving that core to the rank that waits for the answer) from any other."""
    import socket
    import struct

    _probe = pytest.importorskip("shmstore.mpi._probe")
    from shmstore.mpi.doorbell import kernel_id
    from shmstore.primitives.native import current_cpu

    assert _probe.kernel_id() == kernel_id() != 0  # the C and Python sides agree on this machine's id
    bell = Doorbell()
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    try:
        os.sched_setaffinity(0, {cpu})  # this thread rings and takes the rings on one CPU
        assert current_cpu() == cpu

        def rings(*payloads: bytes):
            for p in payloads:
                out.sendto(p, ("127.0.0.1", bell.port))
            select.select([bell.sock], [], [], 5.0)
            time.sleep(0.01)  # every datagram in
            return _probe.take_rings(bell.sock.fileno())

        assert rings(struct.pack("=II", kernel_id(), cpu)) == (1, True)
        assert rings(struct.pack("=II", kernel_id(), cpu + 1)) == (1, False)  # another CPU
        assert rings(struct.pack("=II", kernel_id() ^ 1, cpu)) == (1, False)  # another machine
        assert rings(b"!", b"junk of another length") == (2, False)  # a bare ring, a stray datagram
        assert rings(b"!", struct.pack("=II", kernel_id(), cpu)) == (2, True)
        assert _probe.take_rings(bell.sock.fileno()) == (0, False)  # nothing left
    finally:
        os.sched_setaffinity(0, allowed)
        out.close()
        bell.close()


@pytest.mark.parametrize("pure", [False, True])
def test_a_service_has_a_short_gil_switch_interval_only_while_it_wants_the_gil_and_the_applications_own_stays(
        monkeypatch, pure):
    """poll.Urgency and the prober's ``urgent``: a node service gets the GIL from a main thread computing in Python
    within ``urgent``, and the application's interval is back once the service is idle. The C prober (Python
    before 3.12) lowers it from where it takes the GIL back, a request or not, and gives it back as it lets the
    GIL go for its next wait; elsewhere :meth:`Urgency.on` lowers it. An interval the application set meanwhile,
    or a shorter one of its own, stays; a child forked while it is lowered has the application's at once."""
    monkeypatch.setenv("SHMSTORE_PURE_PYTHON", "1" if pure else "0")
    before = sys.getswitchinterval()
    comm = MPI.COMM_SELF.Dup()
    try:
        sys.setswitchinterval(0.005)
        probe = poll.prober(comm)
        urgency = poll.Urgency(100e-6, native=poll.native(probe))
        assert urgency.native is (not pure and sys.version_info < (3, 12))

        def lower() -> None:  # as the service meets a request: the prober took the GIL back, then on()
            assert probe(MPI.ANY_SOURCE, 5, 0.0, 1e-4, 0.001, urgent=100e-6) is False
            urgency.on()

        assert probe(MPI.ANY_SOURCE, 5, 0.0, 1e-4, 0.01, urgent=100e-6) is False
        if urgency.native:  # the GIL taken back after an idle wait at the short interval too
            assert sys.getswitchinterval() == pytest.approx(100e-6)
            found: list[bool] = []
            waiting = threading.Thread(target=lambda: found.append(probe(MPI.ANY_SOURCE, 5, 0.0, 1e-3, 120.0,
                                                                         urgent=1e-4)))
            waiting.start()
            # while it waits: the application's (only the waiting prober gives it back)
            assert wait_for(lambda: abs(sys.getswitchinterval() - 0.005) < 1e-7, timeout=60)
            req = comm.isend(b"y", dest=0, tag=5)
            waiting.join(120)
            assert found == [True] and sys.getswitchinterval() == pytest.approx(100e-6)  # it took the GIL back
            assert comm.recv(source=0, tag=5) == b"y"
            req.wait()
        urgency.off()  # idle: given back at once
        assert sys.getswitchinterval() == pytest.approx(0.005)
        req = comm.isend(b"x", dest=0, tag=5)
        assert probe(MPI.ANY_SOURCE, 5, 0.0, 1e-4, 5.0, urgent=100e-6) is True
        urgency.on()
        assert sys.getswitchinterval() == pytest.approx(100e-6)
        assert comm.recv(source=0, tag=5) == b"x"
        req.wait()
        lower()  # the next request: still lowered, the application's interval still known
        urgency.off()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        lower()
        sys.setswitchinterval(0.002)  # the application's, while lowered: kept
        urgency.off()
        assert sys.getswitchinterval() == pytest.approx(0.002)
        sys.setswitchinterval(50e-6)  # shorter than the service's: never raised
        lower()
        assert sys.getswitchinterval() == pytest.approx(50e-6)
        urgency.off()
        assert sys.getswitchinterval() == pytest.approx(50e-6)
        sys.setswitchinterval(0.005)
        lower()
        pid = os.fork()  # a child forked while lowered (no service of its own): the application's at once
        if pid == 0:
            os._exit(0 if abs(sys.getswitchinterval() - 0.005) < 1e-7 else 1)
        deadline, status = time.monotonic() + 60, None
        while status is None and time.monotonic() < deadline:
            done, code = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(code) if done else None
            time.sleep(0.01)
        if status is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert status == 0, "the forked child kept the lowered interval"
        assert sys.getswitchinterval() == pytest.approx(100e-6)  # the parent's service still wants the GIL
        urgency.off()
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)
        comm.Free()


# a child whose second thread (not its main one) spins on CPU %d for at most 300 s, and says its thread id first
_SPIN = ("import os, threading, time\n"
         "def run():\n"
         "    os.sched_setaffinity(0, {%d})\n"
         "    print(threading.get_native_id(), flush=True)\n"
         "    end = time.monotonic() + 300\n"
         "    while time.monotonic() < end: pass\n"
         "t = threading.Thread(target=run); t.start(); t.join()")


def _child(code: str, procs: list[subprocess.Popen]) -> tuple[subprocess.Popen, int]:
    """``python -c code``, kept in ``procs`` (see :func:`_kill`), and the number it prints first."""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    procs.append(p)
    return p, int(p.stdout.readline())


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait(60)
        p.stdout.close()


def test_a_spin_moves_off_the_cpu_its_partner_waits_for_where_another_idles(monkeypatch):
    """Where the partner waits to run on the spinner's CPU and another CPU the spinner may use idles, the spinner
    moves there (the kernel left an asker and the holder's service side by side on one core for 60 gets in a
    row, the other core idle), and its affinity is its own again after. It stays (and naps) where every CPU is
    busy (a thread of this test spins on each), with ``SHMSTORE_PARTNER_HOP=0``, and where its affinity holds
    one CPU (a launcher's binding). Whether a CPU idles otherwise depends on the machine's other work (the
    suite may run twice at once), so the move itself is checked with that question skipped (``set_hop(2)``)."""
    import ctypes

    _probe = pytest.importorskip("shmstore.mpi._probe")
    monkeypatch.setenv("SHMSTORE_PURE_PYTHON", "0")
    sched_getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    procs: list[subprocess.Popen] = []
    comm = MPI.COMM_SELF.Dup()

    def spin_once(probe, mask: set[int]) -> tuple[int, int, int]:
        """(hops, naps, the CPU after) of one 50 ms spin begun on ``cpu`` beside the partner, free to use
        ``mask``."""
        os.sched_setaffinity(0, {cpu})  # onto the partner's CPU ...
        os.sched_setaffinity(0, mask)  # ... free to leave it (a mask holding this CPU moves nothing)
        hops, naps = _probe.partner_hops(), _probe.partner_naps()
        assert probe(MPI.ANY_SOURCE, 7, 0.05, 1e-4, 0.05, partner=here) is False
        assert os.sched_getaffinity(0) == mask, "the spin left this thread's affinity changed"
        return _probe.partner_hops() - hops, _probe.partner_naps() - naps, sched_getcpu()

    try:
        here = _child(_SPIN % cpu, procs)[1]  # spinning on ``cpu`` from now on
        probe = poll.prober(comm)
        assert poll.native(probe)
        # bound to one CPU: nowhere to go, it naps
        hops, naps, _ = spin_once(probe, {cpu})
        assert hops == 0 and naps >= 1
        if len(allowed) > 1:
            _probe.set_hop(2)  # the move, whatever the machine's other work
            hops, naps, now = spin_once(probe, allowed)
            assert hops >= 1 and now != cpu, f"hops {hops}, naps {naps}, on CPU {now} (the partner's: {cpu})"
            monkeypatch.setenv("SHMSTORE_PARTNER_HOP", "0")
            probe = poll.prober(comm)  # (it sets the hop from the setting again)
            hops, naps, _ = spin_once(probe, allowed)
            assert hops == 0 and naps >= 1
            monkeypatch.delenv("SHMSTORE_PARTNER_HOP")
            probe = poll.prober(comm)
            for other in sorted(allowed - {cpu}):  # every CPU busy: nowhere idle to go
                _child(_SPIN % other, procs)
            hops, naps, _ = spin_once(probe, allowed)
            assert hops == 0 and naps >= 1, f"moved with every CPU busy: {open('/proc/loadavg').read().strip()}"
    finally:
        os.sched_setaffinity(0, allowed)
        poll.prober(comm)  # the hop as SHMSTORE_PARTNER_HOP says again
        _kill(procs)
        comm.Free()


def test_a_spin_leaves_its_cpu_to_its_partner_only_where_the_partner_waits_for_that_cpu(monkeypatch):
    """A wait spinning for a message whose sender is a thread of this machine (``partner``: the service that will
    answer, the asker whose next request comes) naps where that thread waits to run on the spinner's own CPU (two
    such threads on one core each spun their window while the other waited), and never for another thread: one
    that sleeps, one that runs elsewhere, one that is gone, or no partner at all; a message sent while it naps
    is still found. The partner here is a second thread of a process, not its main thread."""
    _probe = pytest.importorskip("shmstore.mpi._probe")
    monkeypatch.setenv("SHMSTORE_PURE_PYTHON", "0")
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    others = sorted(allowed - {cpu})
    procs: list[subprocess.Popen] = []
    comm = MPI.COMM_SELF.Dup()
    try:
        _, here = _child(_SPIN % cpu, procs)
        _, asleep = _child("import os, time; print(os.getpid(), flush=True); time.sleep(300)", procs)
        elsewhere = _child(_SPIN % others[0], procs)[1] if others else 0
        gone_proc, gone = _child("import os; print(os.getpid(), flush=True)", procs)
        gone_proc.wait(60)
        os.sched_setaffinity(0, {cpu})  # this thread and the busy partner share one CPU
        probe = poll.prober(comm)
        assert poll.native(probe)

        def naps(partner: int) -> int:
            before = _probe.partner_naps()
            assert probe(MPI.ANY_SOURCE, 7, 0.05, 1e-4, 0.05, partner=partner) is False  # spins its whole limit
            return _probe.partner_naps() - before

        assert wait_for(lambda: _probe.partner_waits(here), 30)
        assert naps(here) >= 1
        assert naps(0) == 0
        assert not _probe.partner_waits(asleep) and naps(asleep) == 0
        assert not _probe.partner_waits(gone) and naps(gone) == 0
        if elsewhere:
            assert not _probe.partner_waits(elsewhere) and naps(elsewhere) == 0
        # a message sent while the wait naps for its partner (it spins 60 s, the message comes after 50 ms)
        reqs = []
        sender = threading.Timer(0.05, lambda: reqs.append(comm.isend(b"x", dest=0, tag=7)))
        before = _probe.partner_naps()
        sender.start()
        assert probe(MPI.ANY_SOURCE, 7, 60.0, 1e-4, 120.0, partner=here) is True
        sender.join(60)
        assert _probe.partner_naps() > before
        assert comm.recv(source=0, tag=7) == b"x"
        reqs[0].wait()
    finally:
        os.sched_setaffinity(0, allowed)
        _kill(procs)
        comm.Free()
