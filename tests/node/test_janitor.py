"""janitor: what dead clients held comes back; locks they held are repaired (spill process stopped: this test
plays the janitor)."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from shmstore import Level
from shmstore.node.janitor import dead_clients, janitor_pass, probe_locks, sweep_deleted

from helpers import Child

CONNECT = "import shmstore, numpy as np, os, sys\nstore = shmstore.connect(os.environ['N'])\n"


@pytest.fixture
def stopped(store):
    pid = store.spill_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield store
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_dead_clients_writes_pins_batch_and_chunk_come_back(stopped):
    store = stopped
    store.put("shared", np.arange(1000))
    child = Child(CONNECT + """
store.put('small', b'x' * 100)           # takes a batch of entries and a chunk
w = store.open_writer('half', 1 << 20)   # an object of its own, unsealed
v = store.get('shared')                  # a pin
print(store.kernel.slot, flush=True)
sys.stdin.readline()
""", env={"N": store.name})
    slot = int(child.readline())
    store.delete("shared")  # pinned by the child: hidden, not freed
    child.kill()
    assert [s for s, _ in dead_clients(store.node_store)] == [slot]
    [(s, pid, dropped, freed)] = janitor_pass(store.node_store)
    assert (s, pid) == (slot, child.pid) and dropped == 2 and freed >= 1 << 20
    assert dead_clients(store.node_store) == [] and store.check() == []
    assert [i.key for i in store.list()] == ["small"]
    assert store.get_capacity()[Level.MEMORY].used == store.get_info("small").stored


def test_probing_repairs_a_lock_whose_holder_died(stopped):
    store = stopped
    store.put("k", 1)
    child = Child(CONNECT + """
node = store.node_store
node.stripes[node.table.locate(store.kernel.sid, b'k')[2]].acquire()
soff = node.layout.stripe_stats(node.table.locate(store.kernel.sid, b'k')[2])
from shmstore.meta import layout as L
L.add_stripe_stats(node.buf, soff, L.LEVEL_MEMORY, 4096, 1)  # half an update, then killed
print('held', flush=True)
sys.stdin.readline()
""", env={"N": store.name})
    assert child.readline() == "held"
    child.kill()
    janitor_pass(store.node_store)  # reclaims the child, then probes every lock
    stripe = store.node_store.stripes[store.node_store.table.locate(store.kernel.sid, b"k")[2]]
    assert not stripe.locked()
    assert store.get_capacity()[Level.MEMORY].used == store.get_info("k").stored
    probe_locks(store.node_store)  # nothing to repair: a no-op
    assert store.check() == []


def test_sweep_frees_deleted_entries_nobody_pins(stopped):
    store = stopped
    store.put("a", np.ones(100))
    idx, _, _ = store.kernel.lookup(store.kernel.begin("a"), False)
    with store.node_store.stripe_of(idx):  # the state the lock-free unpin race leaves (see table.py)
        store.node_store.table.unlink(idx, store.node_store.table.bucket_of(idx))
        store.node_store.table.mark_deleted(idx)
    assert store.get_capacity()[Level.MEMORY].used > 0
    assert sweep_deleted(store.node_store) == 1
    assert store.get_capacity()[Level.MEMORY].used == 0 and store.check() == []
