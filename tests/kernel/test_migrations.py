"""migrations: at most one transfer of a key into a node, and what its waiters see."""
from __future__ import annotations

import os

from shmstore.kernel import layout as L
from shmstore.kernel import migrations


def test_one_transfer_per_key_and_deduplicated_waiters(store):
    node, sid = store.node_store, store.kernel.sid
    mine, slot = migrations.begin(node, sid, b"k")
    assert mine and slot >= 0
    dedup = L.unpack_transfer_stats(node.buf)[3]
    assert migrations.begin(node, sid, b"k") == (False, slot)
    assert L.unpack_transfer_stats(node.buf)[3] == dedup + 1
    other, slot2 = migrations.begin(node, sid, b"other")
    assert other and slot2 != slot
    migrations.finish(node, slot)
    assert migrations.wait(node, slot, sid, b"k", timeout=1) is None  # done: the object is here
    migrations.finish(node, slot2)


def test_a_failed_transfer_gives_its_error_and_the_next_request_retries(store):
    node, sid = store.node_store, store.kernel.sid
    _, slot = migrations.begin(node, sid, b"k")
    migrations.finish(node, slot, error="source node is gone")
    assert migrations.wait(node, slot, sid, b"k", timeout=1) == "source node is gone"
    again, slot2 = migrations.begin(node, sid, b"k")  # takes the failed entry over
    assert again and slot2 == slot
    migrations.finish(node, slot2)


def test_a_transfer_of_a_dead_process_is_taken_over_and_cleared(store):
    node, sid = store.node_store, store.kernel.sid
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a process that starts a transfer and dies
        try:
            os.write(w, str(migrations.begin(node, sid, b"k")[1]).encode())
        finally:
            os._exit(0)
    os.close(w)
    slot = int(os.read(r, 16))
    os.close(r)
    os.waitpid(pid, 0)
    assert migrations.wait(node, slot, sid, b"k", timeout=1) == "retry"
    assert migrations.clear_dead(node) == 1
    assert L.unpack_migration(node.buf, node.layout, slot).state == L.MIG_FREE
