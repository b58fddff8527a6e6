"""requests: a client's request record to the spill process (the spill process stopped: this test serves)."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from shmstore.meta import layout as L
from shmstore.spill import requests


@pytest.fixture
def stopped(store):
    """The store with its spill process stopped (SIGSTOP), so that this test plays it."""
    pid = store.spill_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield store.node_store, store.kernel.slot
    finally:
        os.kill(pid, signal.SIGCONT)


def test_submit_pending_complete_wait(stopped):
    node, slot = stopped
    seq = requests.submit(node, slot, L.REQ_SPACE, nbytes=123)
    [(s, r)] = requests.pending(node)
    assert s == slot and (r.kind, r.seq, r.nbytes, r.status) == (L.REQ_SPACE, seq, 123, L.RS_PENDING)
    threading.Timer(0.05, requests.complete, (node, slot, r, L.ERR_FULL, "no room here")).start()
    done = requests.wait(node, slot, seq, timeout=5)
    assert (done.status, done.error, done.message) == (L.RS_FAILED, L.ERR_FULL, "no room here")
    assert requests.pending(node) == []
    seq = requests.submit(node, slot, L.REQ_MOVE, idx=4, gen=2, level=L.LEVEL_DISK)
    [(_, r)] = requests.pending(node)
    requests.complete(node, slot, r)
    done = requests.wait(node, slot, seq, timeout=5)
    assert done.status == L.RS_DONE and (done.idx, done.gen, done.level) == (4, 2, L.LEVEL_DISK)


def test_a_request_not_served_in_time_is_withdrawn_and_a_late_answer_ignored(stopped):
    node, slot = stopped
    seq = requests.submit(node, slot, L.REQ_SPACE, nbytes=1)
    [(_, late)] = requests.pending(node)
    assert requests.wait(node, slot, seq, timeout=0.05) is None
    assert requests.pending(node) == []
    requests.complete(node, slot, late)  # the spill process answers after all: nothing changes
    r = L.unpack_request(node.buf, node.layout.client(slot))
    assert r.status == L.RS_IDLE  # withdrawn: not pending, and no answer


def test_a_thread_holding_a_store_lock_is_refused_a_request_at_once(stopped):
    """Nobody waits for the spill process holding a store lock (the module's rule): the spill process may need
    that lock to serve any request, and a client taking every lock (check) would wait on the asker. A first GPU
    put broke it, under its stripe lock, and three processes stood until a lock timeout (stop 52's CI). Now the
    request is refused at once, naming the lock, and nothing is posted."""
    import shmstore
    node, slot = stopped
    for lock in (node.stripes[3], node.alloc_lock, node.admin):
        with lock:
            with pytest.raises(shmstore.LockTimeoutError, match=f"make room.*holds the store's lock.*{lock.name}"):
                requests.submit(node, slot, L.REQ_SPACE, nbytes=1)
        assert requests.pending(node) == []
    seq = requests.submit(node, slot, L.REQ_SPACE, nbytes=1)  # with no lock held it goes
    [(s, r)] = requests.pending(node)
    assert s == slot and r.seq == seq
    requests.withdraw(node, slot, seq)
