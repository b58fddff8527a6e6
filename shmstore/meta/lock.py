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
instruction would have.

Python checks for asynchronous exceptions when a Python function starts
and after each call of a C function; it never does between a Python
function's return and its caller's next instruction, nor inside a C call.
So ``__enter__`` and ``acquire`` (Python) take the lock inside a ``try``
that unlocks again, and ``__exit__`` and ``release`` are C methods
(``_fast.LockBase``) that unlock before any Python runs, except the repair:
no exception can land between taking the lock and the code that releases
it. Without the C helper (``SHMSTORE_PURE_PYTHON=1``) the first instruction
of ``__exit__`` stays such a point; the deferral of signals covers it for
Ctrl-C.

A lock taken from a dead holder is made consistent and repaired in one C
call (``_fast.recover``), and the C fast paths that take a stripe lock
themselves repair and release one they take from a dead holder before they
return (``_fast.c``'s ``try_take``, through :func:`_repair_at`): a lock handed
back held for the caller to repair stayed held for good where an exception
came before the caller's next line, and a repair cut short at its first
instruction repaired nothing. A repair that raises runs once more.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Callable, Literal, TypeVar

from ..errors import LockTimeoutError, ShmStoreError
from ..primitives import native
from .fastpath import load as _load_fast

__all__ = ["ShmLock", "init_lock", "Orderly", "holding", "held_here"]

_trylock, _unlock = native.mutex_trylock, native.mutex_unlock
_SPIN = 40  # trylocks (~0.4 us each) before sleeping in the kernel


class Orderly(Exception):
    """A private control-flow exception raised inside a locked section with the guarded data
    consistent (no repair needed); never escapes the package."""


_ORDERLY = (ShmStoreError, Orderly)


_T = TypeVar("_T")


def holding(locks: Sequence[ShmLock], fn: Callable[[], _T]) -> _T:
    """``fn()`` with every lock of ``locks`` held (taken in order), each released whatever happens.

    One ``with`` per lock, nested by recursion: a loop of releases (or an
    ``ExitStack``) would leave the rest held when an asynchronous exception
    lands between two of them.

    Raises:
        LockTimeoutError: a lock stayed taken for its timeout (those taken are released).
    """
    if not locks:
        return fn()
    with locks[0]:
        return holding(locks[1:], fn)


def _owner(addr: int) -> int:
    """The thread id glibc's ``pthread_mutex_t`` keeps at byte 8 (x86-64 and aarch64): its holder, else 0."""
    return ctypes.c_int.from_address(addr + 8).value


def _held_here(addr: int) -> bool:
    """Whether the calling thread holds the mutex at ``addr``."""
    return _owner(addr) == threading.get_native_id()


def held_here(locks: Sequence[ShmLock]) -> list[str]:
    """The names of the locks of ``locks`` that the calling thread holds (a few hundred ns a lock)."""
    return [lock.name for lock in locks if _held_here(lock.address)]


def holder(addr: int) -> str:
    """Who holds the mutex at ``addr``, for an error message: glibc's ``pthread_mutex_t`` keeps the owner's
    thread id at byte 8 (x86-64 and aarch64); its process and name from ``/proc``; "another process" where
    that cannot be read (or the holder left meanwhile)."""
    try:
        tid = _owner(addr)
        if tid <= 0:
            return "another process"
        with open(f"/proc/{tid}/status") as f:
            status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        pid, name, state = status["Tgid"].strip(), status["Name"].strip(), status["State"].strip()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
        if int(pid) == os.getpid():  # this process: the Python thread's name says more
            name = next((t.name for t in threading.enumerate() if t.native_id == tid), name)
            return f"thread {tid} ({name}, {state}) of this process"
        return f"thread {tid} ({name}, {state}) of pid {pid} ({cmd})"
    except (OSError, KeyError, ValueError):
        return "another process"


def init_lock(addr: int) -> None:
    """Initialise the mutex at ``addr`` (creator only, before publishing)."""
    native.mutex_init(addr)


class _PyLockBase:
    """The unlocking half of :class:`ShmLock` in Python, where the C helper is not built (or
    ``SHMSTORE_PURE_PYTHON=1``): the same, but with the one open instruction boundary noted above."""

    __slots__ = ("_mutex",)

    def __init__(self, addr: int) -> None:
        self._mutex = addr

    def _abandon(self, exc_type: type[BaseException]) -> None:
        raise NotImplementedError

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> Literal[False]:
        if exc_type is not None:
            try:
                self._abandon(exc_type)
            finally:
                _unlock(self._mutex)
            return False
        self.release()
        return False

    def release(self) -> None:
        """Release the lock (held by this thread)."""
        rc = _unlock(self._mutex)
        if rc:
            raise RuntimeError(f"release of a lock this thread does not hold ({errno.errorcode.get(rc, rc)})")


_fast: Any = _load_fast()
_LockBase: Any = _PyLockBase if _fast is None else _fast.LockBase
# the locks with a repair, by address: the C fast paths repair a lock they take from a dead holder themselves
_REPAIRABLE: weakref.WeakValueDictionary[int, ShmLock] = weakref.WeakValueDictionary()


def _repair_at(addr: int) -> None:
    """The repair of the lock at ``addr``, which a C fast path took from a dead holder and holds meanwhile
    (``_fast.c``'s ``try_take``: it releases the lock once this returns or raises)."""
    lock = _REPAIRABLE.get(addr)
    if lock is not None and lock._on_recover is not None:
        lock._on_recover()


if _fast is not None:
    _fast.set_repairer(_repair_at)


class ShmLock(_LockBase):  # type: ignore[misc]
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

    __slots__ = ("_addr", "name", "timeout", "_on_recover", "__weakref__")

    def __init__(self, addr: int, name: str, timeout: float = 10.0,
                 on_recover: Callable[[], None] | None = None) -> None:
        _LockBase.__init__(self, addr)  # __exit__ and release (C where built): unlock before anything else
        self._addr = addr
        self.name = name
        self.timeout = timeout
        self._on_recover = on_recover
        if on_recover is not None:
            _REPAIRABLE[addr] = self

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Acquire the lock; like ``threading.Lock.acquire``.

        Returns:
            True when acquired, False when not (non-blocking or timed out).
        """
        try:
            return self._finish(_trylock(self._addr), blocking, timeout)
        # asynchronous, maybe after the lock was taken: nobody would release it
        except BaseException:
            _unlock(self._addr)  # EPERM, harmless, where this thread does not hold it
            raise

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
            if _held_here(self._addr):  # by this very thread: the wait would never end (see __enter__)
                return False
            wait = self.timeout if timeout is None or timeout < 0 else timeout
            rc = native.mutex_timedlock(self._addr, wait)
        if rc == 0:
            return True
        if rc == native.EOWNERDEAD:
            if _fast is not None:  # consistent and repaired in one C call: no exception lands in between
                _fast.recover(self._addr, self._on_recover)
                return True
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

    def locked(self) -> bool:
        """True when some thread or process holds the lock (a snapshot)."""
        try:
            if not self._finish(_trylock(self._addr), False, 0):
                return True
        except BaseException:  # a dead holder's repair raised, or an asynchronous exception: taken, so released
            _unlock(self._addr)  # EPERM, harmless, where this thread does not hold it
            raise
        _unlock(self._addr)
        return False

    def __enter__(self) -> ShmLock:
        try:
            rc = _trylock(self._addr)
            if rc == 0:  # the uncontended fast path
                return self
            taken = self._finish(rc, True, self.timeout)
        except BaseException:  # asynchronous, after the lock was taken: __exit__ will not run
            _unlock(self._addr)  # EPERM, harmless, where this thread does not hold it
            raise
        if not taken:
            if _held_here(self._addr):
                raise LockTimeoutError(
                    f"lock {self.name} is held by this very thread ({threading.current_thread().name}): taken and "
                    f"never released, or taken again inside its own section; waiting would never end (a bug in "
                    f"shmstore: please report it with this traceback)")
            raise LockTimeoutError(
                f"lock {self.name} not acquired within {self.timeout:g} s: {holder(self._addr)} holds it "
                f"(raise lock_timeout= / SHMSTORE_LOCK_TIMEOUT, or check for a stopped process)"
            )
        return self

    def abandon(self, exc: BaseException) -> None:
        """What ``__exit__`` does before it unlocks when ``exc`` leaves the section, for a section
        written as ``acquire()`` / ``try`` / ``release()`` (call it from an ``except`` clause)."""
        self._abandon(type(exc))

    def _abandon(self, exc_type: type[BaseException]) -> None:
        """Called by ``__exit__`` (before it unlocks) when an exception leaves the section."""
        if self._on_recover is not None and not issubclass(exc_type, _ORDERLY):
            # not raised on purpose: the section may be half done (see the module notes)
            self._on_recover()

    def __repr__(self) -> str:
        return f"<ShmLock {self.name}>"
