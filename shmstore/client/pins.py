"""Pins: what keeps a stored object still while this process uses it.

A process's pins on an entry are counted locally (:attr:`Pins.counts`: entry
index -> count) and published as one byte per entry in this client's row of
the pin table, which is what the spill process and other clients look at.
Views, readers and explicit ``pin`` calls each hold one local pin; the last
one to go clears the byte, and frees the entry if it was deleted meanwhile
(never blocking: it may run as a finalizer inside a locked section; a free
that would have to wait is deferred to this process's next verb).
"""
from __future__ import annotations

import threading
from typing import Callable

from ..meta import layout as L
from .state import ClientState

__all__ = ["Pins"]


class Pins:
    """This process's pins on the objects of one node store.

    Owned by the :class:`~shmstore.client.kernel.Kernel`; its row of pin bytes is
    given up by ``close``. Thread-safe: a lock guards the counts between
    threads (the C helper's calls hold the GIL instead, and take the same
    role: both are used for pinning and unpinning, or neither).

    Args:
        at: the kernel's attachment.
        on_idle: called when the last pin goes after ``detach_when_idle`` was set.
    """

    def __init__(self, state: ClientState, on_idle: Callable[[], None]) -> None:
        self._state, self._on_idle = state, on_idle
        self._fast = state.fast
        self.counts: dict[int, int] = {}   # entry index -> local pins (views, readers, explicit)
        self.explicit: dict[tuple[int, bytes], list[int]] = {}  # (sid, key) -> [index, generation, count]
        # (index, generation) a finalizer left for the next verb: a deleted entry whose last pin it dropped,
        # or the entry of a writer dropped unsealed (see free_deferred)
        self.deferred: list[tuple[int, int]] = []
        self.closed = False  # detached: releases are no-ops (the slot and its pins are gone)
        self.detach_when_idle = False
        self._lock = threading.Lock()
        self._row = L.pin_row(state.buf, state.lay, state.slot)
        self._addr = state.meta_addr + state.lay.pinbyte(state.slot, 0)
        self.ctx = None if self._fast is None else self._fast.context(
            state.meta_addr, state.lay.buckets, state.lay.entries, state.bmask, state.smask, state.sid,
            tuple(state.stripe_addrs), self._addr, self.counts, ATIME_GRAIN)
        if self.ctx is not None and hasattr(self._fast, "delete_config"):  # (an older build has no C delete)
            lay, base = state.lay, state.meta_addr
            self._fast.delete_config(
                self.ctx, state.slot, base + lay.stats, L.STRIPE_STATS.size, L.STRIPE_STATS.offset["deleted"],
                base + lay.pinmaps, lay.pinrow, base + L.ALLOC_OFFSET + L.ALLOC_STATE.offset["slots_high"],
                L.FLAG_MOVING, L.FLAG_IN_CHUNK, L.ENTRY_HEAD.struct.size)
            if hasattr(self._fast, "put_small"):  # (nor a put_small): ops.ctx stays None, puts go the steps
                self._fast.put_config(self.ctx, state.arena_addr,
                                      base + lay.client(state.slot) + L.CLIENT.offset["chunk"], L.LEVEL_MEMORY)
                if state.ops is not None:
                    state.ops.ctx = self.ctx

    def up(self, idx: int) -> None:
        """One more local pin on ``idx`` (its stripe lock held); the first sets our pin byte."""
        if self._fast is not None:  # one C call holding the GIL: atomic for the threads of this process
            self._fast.pin(self.counts, idx, self._addr)
            return
        with self._lock:
            n = self.counts.get(idx, 0)
            if not n:
                self._row[idx] = 1
            self.counts[idx] = n + 1

    def _down(self, idx: int) -> bool:
        """One local pin less on ``idx`` (no lock); True when it was the last one."""
        if self._fast is not None:
            last: bool = self._fast.unpin(self.counts, idx, self._addr)
            return last
        # no allocation of GC-tracked objects inside: no finalizer can run here
        with self._lock:
            n = self.counts.get(idx, 0) - 1
            if n > 0:
                self.counts[idx] = n
                return False
            if n < 0:
                return False
            del self.counts[idx]
            self._row[idx] = 0
            return True

    def release(self, idx: int, gen: int) -> None:
        """Drop one local pin (from a finalizer, a reader or ``unpin``); takes no store lock
        unless the object was deleted meanwhile."""
        if self.closed:
            return
        state = self._state
        if self._fast is not None:
            last = self._fast.release(self.ctx, idx)  # 0: still pinned here, 1: last pin, 2: last and deleted
            if not last:
                return
            deleted = last == 2
        else:
            if not self._down(idx):
                return
            deleted = L.ENTRY_HEAD.get(state.buf, state.lay.entry(idx), "state") == L.DELETED
        if deleted:
            lock = state.node.stripe_of(idx)
            # never block here: this may be a finalizer inside a locked section of this thread
            done = None
            try:
                if lock.acquire(blocking=False):
                    try:
                        done = state.node.free_if_unpinned(idx, gen, blocking=False, supply=state.supply)
                    except BaseException as exc:  # asynchronous (a finalizer swallows it): see lock.py
                        lock.abandon(exc)
                        raise
                    finally:
                        lock.release()
            finally:
                if done is None:  # busy, or cut short: this process's next verb frees it
                    self.deferred.append((idx, gen))
        if self.detach_when_idle and not self.counts:
            self._on_idle()

    def free_deferred(self, give_up: Callable[[int, int], object]) -> None:
        """Do what finalizers could not without waiting for a lock (called at the start of a verb): free each
        deleted entry whose last pin went, and ``give_up`` (:meth:`Puts.give_up`) each entry of a writer
        dropped unsealed.

        The two kinds are told apart by the entry's state: a writer's is ``writing`` until given up, and
        an entry pinned at generation ``gen`` was sealed then, so it is never ``writing`` at ``gen``
        again. Either step checks the generation under the lock and does nothing to a newer object.
        """
        node, supply = self._state.node, self._state.supply
        while self.deferred:
            idx, gen = self.deferred.pop()
            if L.ENTRY_HEAD.get(node.buf, node.layout.entry(idx), "state") == L.WRITING:
                give_up(idx, gen)
                continue
            with node.stripe_of(idx):
                node.free_if_unpinned(idx, gen, supply=supply)

    def add_explicit(self, kb: bytes, idx: int, gen: int) -> None:
        """Count an explicit ``pin`` of key ``kb`` (already pinned by ``up``)."""
        self.explicit.setdefault((self._state.sid, kb), [idx, gen, 0])[2] += 1

    def drop_explicit(self, kb: bytes) -> tuple[int, int] | None:
        """Undo one explicit ``pin`` of ``kb``: its (index, generation) to release, or None if none."""
        rec = self.explicit.get((self._state.sid, kb))
        if rec is None:
            return None
        rec[2] -= 1
        if rec[2] == 0:
            del self.explicit[(self._state.sid, kb)]
        return rec[0], rec[1]

    def release_explicit(self) -> None:
        """Release every explicit pin (at close)."""
        for idx, gen, count in list(self.explicit.values()):
            for _ in range(count):
                self.release(idx, gen)
        self.explicit.clear()

    def close(self) -> None:
        """Stop: releases from now on are no-ops; the row of pin bytes goes with the slot."""
        self.closed = True
        self.detach_when_idle = False
        self._row.release()


ATIME_GRAIN = 0.05  # seconds: how stale an access time may be (LRU needs no finer clock)
