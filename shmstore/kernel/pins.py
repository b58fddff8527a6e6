"""Pins: what keeps a stored object still while this process uses it.

A process's pins on an entry are counted locally (``Kernel._pins``: entry
index -> count) and published as one byte per entry in this client's row of
the pin table, which is what the spill process and other clients look at.
Views, readers and explicit ``pin`` calls each hold one local pin; the last
one to go clears the byte, and frees the entry if it was deleted meanwhile
(never blocking: it may run as a finalizer inside a locked section).
"""
from __future__ import annotations

from ..errors import InvalidArgumentError
from . import layout as L

__all__ = ["Pinning"]


class Pinning:
    """The pin side of :class:`~shmstore.kernel.Kernel` (a mixin: it uses the kernel's state)."""

    def _release(self, idx: int, gen: int) -> None:
        """Drop one local pin (from a finalizer, a reader or ``unpin``); takes no store lock
        unless the object was deleted meanwhile."""
        if self._detached:
            return
        if self._fast is not None:
            last = self._fast.release(self._ctx, idx)  # 0: still pinned here, 1: last pin, 2: last and deleted
            if not last:
                return
            deleted = last == 2
        else:
            if not self._pin_down(idx):
                return
            deleted = L.entry_state(self._buf, self._lay.entry(idx)) == L.DELETED
        if deleted:
            lock = self.node.stripe_of(idx)
            # never block here: this may be a finalizer inside a locked section of this thread
            done = None
            if lock.acquire(blocking=False):
                try:
                    done = self.node.free_if_unpinned(idx, gen, blocking=False, cache=self._cache)
                finally:
                    lock.release()
            if done is None:
                self._deferred.append((idx, gen))
        if self._detach_when_unpinned and not self._pins:
            self._detach()

    def _pin_up(self, idx: int) -> None:
        """One more local pin on ``idx`` (its stripe lock held); the first sets our pin byte."""
        if self._fast is not None:  # one C call holding the GIL: atomic for the threads of this process
            self._fast.pin(self._pins, idx, self._pin_addr)
            return
        with self._plock:
            n = self._pins.get(idx, 0)
            if not n:
                self._pinrow[idx] = 1
            self._pins[idx] = n + 1

    def _pin_down(self, idx: int) -> bool:
        """One local pin less on ``idx`` (no lock); True when it was the last one."""
        if self._fast is not None:
            return self._fast.unpin(self._pins, idx, self._pin_addr)
        with self._plock:  # no allocation of GC-tracked objects inside: no finalizer can run here
            n = self._pins.get(idx, 0) - 1
            if n > 0:
                self._pins[idx] = n
                return False
            if n < 0:
                return False
            del self._pins[idx]
            self._pinrow[idx] = 0
            return True

    def pin(self, key: str) -> None:
        """Pin ``key`` (counted): spill never moves it until as many ``unpin``.

        Raises:
            ObjectNotFoundError: no such object.
        """
        kb = self._begin(key)
        idx, e, _ = self.lookup(key, kb, True)
        self._explicit.setdefault((self.sid, kb), [idx, e[L.E_GEN], 0])[2] += 1

    def unpin(self, key: str) -> None:
        """Undo one ``pin`` of ``key`` by this process.

        Raises:
            InvalidArgumentError: this process holds no pin on ``key``.
        """
        kb = self._begin(key)
        rec = self._explicit.get((self.sid, kb))
        if rec is None:
            raise InvalidArgumentError(f"{key!r} is not pinned by this process")
        rec[2] -= 1
        if rec[2] == 0:
            del self._explicit[(self.sid, kb)]
        self._release(rec[0], rec[1])
