"""The per-node spill process: ``python -m shmstore.spill``.

One per node store, spawned (never forked) by the process that creates the
store, restarted by any client that finds it dead. It is the node's janitor:

- every ``POLL`` seconds it checks the registered clients; for a dead one it
  releases its pins, drops its unsealed writes and frees its slot;
- when no client is attached any more (and the store is not persistent) it
  marks the store ``destroying`` under the ADMIN lock, unlinks its segments
  and exits, logging what it reclaimed.

It ignores SIGINT (a Ctrl-C meant for the job), and on SIGTERM finishes the
current pass before exiting without destroying a store that has clients.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from .config import Config
from .errors import ShmStoreError
from .kernel import NodeStore
from .kernel import layout as L
from .kernel.janitor import janitor_pass, sweep_deleted
from .units import format_size

__all__ = ["main", "POLL"]

POLL = 0.05
log = logging.getLogger("shmstore.spill")


class _Spiller:
    """The loop of one spill process over one node store."""

    def __init__(self, node: NodeStore) -> None:
        self.node = node
        self.stopping = False
        self.label = f"{node.cfg.name}@{node.cfg.node}"

    def owns_store(self) -> bool:
        return L.spill_pid(self.node.meta.mm) == os.getpid() and L.header_state(self.node.meta.mm) == L.STATE_READY

    def run(self) -> int:
        while self.owns_store():
            for slot, pid, dropped, freed in janitor_pass(self.node):
                log.warning("%s: reclaimed client pid %d (slot %d): %d unsealed/deleted object(s), %s",
                            self.label, pid, slot, dropped, format_size(freed))
            sweep_deleted(self.node)
            if L.retired_chunks(self.node.meta.mm):
                self.node.reclaim_retired()
            if self.stopping:
                return 0
            if self._destroy_if_unused():
                return 0
            time.sleep(POLL)
        return 0

    def _destroy_if_unused(self) -> bool:
        node = self.node
        if L.header_flags(node.meta.mm) & L.FLAG_PERSIST:
            return False
        with node.admin:
            if node.clients() or L.header_state(node.meta.mm) != L.STATE_READY:
                return False
            L.set_header_state(node.meta.mm, L.STATE_DESTROYING)
        node.unlink()
        log.info("%s: last client gone; removed the store", self.label)
        return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shmstore.spill", description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--spill-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="shmstore-spill[%(process)d]: %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        node = NodeStore.open(Config.from_kwargs(name=args.name, node=args.node, spill_dir=args.spill_dir),
                              create=False)
    except (FileNotFoundError, ShmStoreError, PermissionError, BlockingIOError):
        return 0  # the store is gone already
    spiller = _Spiller(node)

    def _term(signum, frame):
        spiller.stopping = True

    signal.signal(signal.SIGTERM, _term)
    with node.admin:  # the spawner writes our pid under this lock
        pass
    try:
        return spiller.run()
    finally:
        node.close()


if __name__ == "__main__":
    sys.exit(main())
