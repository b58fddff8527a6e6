"""Binary layout: pure pack/unpack on bytearrays, and section offsets."""
from __future__ import annotations

import numpy as np

from shmstore.meta import layout as L
from shmstore.meta.table import find_entry


def test_header_roundtrip():
    buf = bytearray(L.HEADER_SIZE)
    h = L.Header(L.MAGIC, L.LAYOUT_VERSION, L.STATE_READY, L.FLAG_PERSIST, 1000, 42, 43, 1 << 30, 1 << 20,
                 100, 8, 4, 128, 1.5, "store", "node0")
    L.pack_header(buf, h)
    assert L.unpack_header(buf) == h
    assert L.HEAD.get(buf, "state") == L.STATE_READY and L.HEAD.get(buf, "spill_pid") == 43
    L.HEAD.set(buf, "spill_pid", 7)
    assert L.unpack_header(buf).spill_pid == 7


def test_entry_roundtrip_and_numpy_view_agree():
    lay = L.Layout(max_objects=8, max_clients=2, nstripes=2)
    buf = bytearray(lay.size)
    e = L.Entry(4096, 128, 100, 3.0, 4.0, 0xDEADBEEF, 2, 5, 1, -1, 3, 0, 3, 1, L.SEALED, L.KIND_NDARRAY, 1, 0, 0)
    eoff = lay.entry(3)
    L.pack_entry(buf, eoff, e)
    L.set_entry_key(buf, eoff, b"key")
    L.set_entry_array(buf, eoff, L.array_meta("<f8", (5, 4), "F"))
    assert L.entry(buf, eoff) == e
    assert L.entry_key(buf, eoff, 3) == b"key"
    a = L.entry_array_raw(buf, eoff)
    assert a[0].rstrip(b"\0") == b"<f8" and a[1] == 2 and a[2] == 1 and a[3:5] == (5, 4)
    assert len(L.entry_table(buf, lay)) == 0  # views cover the entries ever handed out: none yet
    t = L.entry_table(buf, lay, lay.max_objects)
    assert t["offset"][3] == 4096 and t["hash"][3] == 0xDEADBEEF and t["state"][3] == L.SEALED
    assert t["writer"][3] == -1 and t["keylen"][3] == 3
    L.ENTRY_HEAD.set(buf, eoff, "atime", 9.5)
    assert t["atime"][3] == 9.5
    idx, _, raw = find_entry(buf, lay, 0, 0xDEADBEEF, 1, b"key")
    assert idx == -1 and raw is None  # not linked into a chain yet
    L.BUCKET.set(buf, lay.bucket(5), "head", 4)
    L.ENTRY_HEAD.set(buf, eoff, "next", 0)
    idx, eoff2, raw = find_entry(buf, lay, 5, 0xDEADBEEF, 1, b"key")
    assert idx == 3 and eoff2 == eoff and raw[L.E_OFFSET] == 4096 and raw[L.E_STATE] == L.SEALED


def test_sections_are_aligned_and_disjoint():
    lay = L.Layout(max_objects=1000, max_clients=16, nstripes=64)
    starts = [lay.sessions, lay.locks, lay.clients, lay.buckets, lay.entries, lay.extents, lay.pinmaps, lay.size]
    assert starts == sorted(starts)
    assert all(s % 64 == 0 for s in starts)
    assert lay.size % 4096 == 0
    assert lay.entries + 1000 * L.ENTRY_SIZE <= lay.extents
    assert L.ENTRY_HEAD.size <= L.ENTRY_ARRAY_OFFSET
    assert L.ENTRY_ARRAY_OFFSET + L.ENTRY_ARRAY.size <= L.ENTRY_KEY_OFFSET
    assert L.ENTRY_KEY_OFFSET + L.MAX_KEY <= L.ENTRY_SIZE


def test_sessions_and_clients():
    lay = L.Layout(max_objects=8, max_clients=2, nstripes=2)
    buf = bytearray(lay.size)
    assert L.unpack_session(buf, lay.session(1)) is None
    L.pack_session(buf, lay.session(1), "")
    assert L.unpack_session(buf, lay.session(1)) == ""
    L.pack_session(buf, lay.session(2), "step1")
    assert L.unpack_session(buf, lay.session(2)) == "step1"
    L.pack_client(buf, lay.client(1), 123, 1, 456, 7.0)
    c = L.CLIENT.unpack(buf, lay.client(1))
    assert (c.pid, c.state, c.start, c.attached) == (123, 1, 456, 7.0)
    assert list(L.client_table(buf, lay)["pid"]) == [0, 123]
    pins = L.pin_table(buf, lay)
    assert pins.shape == (2, 8) and pins.dtype == np.uint8
    buf[lay.pinbyte(1, 5)] = 1
    assert pins[1, 5] == 1 and pins.sum() == 1


