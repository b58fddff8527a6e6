"""Where the spill process's log goes (see :func:`shmstore.primitives.procs.spill_output` for the choice).

Its stderr is the creator's only where that is a regular file; otherwise it
logs to a file, made at the first line so that a store without problems
leaves none. That file sits in a directory anybody may write to (the spill
root: ``/tmp``, node-local scratch) under a predictable name, so it is opened
the way shmstore opens everything there: its parents made as needed and
checked, never through a link, only a regular file of this user (a FIFO
there would not even make it wait: ``O_NONBLOCK``).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import IO

from ..config import log_level
from ..errors import ShmStoreError
from ..primitives.files import SAFE_OPEN, check_regular, make_dirs

__all__ = ["setup_logging"]

_FORMAT = "shmstore-spill[%(process)d]: %(message)s"


class _LogFile(logging.StreamHandler):  # type: ignore[type-arg]
    """Appends to ``path``, opened at the first record; where it is refused, the record goes to stderr."""

    def __init__(self, path: str) -> None:
        super().__init__(sys.stderr)
        self.path = path
        self._tried = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self._tried:
            self._tried = True
            try:
                self.setStream(_open_log(self.path))
            except OSError as exc:  # a planted name, no room, no permission: stderr is what is left
                print(f"shmstore-spill[{os.getpid()}]: cannot log to {self.path!r}: {exc}", file=sys.stderr)
        super().emit(record)


def _open_log(path: str) -> IO[str]:
    """``path`` opened for appending (made 0600 if new), only if it is a regular file of this user."""
    parent = make_dirs(os.path.dirname(path) or ".")
    try:
        fd = os.open(os.path.basename(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT | SAFE_OPEN, 0o600,
                     dir_fd=parent)
    finally:
        os.close(parent)
    try:
        check_regular(path, os.fstat(fd), os.getuid())
        return os.fdopen(fd, "a", buffering=1)  # a line at a time: readable while the process runs
    except BaseException:
        os.close(fd)
        raise


def setup_logging(log_file: str | None) -> None:
    """Log at ``SHMSTORE_LOG``'s level to ``log_file`` (time-stamped) or, if None, to stderr.

    A bad ``SHMSTORE_LOG`` costs the node nothing but the extra lines: warnings only, saying so.
    """
    try:
        level, bad = log_level(), None
    except ShmStoreError as exc:
        level, bad = logging.WARNING, exc
    handler = _LogFile(log_file) if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {_FORMAT}" if log_file else _FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
    if bad is not None:
        logging.getLogger("shmstore.spill").warning("%s; logging warnings only", bad)
