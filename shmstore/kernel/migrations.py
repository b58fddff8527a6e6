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

from . import layout as L
from .node import NodeStore, pid_alive, proc_start_time

__all__ = ["begin", "finish", "wait", "clear_dead"]


_KEY = L.MIGRATION.offset["key"]
_KEYLEN, _KEYLEN_AT = L.MIGRATION.field("keylen"), L.MIGRATION.offset["keylen"]
_SESSION, _SESSION_AT = L.MIGRATION.field("session"), L.MIGRATION.offset["session"]
_ALL_FREE = bytes([L.MIG_FREE]) * L.NMIGRATIONS
_HEAD = struct.Struct("<IHHi4xQd")  # state, session, keylen, pid, start, time: the record up to its error
_NO_ERROR = bytes(L.MIGRATION.offset["key"] - L.MIGRATION.offset["error"])
assert _HEAD.size == L.MIGRATION.offset["error"] and L.MIGRATION.offset["time"] == 24
FAILED_KEEP = 1.0  # seconds a failed entry stays for the waiters of its transfer
_ME = os.getpid()
_MY_START = proc_start_time(_ME) or 0


def _find(node: NodeStore, sid: int, key: bytes) -> tuple[int, int]:
    """(slot holding ``key``, first free slot), -1 where none (ADMIN lock held).

    Frees failed entries older than ``FAILED_KEEP`` seconds on the way: their
    waiters (who look every 10 ms at most) have seen them. Kept longer, every
    miss (a get of a key no node has) left one, and after 128 misses the map
    was full: each fetch scanned it and went without deduplication. The key
    is searched in one copy of the map (a batched fetch fills it: a scan
    slot by slot in Python cost each of its keys 70 us).
    """
    buf, lay = node.buf, node.layout
    states = L.migration_states(buf, lay)
    if states == _ALL_FREE:
        return -1, 0  # the usual case: nothing in flight
    if L.MIG_FAILED in states:
        now = time.time()
        for slot, state in enumerate(states):
            at = lay.migration(slot)
            if state == L.MIG_FAILED and now - L.MIGRATION.get(buf, at, "time") > FAILED_KEEP:
                L.MIGRATION.set(buf, at, "state", L.MIG_FREE)
        states = L.migration_states(buf, lay)
    free = states.find(L.MIG_FREE)
    start, size = lay.migrations, L.MIGRATION.size
    region = bytes(buf[start: start + L.NMIGRATIONS * size])
    pos = region.find(key, _KEY)
    while pos >= 0:
        slot, rest = divmod(pos - _KEY, size)
        if rest == 0 and states[slot] != L.MIG_FREE:
            at = slot * size
            if _KEYLEN.unpack_from(region, at + _KEYLEN_AT)[0] == len(key) \
                    and _SESSION.unpack_from(region, at + _SESSION_AT)[0] == sid:
                return slot, free
        pos = region.find(key, pos + 1)
    return -1, free


def _identity() -> tuple[int, int]:
    global _ME, _MY_START
    if os.getpid() != _ME:  # forked
        _ME, _MY_START = os.getpid(), proc_start_time(os.getpid()) or 0
    return _ME, _MY_START


def begin(node: NodeStore, sid: int, key: bytes) -> tuple[bool, int]:
    """Register interest in transferring ``key`` into this node.

    Returns:
        (True, slot) if the caller must do the transfer, (False, slot) if one
        is in flight already (wait on ``slot``), (False, -1) if the map is
        full (transfer without deduplication).
    """
    me, start = _identity()
    with node.admin:
        found, free = _find(node, sid, key)
        if found >= 0:
            m = L.unpack_migration(node.buf, node.layout, found)
            if m.state == L.MIG_FLIGHT and pid_alive(m.pid, m.start):
                L.add_transfer_stats(node.buf, dedup=1)
                return False, found
            free = found  # failed, or its process died: take it over
        if free < 0:
            return True, -1
        at = node.layout.migration(free)  # one write: the head, no error, the key (its length says where it ends)
        node.buf[at: at + _KEY + len(key)] = _HEAD.pack(L.MIG_FLIGHT, sid, len(key), me, start, time.time()) \
            + _NO_ERROR + key
        return True, free


def finish(node: NodeStore, slot: int, error: str | None = None) -> None:
    """End the caller's transfer: free the entry, or leave the error for the waiters."""
    if slot < 0:
        return
    with node.admin:
        at = node.layout.migration(slot)
        if L.MIGRATION.get(node.buf, at, "pid") != os.getpid():
            return
        if not error:  # the usual case: one field, not the whole record (a third of a small fetch's map cost)
            L.MIGRATION.set(node.buf, at, "state", L.MIG_FREE)
            return
        m = L.unpack_migration(node.buf, node.layout, slot)
        L.pack_migration(node.buf, node.layout, slot, m._replace(state=L.MIG_FAILED, error=error, time=time.time()))


def wait(node: NodeStore, slot: int, sid: int, key: bytes, timeout: float) -> str | None:
    """Wait for the transfer in ``slot``; returns None when done, the error when it failed,
    or ``"retry"`` when its process died (call ``begin`` again)."""
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while time.monotonic() < deadline:
        with node.admin:
            m = L.unpack_migration(node.buf, node.layout, slot)
            if m.state == L.MIG_FREE or m.session != sid or m.key != key:
                return None
            if m.state == L.MIG_FAILED:
                return m.error or "transfer failed"
            if not pid_alive(m.pid, m.start):
                return "retry"
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    return f"waited {timeout:g} s for the transfer of {key.decode(errors='replace')!r} by another process"


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