def test_stripe_stats_of_one_level_leave_the_other_levels_alone():
    """Regression: a struct with pad bytes zeroed the other levels' counters on every update."""
    lay = L.Layout(max_objects=8, max_clients=2, nstripes=2)
    buf = bytearray(lay.size)
    soff = lay.stripe_stats(1)
    L.add_stripe_stats(buf, soff, L.LEVEL_MEMORY, 5000, 1)
    L.add_stripe_stats(buf, soff, L.LEVEL_DISK, 300, 1)
    L.add_stripe_stats(buf, soff, L.LEVEL_GPU, 7, 1)
    L.add_stripe_stats(buf, soff, L.LEVEL_MEMORY, -1000, -1)
    st = L.stats_table(buf, lay)
    assert list(st["used"][1]) == [7, 4000, 300] and st["objects"][1] == 2
    assert list(st["used"][0]) == [0, 0, 0] and st["objects"][0] == 0


def test_stores_never_show_other_processes_a_zero():
    """Regression: struct.pack_into zero-fills before it writes, so a process reading without a lock saw a
    DISK capacity of 0 while the spill process rewrote the spill state (its heartbeat): a bogus 'disk full'.
    Stores copy packed bytes in instead; a field rewritten with its own value never reads as anything else.

    The reader reads ``ROUNDS`` times while the writer goes ``ROUNDS`` times round its stores (counts, not
    times: how many fit into a second depends on the machine; issue 30 item 11); the deadline only catches
    a hang."""
    import mmap
    import os
    import struct
    import time
    rounds_wanted, counter, stop = 20_000, 8184, 8176  # the last two words: the writer's rounds, the stop flag
    buf = mmap.mmap(-1, 8192)  # shared with the child
    L.SPILL_STATE.pack(buf, L.SPILL_OFFSET, high=0.9, low=0.75, disk_capacity=12345)
    soff = 4096
    L.add_stripe_stats(buf, soff, L.LEVEL_DISK, 777, 1)
    pid = os.fork()
    if pid == 0:  # the writer: whole-record and single-field stores, as fast as it can, until told to stop
        try:
            n, end = 0, time.monotonic() + 300  # (an orphan's end)
            while not struct.unpack_from("<q", buf, stop)[0] and time.monotonic() < end:
                L.SPILL_STATE.pack(buf, L.SPILL_OFFSET, high=0.9, low=0.75, disk_capacity=12345,
                                   heartbeat=time.time())
                L.SPILL_STATE.set(buf, L.SPILL_OFFSET, "heartbeat", time.time())
                L.add_stripe_stats(buf, soff, L.LEVEL_MEMORY, 64, 1)
                L.add_stripe_stats(buf, soff, L.LEVEL_MEMORY, -64, -1)
                n += 1
                struct.pack_into("<q", buf, counter, n)
        finally:
            os._exit(0)
    zeros = reads = 0
    deadline = time.monotonic() + 120
    try:
        while not struct.unpack_from("<q", buf, counter)[0]:  # the writer has started
            assert time.monotonic() < deadline, "the writer never started"
            time.sleep(0.001)
        first = struct.unpack_from("<q", buf, counter)[0]
        while reads < rounds_wanted or struct.unpack_from("<q", buf, counter)[0] - first < rounds_wanted:
            s = L.unpack_spill_state(buf)
            zeros += (s.disk_capacity != 12345) + (s.high != 0.9) + (L.STRIPE_STATS.unpack(buf, soff).used[2] != 777)
            reads += 1
            if not reads % 1000:
                assert time.monotonic() < deadline, f"{reads} reads in 120 s, writer round {first} to " \
                                                    f"{struct.unpack_from('<q', buf, counter)[0]}"
    finally:
        struct.pack_into("<q", buf, stop, 1)
        os.waitpid(pid, 0)
    assert zeros == 0, f"{zeros} torn reads in {reads}"
