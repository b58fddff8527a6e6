"""Processes: is a pid still the process we knew (alive: not dead, dying or a zombie), and the spill processes this
one started."""
from __future__ import annotations

import os
import stat
import subprocess

from ..config import log_file

__all__ = ["proc_start_time", "pid_alive", "reap_children", "spawned", "spill_output", "stop_spawned", "allowed_cpus",
           "unpin"]

spawned: list[subprocess.Popen[bytes]] = []  # spill processes started by this process, until reaped


# /proc/<pid>/stat flags: the process is in do_exit, never to run user code again
_PF_EXITING = 0x4
_SIGKILL_BIT = 1 << (9 - 1)  # SIGKILL in the pending-signal masks of /proc/<pid>/status


def proc_start_time(pid: int) -> int | None:
    """Start time of a live process (clock ticks since boot); None if gone, a zombie, or exiting."""
    stat = _running(pid)
    return None if stat is None else int(stat[19])


def pid_alive(pid: int, start: int = 0) -> bool:
    """True if ``pid`` runs and (when ``start`` is given) is the same process.

    A process that is dead but not yet reaped is not alive: a zombie, one
    exiting (its memory being torn down, which takes milliseconds for a
    process with large mappings), or one SIGKILLed that has not begun to
    exit. The spill process SIGKILLed just before its store's last client
    closed looked alive to that client, which then left the store to it
    (woke it) instead of removing the store itself: the store stayed in
    /dev/shm for good.
    """
    stat = _running(pid) if pid > 0 else None
    if stat is None or (start and int(stat[19]) != start):
        return False  # gone, dying, or the pid names another process now
    # a sleeping process is woken by a SIGKILL at once (state R): only a running one may have it pending
    return stat[0] == b"S" or not _sigkill_pending(pid)


def _running(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (the state first), None if the process is gone,
    a zombie or exiting."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(stat) < 20 or stat[0] in (b"Z", b"X") or int(stat[6]) & _PF_EXITING:
        return None
    return stat


def _sigkill_pending(pid: int) -> bool:
    """Whether ``pid`` has a SIGKILL pending (sent, not yet acted on); True if it is gone meanwhile."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            masks = [line.split()[1] for line in f if line.startswith((b"SigPnd:", b"ShdPnd:"))]
    except OSError:
        return True
    return any(int(m, 16) & _SIGKILL_BIT for m in masks)


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


def allowed_cpus() -> set[int]:
    """The CPUs this process's cgroup may use (the job's cpuset under Slurm's task/cgroup: cgroup v2
    ``cpuset.cpus.effective``, or v1 ``cpuset.effective_cpus``), whatever this process's own affinity; every
    online CPU where no cpuset says (the kernel keeps an affinity within the cpuset anyway)."""
    for text in _cpuset_lists():
        cpus = _parse_cpu_list(text)
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


def _cpuset_lists() -> list[str]:
    out: list[str] = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            files = [f"/sys/fs/cgroup{path.rstrip('/')}/cpuset.cpus.effective"]
        elif "cpuset" in controllers.split(","):
            files = [f"/sys/fs/cgroup/cpuset{path.rstrip('/')}/{n}" for n in ("cpuset.effective_cpus", "cpuset.cpus")]
        else:
            continue
        for name in files:
            try:
                with open(name) as f:
                    out.append(f.read().strip())
            except OSError:
                continue
    return out


def _parse_cpu_list(text: str) -> set[int]:
    """``0-3,8,10-11`` -> {0, 1, 2, 3, 8, 10, 11}; empty where it does not parse."""
    cpus: set[int] = set()
    try:
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        return set()
    return cpus


def unpin() -> set[int]:
    """Let this process run on every CPU its cgroup allows (:func:`allowed_cpus`), not only on those of the
    process that started it: a spill process started by a rank that the MPI launcher or ``srun --cpu-bind``
    pinned to one core would share that core with the rank. Returns the affinity it has afterwards."""
    try:
        os.sched_setaffinity(0, allowed_cpus())
    except OSError:  # a cpuset that changed meanwhile, or no right to: keep the inherited one
        pass
    return os.sched_getaffinity(0)
