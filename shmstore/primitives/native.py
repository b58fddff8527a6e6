"""The only ctypes in shmstore: libc's robust pthread mutexes, madvise, the timer slack, the scheduler slice and
futexes.

Foreign calls through ctypes release the GIL, which is what we want for both a
blocking lock and a long ``madvise(MADV_POPULATE_WRITE)``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import platform
import time
from typing import Any

__all__ = [
    "EOWNERDEAD", "ENOTRECOVERABLE", "address_of",
    "mutex_init", "mutex_trylock", "mutex_timedlock", "mutex_unlock",
    "mutex_consistent", "populate_write", "set_timer_slack", "set_slice", "futex_wait", "futex_wake",
    "current_cpu",
]

_LIBC_NAME = ctypes.util.find_library("c") or None
_libc = ctypes.CDLL(_LIBC_NAME, use_errno=True)
# trylock/unlock never block: call them without dropping the GIL (saves ~0.3 us a pair)
_pylibc = ctypes.PyDLL(_LIBC_NAME)

EOWNERDEAD = errno.EOWNERDEAD
ENOTRECOVERABLE = errno.ENOTRECOVERABLE
_PTHREAD_PROCESS_SHARED = 1
_PTHREAD_MUTEX_ROBUST = 1
_MADV_POPULATE_READ = 22   # Linux 5.14; Python 3.11's mmap lacks the constants
_MADV_POPULATE_WRITE = 23
_CLOCK_MONOTONIC = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _fn(name: str, *argtypes: Any, lib: ctypes.CDLL = _libc) -> Any:
    f = getattr(lib, name)
    f.argtypes = list(argtypes)
    f.restype = ctypes.c_int
    return f


_vp = ctypes.c_void_p
_attr_init = _fn("pthread_mutexattr_init", _vp)
_attr_setpshared = _fn("pthread_mutexattr_setpshared", _vp, ctypes.c_int)
_attr_setrobust = _fn("pthread_mutexattr_setrobust", _vp, ctypes.c_int)
_attr_destroy = _fn("pthread_mutexattr_destroy", _vp)
_init = _fn("pthread_mutex_init", _vp, _vp)
mutex_trylock = _fn("pthread_mutex_trylock", _vp, lib=_pylibc)
mutex_unlock = _fn("pthread_mutex_unlock", _vp, lib=_pylibc)
mutex_consistent = _fn("pthread_mutex_consistent", _vp)
try:  # glibc >= 2.30: waits on CLOCK_MONOTONIC, immune to clock steps
    _clocklock = _fn("pthread_mutex_clocklock", _vp, ctypes.c_int, ctypes.POINTER(_Timespec))
except AttributeError:  # pragma: no cover - old glibc
    _clocklock = None
_timedlock = _fn("pthread_mutex_timedlock", _vp, ctypes.POINTER(_Timespec))
_madvise = _fn("madvise", _vp, ctypes.c_size_t, ctypes.c_int)
_prctl = _fn("prctl", ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
_PR_SET_TIMERSLACK = 29
try:
    _getcpu = _fn("sched_getcpu", lib=_pylibc)
except AttributeError:  # pragma: no cover - a libc without it
    _getcpu = None


def current_cpu() -> int:
    """The CPU the calling thread runs on (-1: unknown)."""
    return int(_getcpu()) if _getcpu is not None else -1


_syscall = _libc.syscall  # variadic: every argument passed with its C type
_syscall.restype = ctypes.c_long
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}.get(platform.machine()) \
    if ctypes.sizeof(ctypes.c_void_p) == 8 else None  # (the kernel's machine: a 32-bit Python's numbers differ)
_FUTEX_OK = (0, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT)  # woken, the word differed, a signal, the timeout
# shared (not FUTEX_PRIVATE_FLAG): keyed on the shared page, across processes
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_FUTEX_POLL = 0.0005  # where there is no futex syscall: the nap of futex_wait


def address_of(mm: mmap.mmap) -> tuple[int, object]:
    """Base address of a mapping, plus the export that keeps it valid.

    The returned object holds a buffer export on ``mm``: drop it before
    ``mm.close()``.
    """
    anchor = ctypes.c_char.from_buffer(mm)
    return ctypes.addressof(anchor), anchor


def mutex_init(addr: int) -> None:
    """Initialise a robust, process-shared mutex at ``addr``.

    Raises:
        OSError: pthread refused.
    """
    attr = ctypes.create_string_buffer(64)
    for rc in (_attr_init(attr), _attr_setpshared(attr, _PTHREAD_PROCESS_SHARED),
               _attr_setrobust(attr, _PTHREAD_MUTEX_ROBUST), _init(addr, attr)):
        if rc:
            raise OSError(rc, f"pthread mutex init: {errno.errorcode.get(rc, rc)}")
    _attr_destroy(attr)


def mutex_timedlock(addr: int, timeout: float) -> int:
    """Wait up to ``timeout`` seconds; returns 0, ETIMEDOUT or EOWNERDEAD."""
    if _clocklock is not None:
        deadline = time.monotonic() + timeout
        ts = _Timespec(int(deadline), int((deadline % 1) * 1e9))
        return int(_clocklock(addr, _CLOCK_MONOTONIC, ctypes.byref(ts)))
    deadline = time.time() + timeout  # pragma: no cover - old glibc
    ts = _Timespec(int(deadline), int((deadline % 1) * 1e9))
    return int(_timedlock(addr, ctypes.byref(ts)))


def populate_write(addr: int, length: int) -> int:
    """Fault pages in for writing without touching their contents.

    Returns 0, or an errno: EINVAL where the kernel lacks MADV_POPULATE_WRITE,
    EFAULT/ENOMEM where the backing tmpfs is full (where a plain write would
    have raised SIGBUS).
    """
    if length <= 0:
        return 0
    if _madvise(addr, length, _MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()


def populate_read(addr: int, length: int) -> int:
    """Map pages that exist already (a read-only mapping of shared memory another mapping faulted in) without
    touching them: one call instead of a minor fault per 64 KiB on the first read. Returns 0 or an errno."""
    if length <= 0:
        return 0
    if _madvise(addr, length, _MADV_POPULATE_READ) == 0:
        return 0
    return ctypes.get_errno()


def set_timer_slack(ns: int) -> bool:
    """Let the calling thread's sleeps overshoot by at most ``ns`` (Linux's default is 50 us).

    A thread that polls with short sleeps (an MPI service) then wakes about
    when asked instead of ~50 us late. Per thread; True where it took effect.
    """
    return bool(_prctl(_PR_SET_TIMERSLACK, max(1, int(ns)), 0, 0, 0) == 0)


def futex_wait(addr: int, expected: int, timeout: float) -> None:
    """Sleep while the 32-bit word at ``addr`` (in a shared mapping) holds ``expected``: until
    :func:`futex_wake` on it, a signal, or ``timeout`` seconds. Returns at once where it holds another value.
    Where the architecture's futex call is not known here, or the call is refused, a nap of at most 0.5 ms:
    the caller looks again.
    """
    timeout = max(0.0, timeout)
    if _SYS_FUTEX is None:  # pragma: no cover - other architectures
        time.sleep(min(timeout, _FUTEX_POLL))
        return
    ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
    if _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT),
                ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts), ctypes.c_void_p(0), ctypes.c_int(0)) \
            and ctypes.get_errno() not in _FUTEX_OK:  # refused (a seccomp filter, ENOSYS): nap as before
        time.sleep(min(timeout, _FUTEX_POLL))


def futex_wake(addr: int) -> None:
    """Wake every process sleeping in :func:`futex_wait` on the word at ``addr``."""
    if _SYS_FUTEX is not None:
        _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
                 ctypes.c_int(0x7FFFFFFF), ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_int(0))


_SYS_SCHED_SETATTR, _SYS_SCHED_GETATTR = {"x86_64": (314, 315), "aarch64": (274, 275), "ppc64le": (355, 356),
                                          "s390x": (345, 346)}.get(platform.machine(), (None, None)) \
    if ctypes.sizeof(ctypes.c_void_p) == 8 else (None, None)


class _SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32), ("flags", ctypes.c_uint64),
                ("nice", ctypes.c_int32), ("priority", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64)]


def set_slice(ns: int) -> bool:
    """Ask the scheduler for slices of ``ns`` nanoseconds for the calling thread (``sched_attr.sched_runtime``
    of the fair policies; Linux 6.12+'s EEVDF lets a thread with a shorter slice than the running one preempt
    it when it wakes, where by default a woken thread may wait for the running one's slice to end: ~0.75-3 ms).
    Keeps the thread's policy and nice value; threads of other policies (real-time, deadline) are left as they
    are. True where the call took effect (older kernels accept it and keep their default slices)."""
    if _SYS_SCHED_SETATTR is None or _SYS_SCHED_GETATTR is None:
        return False
    attr = _SchedAttr()
    if _syscall(ctypes.c_long(_SYS_SCHED_GETATTR), ctypes.c_int(0), ctypes.byref(attr),
                ctypes.c_uint(ctypes.sizeof(attr)), ctypes.c_uint(0)) != 0:
        return False
    if attr.policy not in (0, 3):  # SCHED_OTHER, SCHED_BATCH
        return False
    attr.size, attr.flags, attr.runtime = ctypes.sizeof(attr), attr.flags & 0x01, int(ns)  # keep RESET_ON_FORK
    return bool(_syscall(ctypes.c_long(_SYS_SCHED_SETATTR), ctypes.c_int(0), ctypes.byref(attr),
                         ctypes.c_uint(0)) == 0)
