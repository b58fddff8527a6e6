"""Process-shared locks that survive their holder being killed.

:class:`ShmLock` wraps a robust, process-shared pthread mutex living in the
metadata segment. Uncontended acquire+release is two foreign calls (about a
microsecond). When a holder dies, the next acquirer gets ``EOWNERDEAD``: the
lock marks the mutex consistent and runs the ``on_recover`` callback (while
holding it) so the owner of the guarded data can repair a half-done update.

Finalizers (which may fire from the garbage collector inside a locked
section of the same thread) must never block on a store lock: they use
``acquire(blocking=False)`` and defer their work when it fails.

An exception that leaves a locked section without being raised there on
purpose (a :class:`~shmstore.errors.ShmStoreError` or a private
:class:`Orderly` one, raised with the guarded data consistent) came from
somewhere else: an asynchronous exception (``PyThreadState_SetAsyncExc``, a
signal handler the store's own did not defer, see ``interrupts.py``) or a
bug, at any instruction of the section. The section may be half done, and
its holder lives on, so nobody else would repair it: the context manager
runs the same repair a dead holder's lock gets (``on_recover``) before it
releases, which leaves the data as consistent as a SIGKILL at that
instruction would have. One instruction boundary stays open in pure Python
(the entry of ``__exit__`` before its unlock); the deferral of signals
covers it for Ctrl-C.
"""
from __future__ import annotations

import errno
from typing import Callable

from ..errors import LockTimeoutError, ShmStoreError
from . import native

__all__ = ["ShmLock", "init_lock", "Orderly"]

_trylock, _unlock = native.mutex_trylock, native.mutex_unlock
_SPIN = 40  # trylocks (~0.4 us each) before sleeping in the kernel


class Orderly(Exception):
    """A private control-flow exception raised inside a locked section with the guarded data
    consistent (no repair needed); never escapes the package."""


_ORDERLY = (ShmStoreError, Orderly)


def init_lock(addr: int) -> None:
    """Initialise the mutex at ``addr`` (creator only, before publishing)."""
    native.mutex_init(addr)


class ShmLock:
    """A robust process-shared mutex, shaped like ``threading.Lock``.

    Owned by the metadata segment: the segment's creator initialises it, and
    it disappears with the segment; nobody unlinks a lock. Process-safe and
    thread-safe, not reentrant.

    Args:
        addr: address of the mutex inside a mapping that outlives this object.
        name: used in error messages.
        timeout: default wait of the context manager, in seconds.
        on_recover: called, with the lock held, after the previous holder died.
    """

    __slots__ = ("_addr", "name", "timeout", "_on_recover")

    def __init__(self, addr: int, name: str, timeout: float = 10.0,
                 on_recover: Callable[[], None] | None = None) -> None:
        self._addr = addr
        self.name = name
        self.timeout = timeout
        self._on_recover = on_recover

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Acquire the lock; like ``threading.Lock.acquire``.

        Returns:
            True when acquired, False when not (non-blocking or timed out).
        """
        return self._finish(_trylock(self._addr), blocking, timeout)

    def _finish(self, rc: int, blocking: bool, timeout: float) -> bool:
        """Complete an acquire whose trylock returned ``rc`` (nonzero: busy or owner dead)."""
        if rc == errno.EBUSY and blocking:
            # Holds last microseconds: spinning a little beats sleeping in the
            # kernel and being woken (tens of microseconds each way).
            for _ in range(_SPIN):
                rc = _trylock(self._addr)
                if rc != errno.EBUSY:
                    break
        if rc == errno.EBUSY and blocking:
            wait = self.timeout if timeout is None or timeout < 0 else timeout
            rc = native.mutex_timedlock(self._addr, wait)
        if rc == 0:
            return True
        if rc == native.EOWNERDEAD:
            native.mutex_consistent(self._addr)
            if self._on_recover is not None:
                self._on_recover()
            return True
        if rc in (errno.EBUSY, errno.ETIMEDOUT):
            return False
        raise OSError(rc, f"lock {self.name}: {errno.errorcode.get(rc, rc)}")

    @property
    def address(self) -> int:
        return self._addr

    def recover_held(self) -> None:
        """The caller took this lock from a dead holder outside this class: repair, then release."""
        try:
            if self._on_recover is not None:
                self._on_recover()
        finally:
            self.release()

    def release(self) -> None:
        """Release the lock (held by this thread)."""
        rc = _unlock(self._addr)
        if rc:
            raise RuntimeError(f"release of lock {self.name} not held by this thread ({errno.errorcode.get(rc, rc)})")

    def locked(self) -> bool:
        """True when some thread or process holds the lock (a snapshot)."""
        if not self._finish(_trylock(self._addr), False, 0):
            return True
        _unlock(self._addr)
        return False

    def __enter__(self) -> "ShmLock":
        try:
            rc = _trylock(self._addr)
            if rc == 0:  # the uncontended fast path
                return self
            taken = self._finish(rc, True, self.timeout)
        except BaseException:  # asynchronous, after the lock was taken: __exit__ will not run
            _unlock(self._addr)  # EPERM, harmless, where this thread does not hold it
            raise
        if not taken:
            raise LockTimeoutError(
                f"lock {self.name} not acquired within {self.timeout:g} s: another process holds it "
                f"(raise lock_timeout= / SHMSTORE_LOCK_TIMEOUT, or check for a stopped process)"
            )
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        if exc_type is not None and self._on_recover is not None and not issubclass(exc_type, _ORDERLY):
            try:  # not raised on purpose: the section may be half done (see the module notes)
                self._on_recover()
            finally:
                _unlock(self._addr)
            return
        if _unlock(self._addr):
            raise RuntimeError(f"release of lock {self.name} not held by this thread")

    def __repr__(self) -> str:
        return f"<ShmLock {self.name}>"
