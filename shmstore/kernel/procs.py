"""Processes: is a pid still the process we knew, and the spill processes this one started."""
from __future__ import annotations

import os
import stat
import subprocess

from ..config import log_file

__all__ = ["proc_start_time", "pid_alive", "reap_children", "spawned", "spill_output", "stop_spawned"]

spawned: list[subprocess.Popen[bytes]] = []  # spill processes started by this process, until reaped


def proc_start_time(pid: int) -> int | None:
    """Start time of a live process (clock ticks since boot); None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def pid_alive(pid: int, start: int = 0) -> bool:
    """True if ``pid`` runs and (when ``start`` is given) is the same process."""
    if pid <= 0:
        return False
    now = proc_start_time(pid)
    return now is not None and (not start or now == start)


def reap_children() -> None:
    """Collect exited spill processes this process started (no zombies)."""
    for p in list(spawned):
        if p.poll() is not None:
            spawned.remove(p)


def stop_spawned(pid: int) -> bool:
    """SIGTERM the spill process ``pid`` if this process started it and has not reaped it (so the pid still
    names that very process); True if it was sent."""
    for p in spawned:
        if p.pid == pid and p.poll() is None:
            p.terminate()
            return True
    return False


def spill_output(default_log: str) -> tuple[int | None, str | None]:
    """Where a spill process about to be started logs: (its stderr for ``Popen``, its ``--log-file``).

    A spill process outlives the process that starts it, so it must not hold
    that process's stdio: a runner reading the creator's output through a
    pipe (``subprocess.run(capture_output=True)``, ``| tee``, ``srun``'s
    step I/O) waited for the pipe's end until the store's last client closed,
    and a terminal stayed held after logout. Its stdin and stdout are
    /dev/null; its log (problems only, unless ``SHMSTORE_LOG``) goes to

    1. ``SHMSTORE_LOG_FILE`` if set (``stderr``: the creator's stderr, whatever it is);
    2. else the creator's stderr if that is a regular file (a batch job's output file,
       ``2> log``): nobody waits for a file's end;
    3. else ``default_log`` (``<spill root>/shmstore-<uid>-<name>-<node>.log``), made at the
       first line logged, so a store without problems leaves no file.
    """
    chosen = log_file()
    if chosen == "stderr":
        return None, None
    if chosen:
        return subprocess.DEVNULL, os.path.abspath(chosen)
    try:
        inherit = stat.S_ISREG(os.fstat(2).st_mode)
    except OSError:  # no stderr at all
        inherit = False
    return (None, None) if inherit else (subprocess.DEVNULL, default_log)
