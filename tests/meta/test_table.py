"""table: chains, free entries, generations and the stripe repair's chain pruning, on a bytearray."""
from __future__ import annotations

import zlib

import numpy as np

from shmstore.meta import layout as L
from shmstore.meta.alloc import Allocator
from shmstore.meta.table import Table, find_entry


def make(max_objects=64, nstripes=4):
    lay = L.Layout(max_objects=max_objects, max_clients=2, nstripes=nstripes)
    buf = bytearray(lay.size)
    return buf, lay, Table(buf, lay, Allocator(buf, lay, 1 << 20))


def put(buf, lay, table, idx, key: bytes, state=L.SEALED, size=128, level=L.LEVEL_MEMORY):
    next_unused, head = L.entry_cursor(buf)
    L.set_entry_cursor(buf, max(next_unused, idx + 1), head)  # handed out, as new_entry does
    h, b, _ = table.locate(0, key)
    L.pack_entry(buf, lay.entry(idx), L.Entry(0, size, size, 0.0, 0.0, h, 0, 0, 0, 0, 0, 0, len(key), 0, state,
                                                  L.KIND_RAW, level, 0, 0))
    L.set_entry_key(buf, lay.entry(idx), key)
    table.link(idx, b)
    L.add_stripe_stats(buf, lay.stripe_stats(table.stripe_of(idx)), level, size, 1)
    return b


def test_link_find_unlink():
    buf, lay, table = make()
    keys = [f"k{i}".encode() for i in range(40)]
    for i, k in enumerate(keys):
        put(buf, lay, table, i, k)
    for i, k in enumerate(keys):
        h, b, _ = table.locate(0, k)
        assert h == zlib.crc32(k, 0)
        assert find_entry(buf, lay, b, h, 0, k)[0] == i
    for i in range(0, 40, 3):
        table.unlink(i, table.bucket_of(i))
    for i, k in enumerate(keys):
        h, b, _ = table.locate(0, k)
        assert (find_entry(buf, lay, b, h, 0, k)[0] == -1) == (i % 3 == 0)


def test_free_list_hands_out_unused_then_freed_entries_with_new_generations():
    buf, lay, table = make(max_objects=4)
    got = [table.new_entry() for _ in range(4)]
    assert got == [0, 1, 2, 3] and table.new_entry() == -1
    gen = L.ENTRY_HEAD.get(buf, lay.entry(2), "gen")
    table.push_free(2, 0)
    e = L.entry(buf, lay.entry(2))
    assert e.state == L.FREE and e.gen == gen + 1
    assert table.new_entry() == 2 and table.new_entry() == -1


def test_keep_entry_uncounts_and_reserves_for_a_client():
    buf, lay, table = make()
    put(buf, lay, table, 5, b"x")
    table.unlink(5, table.bucket_of(5))
    gen = table.keep_entry(5, slot=1)
    e = L.entry_raw(buf, lay.entry(5))
    assert e[L.E_STATE] == L.RESERVED and e[L.E_WRITER] == 1 and e[L.E_GEN] == gen == 1
    assert L.stats_table(buf, lay)["objects"].sum() == 0 and L.stats_table(buf, lay)["used"].sum() == 0


def test_prune_chains_drops_what_is_not_live_and_cuts_loops():
    buf, lay, table = make(nstripes=1)
    for i in range(6):
        put(buf, lay, table, i, f"k{i}".encode())
    L.ENTRY_HEAD.set(buf, lay.entry(2), "state", L.DELETED)  # hidden but still linked: a delete killed half way
    L.ENTRY_HEAD.set(buf, lay.entry(4), "state", L.FREE)
    linked = table.prune_chains(0)
    assert sorted(linked) == [0, 1, 3, 5]
    b = table.bucket_of(3)  # a chain that loops back on itself
    L.ENTRY_HEAD.set(buf, lay.entry(3), "next", 4)  # 3 -> 3 (1-based)
    L.BUCKET.set(buf, lay.bucket(b), "head", 4)
    assert 3 in table.prune_chains(0)


def test_repair_stats_counts_again_from_the_entries():
    buf, lay, table = make(nstripes=2)
    for i in range(10):
        put(buf, lay, table, i, f"k{i}".encode(), level=L.LEVEL_DISK if i % 2 else L.LEVEL_MEMORY)
    L.ENTRY_HEAD.set(buf, lay.entry(3), "state", L.DELETED)
    want = L.stats_table(buf, lay).copy()
    L.stats_table(buf, lay)[:] = np.zeros(1, L.STRIPE_STATS.dtype)  # lost: a holder died mid-update
    for s in range(lay.nstripes):
        table.repair_stats(s)
    got = L.stats_table(buf, lay)
    assert (got["used"] == want["used"]).all() and (got["objects"] == want["objects"]).all()
    assert got["deleted"].sum() == 1


def test_pin_counts_per_entry_and_client():
    buf, lay, table = make()
    pins = L.pin_table(buf, lay)
    pins[0, 7] = pins[1, 7] = pins[1, 9] = 1
    L.set_entry_cursor(buf, 10, 0)  # entries 0..9 handed out
    assert table.pin_count(7) == 0  # no slot taken yet: rows are scanned only up to the slots ever taken
    L.ALLOC.set(buf, "slots_high", 2)  # as NodeStore.register does before a slot is used
    assert table.pin_count(7) == 2 and table.pin_count(9) == 1 and table.pin_count(8) == 0
    assert list(table.pinned_by(1)) == [7, 9]
    table.unpin(1, 7)
    assert table.pin_count(7) == 1
    table.clear_pins(0)
    assert table.pin_counts(10).sum() == 1


def test_each_cache_line_of_bucket_heads_belongs_to_one_stripe():
    """A put or delete writes its bucket's head: the heads sharing a 64-byte line all belong to the key's
    stripe, so processes working on different stripes never write the same line (issue 22 item 4). Every
    bucket belongs to exactly one stripe; the stripe of a key, of its entry and of its bucket agree."""
    import zlib
    buf, lay, table = make(max_objects=4096, nstripes=16)
    owner: dict[int, int] = {}
    for s in range(lay.nstripes):
        for b in table.buckets_of(s):
            assert b not in owner
            owner[b] = s
    assert sorted(owner) == list(range(lay.nbuckets))
    for line in range(0, lay.nbuckets * L.BUCKET.size, 64):
        heads = {owner[line // L.BUCKET.size + i] for i in range(64 // L.BUCKET.size)}
        assert len(heads) == 1, f"the line at bucket byte {line} holds heads of stripes {heads}"
    assert lay.bucket(0) % 64 == 0
    for i in range(200):
        key = f"key{i}".encode()
        h, b, s = table.locate(3, key)
        assert h == zlib.crc32(key, 3) and owner[b] == s
    put(buf, lay, table, 5, b"key7")
    assert table.stripe_of(5) == table.locate(0, b"key7")[2]
