"""ShmLock: threading.Lock semantics, timeouts, recovery from a killed holder."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid

import pytest

from shmstore.errors import LockTimeoutError
from shmstore.meta import fastpath
from shmstore.meta.lock import ShmLock, init_lock
from shmstore.primitives.segment import Segment

from helpers import Child


@pytest.fixture
def seg():
    s = Segment.create(f"/shmstore-locktest-{uuid.uuid4().hex[:8]}", 4096)
    init_lock(s.address)
    yield s
    s.close()
    s.unlink()


def child_code(name: str, body: str) -> str:
    return f"""
import sys, time
from shmstore.primitives.segment import Segment
from shmstore.meta.lock import ShmLock
seg = Segment.attach({name!r})
lock = ShmLock(seg.address, 'test')
{body}
"""


def test_acquire_release_locked(seg):
    lock = ShmLock(seg.address, "t", timeout=1)
    assert not lock.locked()
    assert lock.acquire()
    assert lock.locked()
    assert not lock.acquire(blocking=False)
    lock.release()
    assert not lock.locked()
    with lock:
        assert lock.locked()
    assert not lock.locked()


def test_timeout_between_threads(seg):
    lock = ShmLock(seg.address, "t", timeout=0.2)
    lock.acquire()
    result = []
    t = threading.Thread(target=lambda: result.append(lock.acquire(timeout=0.1)))
    t.start()
    t.join(5)
    assert result == [False]
    err = []

    def ctx():
        try:
            with lock:
                pass
        except LockTimeoutError as exc:
            err.append(exc)
    t = threading.Thread(target=ctx)
    t.start()
    t.join(5)
    assert err and "lock_timeout" in str(err[0]) and isinstance(err[0], TimeoutError)
    lock.release()


def test_a_lock_this_thread_holds_is_named_at_once_instead_of_waited_for(seg):
    """A thread asking again for a lock it holds (one never released: a bug) would wait for itself the whole
    lock timeout and then blame 'this process'; it is told at once what happened, and the lock stays its own
    (never unlocked behind the section that holds it). Another thread still waits its timeout."""
    lock = ShmLock(seg.address, "t", timeout=30)
    lock.acquire()
    try:
        start = time.monotonic()
        with pytest.raises(LockTimeoutError, match=r"lock t is held by this very thread \(MainThread\)"):
            with lock:
                pass
        assert not lock.acquire(timeout=30)
        assert time.monotonic() - start < 20  # not the 30 s timeouts
        assert lock.locked()
        got = []
        t = threading.Thread(target=lambda: got.append(lock.acquire(timeout=0.2)))
        t.start()
        t.join(10)
        assert got == [False]
    finally:
        lock.release()
    assert not lock.locked()

def test_holder_killed_with_sigkill_is_recovered(seg):
    recovered = []
    lock = ShmLock(seg.address, "t", timeout=5, on_recover=lambda: recovered.append(True))
    child = Child(child_code(seg.name, "lock.acquire()\nprint('held', flush=True)\ntime.sleep(60)"))
    assert child.readline() == "held"
    assert lock.locked()
    child.kill()
    t0 = time.monotonic()
    assert lock.acquire(timeout=5)
    assert time.monotonic() - t0 < 2 and recovered == [True]
    lock.release()
    assert lock.acquire(blocking=False)  # consistent again: no second recovery
    lock.release()
    assert recovered == [True]


def test_mutual_exclusion_across_processes(seg):
    # a non-atomic read-modify-write of a counter next to the lock
    body = """
import struct
for _ in range(3000):
    with lock:
        v = struct.unpack_from('<q', seg.mm, 64)[0]
        struct.pack_into('<q', seg.mm, 64, v + 1)
print('done', flush=True)
"""
    kids = [Child(child_code(seg.name, body)) for _ in range(3)]
    for k in kids:
        assert k.readline(60) == "done"
        k.wait()
    import struct
    assert struct.unpack_from("<q", seg.mm, 64)[0] == 9000


def test_a_timeout_names_the_holder_a_thread_here_or_another_process(seg):
    """What a LockTimeoutError says: which thread of which process holds the lock (a stopped one says so),
    the lead to a hang that 'another process holds it' left to guesswork."""
    lock = ShmLock(seg.address, "t", timeout=0.2)
    held, go = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            go.wait(10)
    t = threading.Thread(target=hold, name="the-holder")
    t.start()
    assert held.wait(10)
    with pytest.raises(LockTimeoutError, match=r"thread \d+ \(the-holder, S \(sleeping\)\) of this process"):
        with lock:
            pass
    go.set()
    t.join(10)
    child = Child(child_code(seg.name, "lock.acquire()\nprint('held', flush=True)\ntime.sleep(60)"))
    try:
        assert child.readline() == "held"
        os.kill(child.pid, signal.SIGSTOP)
        with pytest.raises(LockTimeoutError, match=rf"T \(stopped\)\) of pid {child.pid} \(.*python"):
            with lock:
                pass
    finally:
        child.kill()


def _raise_at_first(name: str, where: list[str]):
    """A profile function that raises KeyboardInterrupt (as an asynchronous exception would) at the first
    instruction of the first call of a function ``name``, once; ``where`` records that it did."""
    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_name == name and not where:
            where.append(name)
            sys.setprofile(None)
            raise KeyboardInterrupt(f"at the start of {name}")
    return prof


@pytest.mark.skipif(fastpath.load() is None, reason="the C helper repairs twice; pure Python once (signals deferred)")
@pytest.mark.parametrize("where", ["a section that raised", "a dead holder's lock"])
def test_a_repair_cut_short_at_its_first_instruction_runs_again(seg, where):
    """An asynchronous exception at the repair's first instruction (a second Ctrl-C while the store's handler
    defers the first) repaired nothing, and the lock was released consistent: nobody would ever repair that
    section. The C helper runs the repair once more, then raises the first exception."""
    repaired, hit = [], []
    lock = ShmLock(seg.address, "t", timeout=5, on_recover=lambda: repaired.append(True))
    if where == "a dead holder's lock":
        child = Child(child_code(seg.name, "lock.acquire()\nprint('held', flush=True)\ntime.sleep(60)"))
        assert child.readline() == "held"
        child.kill()
        sys.setprofile(_raise_at_first("<lambda>", hit))
        try:
            with pytest.raises(KeyboardInterrupt, match="at the start"):
                lock.acquire(timeout=5)
        finally:
            sys.setprofile(None)
    else:
        try:
            with pytest.raises(KeyboardInterrupt, match="at the start"):
                with lock:
                    sys.setprofile(_raise_at_first("_abandon", hit))
                    raise ValueError("not raised on purpose: the section may be half done")
        finally:
            sys.setprofile(None)
    assert hit and repaired == [True]
    assert lock.acquire(blocking=False)  # released, and consistent
    lock.release()
