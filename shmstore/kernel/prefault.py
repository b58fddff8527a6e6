"""Prefaulting: the arena's pages faulted in ahead of use, so puts write warm pages.

Fresh tmpfs pages cost about 0.65 s per GiB to fault in whoever touches them
first. A background thread of the creating process faults the metadata and
then the arena in with ``MADV_POPULATE_WRITE``, keeping ``prefault`` bytes
ahead of the allocator's frontier; a writer that reaches past what is
populated faults its range in first, so a full /dev/shm is a
``StorageFullError``, never a SIGBUS.
"""
from __future__ import annotations

import os
import threading
import time

from ..errors import StorageFullError
from ..units import format_size
from . import layout as L

__all__ = ["Prefaulting"]

_POPULATE_CHUNK = 32 << 20


class Prefaulting:
    """The prefaulting side of :class:`~shmstore.kernel.node.NodeStore` (a mixin)."""

    def start_populating(self, prefault: int) -> None:
        """Fault the arena in ahead of use, in a background thread of this process."""
        self._stop = threading.Event()
        self._populator = threading.Thread(target=self._populate_loop, args=(prefault, self._stop),
                                           name="shmstore-prefault", daemon=True)
        self._populator.start()

    def _populate_loop(self, prefault: int, stop: threading.Event) -> None:
        # the metadata first: first touches of its pages cost ~10 us each in a put
        for off in range(0, self.meta.size, _POPULATE_CHUNK):
            if stop.is_set() or self.meta.populate(off, min(_POPULATE_CHUNK, self.meta.size - off)):
                break
        while not stop.is_set():
            target = min(self.capacity, max(prefault, L.frontier(self.meta.mm) + prefault))
            if self.populated >= target:
                stop.wait(0.2)
                continue
            n = min(_POPULATE_CHUNK, target - self.populated)
            if self.arena.populate(self.populated, n):
                return  # tmpfs full or kernel too old: writers populate what they use
            self.populated += n

    def wait_populated(self, nbytes: int, timeout: float = 60.0) -> bool:
        """Wait until the first ``nbytes`` of the arena are faulted in here."""
        deadline = time.monotonic() + timeout
        while self.populated < min(nbytes, self.capacity):
            if time.monotonic() > deadline or self._populator is None or not self._populator.is_alive():
                return False
            time.sleep(0.005)
        return True

    def ensure_populated(self, offset: int, length: int, key: str) -> None:
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
                f"({os.strerror(rc)}; free /dev/shm or lower capacity= / SHMSTORE_CAPACITY)",
                object_id=key, requested=length)
