"""Ending the job when a rank fails: a Cluster left by an exception, and the uncaught exception after it.

A Cluster is collective: its ``close`` waits in a barrier for every rank.
When one rank raises inside ``with Cluster() as c:`` while the others wait
for it (in a ``get`` from its node, in a ``barrier``), a collective close
would wait for them just as they wait for it: the job sat until its time
limit, and the traceback was never printed (it comes after ``__exit__``).
So a Cluster left by an exception leaves without any collective call
(:func:`leave`), and an exception that nobody catches while a
Cluster is open, or after one was left that way, prints its traceback and
aborts the job with ``MPI_Abort`` (status 1; 130 for Ctrl-C): what
``python -m mpi4py`` does at exit, done at once, and done too for a script
started as ``python script.py`` (under plain ``srun`` or ``mpiexec`` a rank
that merely exits leaves the others waiting). An exception the program
catches aborts nothing.

Every node's store is cleaned as after any killed job: the spill process
reclaims what the aborted ranks held and removes the store with its spill
files once no client is left (the Slurm epilog's ``shmstore gc`` where the
batch system killed the spill processes too).
"""
from __future__ import annotations

import fcntl
import os
import stat
import struct
import sys
import termios
import time
from types import TracebackType
from typing import Any, Callable

from mpi4py import MPI

__all__ = ["opened", "closed", "leave", "armed"]

# clusters of this process open (created and not closed) a cluster of this process was left by an exception
_open = 0
_left = False
_previous: Callable[..., Any] | None = None  # the excepthook ours calls first (it prints the traceback)


def opened() -> None:
    """A Cluster was created: an uncaught exception from now on ends the job."""
    global _open
    _open += 1
    _install()


def closed() -> None:
    """A Cluster was closed collectively (every rank did the same)."""
    global _open
    _open = max(0, _open - 1)


def leave(exc: BaseException | None = None) -> None:
    """A Cluster is left by the exception ``exc`` on this rank alone (it then stops its service, whose ranks
    asking get no answer: they end with the job, or time out, and closes its store; no collective call: its
    communicators are not freed, freeing is collective). If nobody catches the exception, the job ends; a
    ``sys.exit(status)`` (no excepthook sees it) ends it with that status at exit, as ``-m mpi4py`` would."""
    global _left
    _left = True
    _install()
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else 1
        # mpi4py's own mechanism: MPI_Abort(code) instead of MPI_Finalize at exit
        MPI._set_abort_status(code)


def armed() -> bool:
    """Whether an uncaught exception now aborts the job."""
    return _left or _open > 0


def _install() -> None:
    global _previous
    if sys.excepthook is not _excepthook:
        _previous = sys.excepthook
        sys.excepthook = _excepthook


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """Print the traceback (through the hook we replaced), then abort the job if a Cluster needs it."""
    try:
        (_previous or sys.__excepthook__)(kind, value, tb)
    finally:
        if armed():
            _abort(130 if issubclass(kind, KeyboardInterrupt) else 1)


def _abort(status: int) -> None:
    """Say which rank ends the job, let the output out, and end it: ``MPI_Abort`` (the launcher kills every
    rank)."""
    try:
        sys.stdout.flush()
        print(f"shmstore.mpi: rank {MPI.COMM_WORLD.rank} of {MPI.COMM_WORLD.size} raised the exception above "
              f"with a Cluster open: aborting the job (MPI_Abort({status}))", file=sys.stderr, flush=True)
    except Exception:  # a closed stream must not keep the job alive
        pass
    _let_output_out()
    MPI.COMM_WORLD.Abort(status)


def _let_output_out(limit: float = 1.0) -> None:
    """Wait (``limit`` seconds at most) until the launcher has read what this rank wrote to its stdout and
    stderr pipes, and a moment for it to pass it on: ``MPI_Abort`` tears the job down at once, and hydra's
    proxies (and srun's) dropped the traceback still in the pipe one run in six."""
    deadline = time.monotonic() + limit
    for fd in (1, 2):
        while time.monotonic() < deadline and _unread(fd):
            time.sleep(0.01)
    time.sleep(0.1)


def _unread(fd: int) -> int:
    """Bytes written to ``fd`` that its reader has not read yet (a pipe's, or a socket's send queue; 0 where
    ``fd`` is neither)."""
    try:
        request = termios.TIOCOUTQ if stat.S_ISSOCK(os.fstat(fd).st_mode) else termios.FIONREAD
        return int(struct.unpack("i", fcntl.ioctl(fd, request, b"\0\0\0\0"))[0])
    except OSError:
        return 0
