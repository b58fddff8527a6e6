"""Prefaulting: the arena's pages faulted in ahead of use, so puts write warm pages.

Fresh tmpfs pages cost about 0.65 s per GiB to fault in whoever touches them
first. A background thread of the creating process faults the metadata and
then the arena in with ``MADV_POPULATE_WRITE`` (and maps the same pages into
the arena's read-only mapping, which every view is made of, with
``MADV_POPULATE_READ``: else the first read of each 64 KiB costs a minor
fault, ~60 ms a GiB), keeping ``prefault`` bytes
ahead of the allocator's frontier and ``META_AHEAD`` entries (and extent
records) ahead of the entries handed out, never the rest of a large table
(a store sized for millions of objects costs memory only as they come); a writer that reaches past what is
populated faults its range in first, so a full /dev/shm is a
``StorageFullError``, never a SIGBUS. A client's row of pin bytes (one
byte per entry, written by every ``get``, read by others) is faulted in
the same way, as far ahead as the entries: the first stretch when the
client connects (:meth:`Prefaulter.pin_row`, which raises on a full
/dev/shm), the rest by the clients' threads (a pin byte on a page tmpfs
could not give was a SIGBUS in ``get``).
"""
from __future__ import annotations

import errno
import os
import threading
import time

from ..errors import StorageFullError
from ..meta import layout as L
from ..primitives.segment import Segment
from ..units import format_size

__all__ = ["Prefaulter"]

_POPULATE_CHUNK = 32 << 20
META_AHEAD = 65536  # entry and extent records kept faulted in ahead of those handed out


def _why(rc: int) -> str:
    """What a failed MADV_POPULATE_WRITE means (EFAULT: the pages' SIGBUS, which tmpfs gives when full)."""
    return "tmpfs full" if rc == errno.EFAULT else os.strerror(rc)


class Prefaulter:
    """Faults an arena in ahead of use, from a background thread of this process.

    Owned by the :class:`~shmstore.node.nodestore.NodeStore` of this process (one per
    mapping); ``stop`` ends its thread. Thread-safe: ``populated`` only grows.

    Args:
        meta, arena: the store's segments (the metadata is faulted in first).
        capacity: bytes of the arena.
    """

    def __init__(self, meta: Segment, arena: Segment, capacity: int, layout: L.Layout) -> None:
        self.meta, self.arena, self.capacity, self.layout = meta, arena, capacity, layout
        self._meta_done: dict[int, int] = {}  # section start -> bytes of it faulted in
        self._row: int | None = None  # offset of this process's row of pin bytes in the metadata
        self.populated = 0  # the first ``populated`` bytes of the arena are faulted in, here
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def start(self, prefault: int) -> None:
        """Keep ``prefault`` bytes ahead of the allocator's frontier faulted in."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(prefault, self._stop), name="shmstore-prefault",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (waits for its current step); idempotent."""
        if self._stop is not None:
            self._stop.set()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(10)
            self._stop = None

    def _meta(self, stop: threading.Event) -> bool:
        """Fault in the metadata in use and ahead of use (first touches cost ~10 us a page in a put);
        False where /dev/shm refused."""
        lay = self.layout
        ahead = L.entry_cursor(self.meta.mm)[0] + META_AHEAD
        sections = [(0, lay.entries),  # header, locks, clients, counters, buckets
                    (lay.entries, min(lay.max_objects, ahead) * L.ENTRY_SIZE),
                    (lay.extents, min(lay.nextents, 2 * ahead) * L.EXTENT.size),
                    (lay.migrations, self.meta.size - lay.migrations)]
        # pin rows as far as the entries: this client's first, then every slot's that was ever used (others
        # read and clear them; a tmpfs page is allocated on a read too)
        row = min(lay.max_objects, ahead)
        slots = range(L.ALLOC.get(self.meta.mm, "slots_high"))
        sections += [(start, row) for start in dict.fromkeys(
            ([self._row] if self._row is not None else []) + [lay.pinbyte(s, 0) for s in slots])]
        for start, length in sections:
            done = self._meta_done.get(start, 0)
            while done < length and not stop.is_set():
                n = min(_POPULATE_CHUNK, length - done)
                if self.meta.populate(start + done, n):
                    return False
                done += n
                self._meta_done[start] = done
        return True

    def pin_row(self, slot: int, name: str) -> None:
        """Fault in client ``slot``'s row of pin bytes as far ahead as the entries (its thread, once
        started, keeps it so).

        Raises:
            StorageFullError: /dev/shm has no pages left for it.
        """
        lay = self.layout
        self._row = lay.pinbyte(slot, 0)
        length = min(lay.max_objects, L.entry_cursor(self.meta.mm)[0] + META_AHEAD)
        rc = self.meta.populate(self._row, length)
        if rc and rc != 22:  # EINVAL: no MADV_POPULATE_WRITE in this kernel
            raise StorageFullError(
                f"cannot connect to store {name!r}: /dev/shm has no free pages left for this process's "
                f"{format_size(length)} of pin bytes ({_why(rc)}; free /dev/shm)", requested=length)
        self._meta_done[self._row] = length

    def _loop(self, prefault: int, stop: threading.Event) -> None:
        self._meta(stop)
        while not stop.is_set():
            self._meta(stop)
            target = min(self.capacity, max(prefault, L.ALLOC.get(self.meta.mm, "frontier") + prefault))
            if self.populated >= target:
                stop.wait(0.2)
                continue
            n = min(_POPULATE_CHUNK, target - self.populated)
            if self.arena.populate(self.populated, n):
                return  # tmpfs full or kernel too old: writers populate what they use
            # and the read-only mapping views are made of: a first read then costs no fault per 64 KiB
            self.arena.populate_readonly(self.populated, n)
            self.populated += n

    def wait(self, nbytes: int, timeout: float = 60.0) -> bool:
        """Wait until the first ``nbytes`` of the arena are faulted in here."""
        deadline = time.monotonic() + timeout
        while self.populated < min(nbytes, self.capacity):
            if time.monotonic() > deadline or self._thread is None or not self._thread.is_alive():
                return False
            time.sleep(0.005)
        return True

    def ensure(self, offset: int, length: int, key: str) -> None:
        """Fault a range in before writing it, so a full /dev/shm is an error, not SIGBUS.

        Raises:
            StorageFullError: /dev/shm has no pages left for the range.
        """
        if offset + length <= self.populated or length == 0:
            return
        rc = self.arena.populate(offset, length)
        if rc and rc != 22:  # EINVAL: no MADV_POPULATE_WRITE in this kernel; write and hope
            raise StorageFullError(
                f"cannot place {key!r} ({format_size(length)}): /dev/shm has no free pages left "
                f"({_why(rc)}; free /dev/shm or lower capacity= / SHMSTORE_CAPACITY)",
                object_id=key, requested=length)
