"""Supervising a node store's spill process from its clients: starting it, finding it alive and started.

Every client of a store may start the store's spill process: the first one
to connect, and any one that finds it gone (killed, or exited with its last
client) when it needs it (a put waiting for room, ``spill/requests.py``).
Under the store's ADMIN lock one of them starts it and writes its pid into
the header, so two clients never start two. It runs
``python -m shmstore.spill`` in a session of its own (a Ctrl-C, Ctrl-\\ or
hangup of the creator's terminal never reaches it), holding none of the
starter's stdio (``primitives/procs.py``: where it logs), with one BLAS
thread. The metadata it leaves (its pid, its heartbeat) is the node
store's; what to do with a process is this module's.
"""
from __future__ import annotations

import os
import subprocess
import sys

from ..meta import layout as L
from ..node.nodestore import NodeStore
from ..primitives.procs import pid_alive, reap_children, spawned, spill_output

__all__ = ["ensure_spill", "spill_alive", "spill_booted", "log_path"]

_SPILL_THREADS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def ensure_spill(node: NodeStore) -> int:
    """Start the store's spill process if none runs; returns its pid."""
    reap_children()
    with node.admin:
        pid = node.spill_pid()
        if pid_alive(pid):
            return pid
        # unlinked behind our back: one started now would open, by name, another store, and leave at once (see
        # spill/process.py)
        if node.meta.named() is False:
            return pid
        stderr, log = spill_output(log_path(node))
        # a session of its own: a Ctrl-C, Ctrl-\ or hangup of the creator's terminal never reaches it
        proc = subprocess.Popen(
            [sys.executable, "-m", "shmstore.spill", "--name", node.cfg.name, "--node", node.cfg.node,
             "--spill-dir", node.cfg.spill_dir, *(["--log-file", log] if log else [])],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
            start_new_session=True, close_fds=True, env={**os.environ, **_SPILL_THREADS})
        spawned.append(proc)
        L.HEAD.set(node.buf, "spill_pid", proc.pid)
        return proc.pid


def log_path(node: NodeStore) -> str:
    """The file the spill process logs to where its creator's stderr is not a file (see
    :func:`~shmstore.primitives.procs.spill_output`): beside the store's spill directory, outliving it."""
    return node.spill_path + ".log"


def spill_alive(node: NodeStore) -> bool:
    """Whether the process the header names as the spill process is alive."""
    return pid_alive(node.spill_pid())


def spill_booted(node: NodeStore) -> bool:
    """Whether a spill process finished starting (its imports, its recovery): its first heartbeat."""
    return bool(L.SPILL_STATE.get(node.buf, L.SPILL_OFFSET, "heartbeat"))
