"""migrations: at most one transfer of a key into a node, and what its waiters see."""
from __future__ import annotations

import os
import random
import threading
import time

import pytest

from shmstore.meta import layout as L
from shmstore.node import inbound

from helpers import Child

CONNECT = "import shmstore, os, sys\nstore = shmstore.connect(os.environ['N'])\n"


def test_one_transfer_per_key_and_deduplicated_waiters(store):
    node, sid = store.node_store, store.kernel.sid
    mine, slot = inbound.begin(node, sid, b"k")
    assert mine and slot >= 0
    dedup = L.unpack_transfer_stats(node.buf)[3]
    assert inbound.begin(node, sid, b"k") == (False, slot)
    assert L.unpack_transfer_stats(node.buf)[3] == dedup + 1
    other, slot2 = inbound.begin(node, sid, b"other")
    assert other and slot2 != slot
    inbound.finish(node, slot)
    assert inbound.wait(node, slot, sid, b"k", timeout=1) is None  # done: the object is here
    inbound.finish(node, slot2)


def test_a_failed_transfer_gives_its_error_and_the_next_request_retries(store):
    node, sid = store.node_store, store.kernel.sid
    _, slot = inbound.begin(node, sid, b"k")
    inbound.finish(node, slot, error="source node is gone")
    assert inbound.wait(node, slot, sid, b"k", timeout=1) == "source node is gone"
    again, slot2 = inbound.begin(node, sid, b"k")  # takes the failed entry over
    assert again and slot2 == slot
    inbound.finish(node, slot2)


def test_a_transfer_of_a_dead_process_is_taken_over_and_cleared(store):
    node, sid = store.node_store, store.kernel.sid
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a process that starts a transfer and dies
        try:
            os.write(w, str(inbound.begin(node, sid, b"k")[1]).encode())
        finally:
            os._exit(0)
    os.close(w)
    slot = int(os.read(r, 16))
    os.close(r)
    os.waitpid(pid, 0)
    assert inbound.wait(node, slot, sid, b"k", timeout=1) == "retry"
    assert inbound.clear_dead(node) == 1
    assert L.unpack_migration(node.buf, node.layout, slot).state == L.MIG_FREE


_WAITER = """
import os, sys, time, shmstore
from shmstore.node import inbound
inbound._LOOK_AGAIN = 60.0  # so that only finish()'s wake can end the wait before the test's deadline
store = shmstore.connect(os.environ['N'])
slot = int(os.environ['SLOT'])
print('waiting', flush=True)
print(repr(inbound.wait(store.node_store, slot, store.kernel.sid, b'k', timeout=120)), flush=True)
store.close()
"""


@pytest.mark.parametrize("error", [None, "source node is gone"])
def test_a_waiter_in_another_process_is_woken_by_the_end_of_the_transfer(store, error):
    """A rank that joined a transfer sleeps on the slot's state word (a futex) and finish() wakes it: with its
    own looks 60 s apart, it still returns at once, with what the transfer left (None, or its error)."""
    node, sid = store.node_store, store.kernel.sid
    _, slot = inbound.begin(node, sid, b"k")
    waiter = Child(_WAITER, env={"N": store.name, "SLOT": str(slot)})
    try:
        assert waiter.readline() == "waiting"
        time.sleep(random.uniform(0.0, 0.2))  # asleep in the wait by now, or about to be: both must end
        inbound.finish(node, slot, error=error)
        assert waiter.readline(timeout=20) == repr(error)
        assert waiter.wait() == 0
    finally:
        waiter.kill()
    if error:
        inbound.finish(node, inbound.begin(node, sid, b"k")[1])


def test_a_waiter_notices_the_transferring_process_killed_while_it_waits(store):
    node, sid = store.node_store, store.kernel.sid
    mover = Child(CONNECT + """
from shmstore.node import inbound
print(inbound.begin(store.node_store, store.kernel.sid, b'k')[1], flush=True)
sys.stdin.readline()
""", env={"N": store.name})
    try:
        slot = int(mover.readline())
        result: list[str | None] = []
        t = threading.Thread(target=lambda: result.append(inbound.wait(node, slot, sid, b"k", timeout=30)))
        t.start()
        time.sleep(random.uniform(0.0, 0.1))
        mover.kill()  # SIGKILL mid-transfer: the waiter's next look (within 10 ms) sees a dead process
        t.join(30)
        assert result == ["retry"]
        # its slot goes: here, or already by the spill process's round (which clears dead slots too)
        assert inbound.clear_dead(node) in (0, 1)
        owner, again = inbound.begin(node, sid, b"k")
        assert owner  # the key is free for the next transfer
        inbound.finish(node, again)
        assert inbound.clear_dead(node) == 0
    finally:
        mover.kill()
