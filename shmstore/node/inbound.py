"""The node's migration map: at most one transfer of a key into this node at a time.

The first process that wants a key on this node registers a transfer in the
map (under the ADMIN lock) and does it; others that want the same key
meanwhile find the entry, count as deduplicated, and wait for it to go
away (then the object is here) or to turn ``failed`` (then they get its
error). A failed entry is replaced by the next request, so a retry can
succeed. If the transferring process dies, the first waiter to notice takes
the entry over (and the janitor clears entries of dead processes).
"""
from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator
from typing import Any

from ..meta import layout as L
from ..primitives.interrupts import interruptible
from ..primitives.native import futex_wait, futex_wake
from .nodestore import NodeStore, pid_alive, proc_start_time

__all__ = ["begin", "begin_many", "finish", "finish_many", "wait", "clear_dead"]


_KEY = L.MIGRATION.offset["key"]
_STATE_AT = L.MIGRATION.offset["state"]  # a 32-bit word: waiters sleep on it (a futex), finish wakes them
_KEYLEN, _KEYLEN_AT = L.MIGRATION.field("keylen"), L.MIGRATION.offset["keylen"]
_SESSION, _SESSION_AT = L.MIGRATION.field("session"), L.MIGRATION.offset["session"]
_ALL_FREE = bytes([L.MIG_FREE]) * L.NMIGRATIONS
_HEAD = struct.Struct("<IHHi4xQd")  # state, session, keylen, pid, start, time: the record up to its error
_NO_ERROR = bytes(L.MIGRATION.offset["key"] - L.MIGRATION.offset["error"])
assert _HEAD.size == L.MIGRATION.offset["error"] and L.MIGRATION.offset["time"] == 24
FAILED_KEEP = 1.0  # seconds a failed entry stays for the waiters of its transfer
_ME = os.getpid()
_MY_START = proc_start_time(_ME) or 0


def _scan(node: NodeStore) -> tuple[dict[tuple[int, bytes], int], Iterator[int]]:
    """The map's busy entries by (session, key), and its free slots in order (ADMIN lock held).

    Frees failed entries older than ``FAILED_KEEP`` seconds on the way: their
    waiters (who look every 10 ms at most) have seen them. Kept longer, every
    miss (a get of a key no node has) left one, and after 128 misses the map
    was full: each fetch scanned it and went without deduplication. One pass
    over the busy slots serves a whole batch (a scan per key cost a batched
    fetch 70 us a key).
    """
    buf, lay = node.buf, node.layout
    states = L.migration_states(buf, lay)
    if states == _ALL_FREE:
        return {}, iter(range(L.NMIGRATIONS))  # the usual case: nothing in flight
    if L.MIG_FAILED in states:
        now = time.time()
        for slot, state in enumerate(states):
            at = lay.migration(slot)
            if state == L.MIG_FAILED and now - L.MIGRATION.get(buf, at, "time") > FAILED_KEEP:
                L.MIGRATION.set(buf, at, "state", L.MIG_FREE)
        states = L.migration_states(buf, lay)
    busy = {}
    for slot, state in enumerate(states):
        if state != L.MIG_FREE:
            at = lay.migration(slot)
            n = _KEYLEN.unpack_from(buf, at + _KEYLEN_AT)[0]
            busy[(_SESSION.unpack_from(buf, at + _SESSION_AT)[0], bytes(buf[at + _KEY: at + _KEY + n]))] = slot
    return busy, (slot for slot, state in enumerate(states) if state == L.MIG_FREE)


def _identity() -> tuple[int, int]:
    global _ME, _MY_START
    if os.getpid() != _ME:  # forked
        _ME, _MY_START = os.getpid(), proc_start_time(os.getpid()) or 0
    return _ME, _MY_START


def begin(node: NodeStore, sid: int, key: bytes) -> tuple[bool, int]:
    """Register interest in transferring ``key`` into this node.

    Returns:
        (True, slot) if the caller must do the transfer, (False, slot) if one
        is in flight already (wait on ``slot``), (True, -1) if the map is
        full (transfer without deduplication).
    """
    return begin_many(node, sid, [key])[0]


