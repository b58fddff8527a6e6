"""The per-node spill process: ``python -m shmstore.spill``.

One per node store, spawned (never forked) by the process that creates the
store, restarted by any client that finds it dead. Its loop:

- serve client requests (make room in memory, move an object), woken by the
  store's semaphore;
- keep MEMORY under the high watermark, spilling least recently used,
  unpinned objects to DISK down to the low watermark, a slice at a time so
  requests never wait long;
- be the node's janitor: release what dead clients held, free deleted
  objects nobody pins any more, free retired chunks;
- when no client is attached any more (and the store is not persistent),
  mark the store ``destroying`` under the ADMIN lock, unlink its segments,
  semaphore and spill files, and exit, logging what it reclaimed.

On start it first rolls back the moves a killed predecessor left half done.
It ignores SIGINT (a Ctrl-C meant for the job). SIGTERM is how batch
systems end a job (``scancel``, a time limit): every process of the job gets
it at about the same moment, then SIGKILL after a grace period. So on
SIGTERM it finishes the current step, then for up to ``TERM_GRACE`` seconds
reclaims clients as they die; once none is left it removes the store (a
persistent one it leaves consistent) and exits. Clients still alive after
the grace keep the store: they restart a spill process when they need one,
and the last of them to close removes the store if none runs.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from typing import Callable

from ..config import Config
from ..errors import ConfigError, ShmStoreError, StorageFullError
from ..levels import Level
from ..levels.registry import open_levels
from ..meta import layout as L
from ..node import inbound
from ..node.janitor import janitor_pass, sweep_deleted
from ..node.nodestore import NodeStore
from ..persist.flusher import Flusher
from ..primitives.procs import unpin
from ..units import format_size
from . import requests
from .logs import setup_logging
from .mover import MoveError, Mover

__all__ = ["main", "POLL"]

# seconds between janitor rounds; requests and departures wake it at once
POLL = 0.25
# janitor rounds between checks that the store's segments still exist seconds after SIGTERM to wait for the job's
# clients to die or leave
ORPHAN_EVERY = 8
TERM_GRACE = 2.0
log = logging.getLogger("shmstore.spill")


class _Spiller:
    """The loop of one spill process over one node store."""

    def __init__(self, node: NodeStore) -> None:
        self.node = node
        self.mover = Mover(node)
        self.stopping = False
        self.label = f"{node.cfg.name}@{node.cfg.node}"
        self.flusher = Flusher(node, self.label)

    def owns_store(self) -> bool:
        buf = self.node.buf
        return bool(L.HEAD.get(buf, "spill_pid") == os.getpid() and L.HEAD.get(buf, "state") == L.STATE_READY)

    def run(self) -> int:
        if not self.owns_store():
            # Not the store we were started for (our spawner wrote our pid into its header). The race,
            # step by step: the store's names are unlinked behind its back (an rm in /dev/shm, a
            # cleaner); its clients go on using it; a later client makes a new store under the same
            # name; a client of the first finds its spill process dead and starts us; we open the
            # store by name and get the new one. Recovering it would roll back the moves its own
            # spill process has in flight (which then switched objects to files we had removed) and
            # take its files for strays. So we touch nothing: the new store has its spill process, and
            # the last client of the first removes what is the first's (NodeStore.unlink). The same rule
            # makes a spill process started by hand beside the store's own leave: one per store, the one
            # whose pid its header holds.
            log.warning("%s: spill process %d serves this store, not this one (started beside it, or for an "
                        "older store that no longer has this name); leaving it alone", self.label,
                        L.HEAD.get(self.node.buf, "spill_pid"))
            return 0
        for level in self.node.levels.values():
            try:
                lost = level.drop_lost()
            except Exception:
                log.exception("%s: dropping the lost objects of %s failed", self.label, level.level)
                lost = 0
            if lost:
                log.error("%s: %d object(s) on %s were lost with the previous spill process, which held their "
                          "memory", self.label, lost, level.level)
        try:
            rolled = self.mover.recover()
        except Exception:
            log.exception("%s: recovery of half-done moves failed", self.label)
            rolled = 0
        if rolled:
            log.warning("%s: rolled back %d move(s) a previous spill process left half done", self.label, rolled)
        self._heartbeat()  # booted: what Store.wait_spill_ready waits for
        beats = 0
        while self.owns_store():
            self.node.wake.wait(POLL)
            self._heartbeat()
            beats += 1
            if beats % ORPHAN_EVERY == 0 and self._orphaned():
                self._gone()
                return 0
            for step in (self.serve, self._janitor, self._relieve, self.flusher.step):
                self._step(step)
            if self._destroy_if_unused():
                return 0
            if self.stopping:
                return self._drain()
        self._gone()
        return 0

    def _gone(self) -> None:
        """The loop ended because the store left. Destroyed under it (``destroy --force``, which removed its
        plans; a flush under way may have written a progress record since): the plans go. Handed to a newer
        spill process, or its names removed behind its back (the name, and with it the plans' folder, may be
        a newer store's by now): left alone."""
        buf = self.node.buf
        if L.HEAD.get(buf, "spill_pid") == os.getpid() and L.HEAD.get(buf, "state") != L.STATE_READY:
            self.flusher.forget()

    def _step(self, step: Callable[[], object]) -> None:
        try:
            step()
        except Exception:  # keep serving the node: one bad round must not kill its janitor
            log.exception("%s: %s failed", self.label, step.__name__)

    def _drain(self) -> int:
        """After SIGTERM: finish the checkpoint flush under way or waiting (a batch system's SIGKILL ends it if it
        must); reclaim clients as they die; remove the store once none is left."""
        self._step(self.flusher.step)  # plans a client left just before (a job that ends checkpointing)
        while self.flusher.busy and self.owns_store():
            self._step(self._janitor)
            self.flusher.wait(0.1)
        deadline = time.monotonic() + TERM_GRACE
        while self.owns_store():
            self._step(self._janitor)
            if self._destroy_if_unused() or not self.node.clients() or time.monotonic() > deadline:
                break
            self.node.wake.wait(0.02)
        remaining = len(self.node.clients())
        if remaining and self.owns_store():
            log.info("%s: SIGTERM: %d client(s) still attached; they keep the store", self.label, remaining)
        return 0

    def _relieve(self) -> None:
        try:
            self.mover.relieve(interrupt=lambda: self.stopping or bool(requests.pending(self.node)))
        except MoveError as exc:
            log.warning("%s: background spill failed: %s", self.label, exc)

    def _heartbeat(self) -> None:
        L.SPILL_STATE.set(self.node.buf, L.SPILL_OFFSET, "heartbeat", time.time())

    def _janitor(self) -> None:
        for slot, pid, dropped, freed in janitor_pass(self.node):
            log.info("%s: reclaimed client pid %d (slot %d): %d unsealed/deleted object(s), %s",
                        self.label, pid, slot, dropped, format_size(freed))
        sweep_deleted(self.node)
        inbound.clear_dead(self.node)
        if L.ALLOC.get(self.node.buf, "retired"):
            self.node.reclaim_retired()

    def serve(self) -> None:
        """Serve every pending client request, oldest slot first."""
        for slot, req in requests.pending(self.node):
            try:
                self._serve_one(req)
            except MoveError as exc:
                requests.complete(self.node, slot, req, exc.kind, str(exc))
            except ShmStoreError as exc:
                requests.complete(self.node, slot, req, L.ERR_IO, str(exc))
            else:
                requests.complete(self.node, slot, req)

    def _serve_one(self, req: L.Request) -> None:
        try:
            level = Level(req.level)
        except ValueError:
            raise MoveError(L.ERR_FULL, f"no level {req.level} in this store") from None
        if level not in self.node.levels:
            raise MoveError(L.ERR_FULL, f"no level {level} in this store")
        if req.kind == L.REQ_GPU:
            device = self.node.devices.get(level)
            if device is None:
                raise MoveError(L.ERR_FULL, f"{level} has no arenas to make")
            try:
                device.make_arena(req.idx)
            except StorageFullError as exc:
                raise MoveError(L.ERR_FULL, str(exc)) from None
            except Exception as exc:  # a CUDA error: the client gets it as a sentence
                raise MoveError(L.ERR_FULL, f"cannot allocate the arena of {level} on device {req.idx}: "
                                            f"{exc}") from None
        elif req.kind == L.REQ_SPACE:
            self.mover.make_room(req.nbytes, level=level)
        elif req.kind == L.REQ_MOVE:
            device = self.node.devices.get(level)
            if device is None:
                self.mover.move(req.idx, req.gen, level)
                return
            device.aim(req.arena - 1)  # the asking client's device's arena, not this process's device 0
            try:
                self.mover.move(req.idx, req.gen, level)
            finally:
                device.aim(-1)

    def _orphaned(self) -> bool:
        """True when the store's segments were removed behind its back (an ``rm`` in /dev/shm, a cleaner
        that unlinked them) and no client is left: nobody can attach any more, so this process would
        serve nobody forever. Its spill files go (only its own: the name may name a newer store by now,
        whose files share the directory)."""
        if self.node.meta.named() is not False or self.node.clients():
            return False
        if L.HEAD.get(self.node.buf, "state") != L.STATE_READY:  # destroy() marked it first: not behind its back
            return True
        files = self.node.remove_level_files()
        log.warning("%s: the store's shared memory was removed without shmstore (not by destroy or gc) and "
                    "no client is left; exiting%s", self.label, f", removed {files} spill file(s)" if files else "")
        return True

    def _destroy_if_unused(self) -> bool:
        # a client that wrote a checkpoint plan and left after this round's flusher step looked (a job that
        # ends right after its checkpoint): the plan keeps the store until the next round's step takes it
        # (the store and the plan were removed, the checkpoint lost without a word)
        files = self.node.remove_if_unused(keep=self.flusher.waiting)
        if files is None:
            return False
        self.flusher.forget()
        log.info("%s: last client gone; removed the store%s", self.label,
                 f" and {files} spill file(s)" if files else "")
        return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shmstore.spill", description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--spill-dir", required=True)
    parser.add_argument("--log-file", help="append the log here (made at the first line) instead of stderr")
    args = parser.parse_args(argv)
    setup_logging(args.log_file)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cpus = unpin()  # the job's CPUs, not the core its starting rank is pinned to
    log.debug("running on CPUs %s", sorted(cpus))
    try:
        cfg = Config.from_kwargs(name=args.name, node=args.node, spill_dir=args.spill_dir, prefault=0)
    # a bad argument or SHMSTORE_* variable: say which, exit 2 (as argparse does)
    except ConfigError as exc:
        if args.log_file:
            log.error("%s", exc)  # its stderr may be /dev/null (see kernel.procs.spill_output)
        parser.error(str(exc))
    try:
        node = NodeStore.open(cfg, create=False)
    except (FileNotFoundError, ShmStoreError, PermissionError, BlockingIOError):
        return 0  # the store is gone already
    node.use_levels(open_levels(node))  # no requests to send: this process makes and owns the device arenas
    spiller = _Spiller(node)

    def _term(signum: int, frame: object) -> None:
        spiller.stopping = True

    signal.signal(signal.SIGTERM, _term)
    with node.admin:  # the spawner writes our pid under this lock
        pass
    try:
        return spiller.run()
    # into the log: its stderr may be /dev/null (see kernel.procs.spill_output)
    except Exception:
        log.exception("%s: the spill process failed", spiller.label)
        return 1
    finally:
        node.close()
