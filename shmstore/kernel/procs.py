"""Processes: is a pid still the process we knew, and the spill processes this one started."""
from __future__ import annotations

import subprocess

__all__ = ["proc_start_time", "pid_alive", "reap_children", "spawned"]

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