def begin_many(node: NodeStore, sid: int, keys: list[bytes]) -> list[tuple[bool, int]]:
    """:func:`begin` for each of ``keys`` (distinct), under one lock and one pass over the map."""
    me, start = _identity()
    out = []
    with node.admin:
        busy, free = _scan(node)
        for key in keys:
            found = busy.get((sid, key), -1)
            if found >= 0:
                m = L.unpack_migration(node.buf, node.layout, found)
                if m.state == L.MIG_FLIGHT and pid_alive(m.pid, m.start):
                    L.add_transfer_stats(node.buf, dedup=1)
                    out.append((False, found))
                    continue
                slot = found  # failed, or its process died: take it over
            else:
                slot = next(free, -1)
            if slot < 0:
                out.append((True, -1))
                continue
            at = node.layout.migration(slot)  # one write: the head, no error, the key (its length ends it)
            node.buf[at: at + _KEY + len(key)] = _HEAD.pack(L.MIG_FLIGHT, sid, len(key), me, start, time.time()) \
                + _NO_ERROR + key
            busy[(sid, key)] = slot
            out.append((True, slot))
    return out


def finish(node: NodeStore, slot: int, error: str | None = None) -> None:
    """End the caller's transfer: free the entry, or leave the error for the waiters (woken)."""
    if slot >= 0:
        finish_many(node, [(slot, error)])


def _finish_locked(node: NodeStore, slot: int, error: str | None) -> bool:
    """:func:`finish` of one slot under the ADMIN lock: whether it ended a transfer of the caller's."""
    if slot < 0:
        return False
    at = node.layout.migration(slot)
    if L.MIGRATION.get(node.buf, at, "pid") != os.getpid():
        return False
    # the usual case: one field, not the whole record (a third of a small fetch's map cost)
    if not error:
        L.MIGRATION.set(node.buf, at, "state", L.MIG_FREE)
    else:
        m = L.unpack_migration(node.buf, node.layout, slot)
        L.pack_migration(node.buf, node.layout, slot, m._replace(state=L.MIG_FAILED, error=error, time=time.time()))
    return True


def finish_many(node: NodeStore, slots: list[tuple[int, str | None]]) -> None:
    """:func:`finish` of each (slot, error), under one lock; their waiters are woken after it (so that they do
    not wake into the lock): they return now, not at their next look."""
    with node.admin:
        ended = [slot for slot, error in slots if _finish_locked(node, slot, error)]
    base = node.meta.address
    for slot in ended:
        futex_wake(base + node.layout.migration(slot) + _STATE_AT)


# a waiter asleep on the slot looks again this often: a transferring process that died
_LOOK_AGAIN = 0.01


@interruptible
def wait(node: NodeStore, slot: int, sid: int, key: bytes, timeout: float) -> str | None:
    """Wait for the transfer in ``slot``; returns None when done, the error when it failed,
    or ``"retry"`` when its process died (call ``begin`` again).

    Sleeps on the slot's state word, which :func:`finish` wakes: a rank that
    joined a transfer returns as soon as it is scheduled after the transfer's
    end (with 0.5 ms naps it was up to 0.5 ms late, and a long transfer
    woke it 2,000 times a second). It looks again every 10 ms meanwhile, for
    a transferring process that died. Interruptible: a Ctrl-C raises here at
    once (a waiter holds nothing of the transfer it joined).
    """
    deadline = time.monotonic() + timeout
    word = node.meta.address + node.layout.migration(slot) + _STATE_AT
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        outcome = _look(node, slot, sid, key)
        if outcome is not _IN_FLIGHT:
            return outcome if outcome is None else str(outcome)
        futex_wait(word, L.MIG_FLIGHT, min(left, _LOOK_AGAIN))  # at once where the state changed meanwhile
    return f"waited {timeout:g} s for the transfer of {key.decode(errors='replace')!r} by another process"


_IN_FLIGHT: Any = object()  # _look: the transfer is still under way


def _look(node: NodeStore, slot: int, sid: int, key: bytes) -> Any:
    """What :func:`wait` returns for the transfer in ``slot`` now, or ``_IN_FLIGHT`` (under the ADMIN lock: a
    signal inside waits for this to return, see ``interrupts.py``)."""
    with node.admin:
        m = L.unpack_migration(node.buf, node.layout, slot)
        if m.state == L.MIG_FREE or m.session != sid or m.key != key:
            return None
        if m.state == L.MIG_FAILED:
            return m.error or "transfer failed"
        if not pid_alive(m.pid, m.start):
            return "retry"
    return _IN_FLIGHT


def clear_dead(node: NodeStore) -> int:
    """Free the entries of processes that died mid-transfer (janitor); returns how many."""
    n = 0
    with node.admin:
        for slot in range(L.NMIGRATIONS):
            m = L.unpack_migration(node.buf, node.layout, slot)
            stale_fail = m.state == L.MIG_FAILED and time.time() - m.time > FAILED_KEEP
            if (m.state == L.MIG_FLIGHT and not pid_alive(m.pid, m.start)) or stale_fail:
                L.pack_migration(node.buf, node.layout, slot, m._replace(state=L.MIG_FREE))
                n += 1
    return n
