"""The spill process's flusher: writes checkpoints to the persistent folder in the background.

The spill process calls :meth:`Flusher.step` once a round. When plans wait
(``plans.py``), it takes a client slot for this process (in the loop's own
thread, before the loop looks whether any client is left: a store with a
flush in progress is never removed under it) and starts one thread that
writes each plan's part (``folder.write_part``: the file's own write speed,
the checksum beside it), writes the manifest if every part is in place, and
prunes: in the folder all but the newest ``checkpoint_keep`` complete
checkpoints, in the node's store the objects of checkpoints no longer kept.
The thread gives the slot back when it ends; the loop's next round can
then remove the store if no client is left.

Guarantee: a checkpoint is complete only when its manifest is written, and
that happens only after every part is whole on disk. A flush cut short (the
spill process killed) leaves a temporary file; the plan stays, and the next
spill process writes the part again from the start.
"""
from __future__ import annotations

import gc
import logging
import os
import threading
import time
from typing import Any

from ..client.kernel import Kernel
from ..errors import ShmStoreError
from ..node.nodestore import NodeStore
from ..units import format_size
from . import folder, plans

__all__ = ["Flusher"]

log = logging.getLogger("shmstore.spill")
PROGRESS_EVERY = 0.25  # seconds between progress records
SETTLE_EVERY = 2.0  # seconds between looks at the folder for the manifests of flushed parts
# The flush thread's nice value (the checksum thread it starts inherits it): the ranks' compute on the same
# cores comes first (a nice-0 thread gets about 10x its CPU time where both want one core), the flush uses
# what they leave; never SCHED_IDLE, which ranks polling in MPI would starve for good.
FLUSH_NICE = 10


class Flusher:
    """Flushes this node store's checkpoint plans (see the module's docstring). Driven by one thread (the
    spill loop's); does the work in one thread of its own."""

    def __init__(self, node: NodeStore, label: str) -> None:
        self.node = node
        self.label = label
        self.where = plans.plan_dir(node.spill_path)
        self._thread: threading.Thread | None = None
        self._next_settle = 0.0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def step(self) -> None:
        """Start the flush thread if there is work and it is not running."""
        if self.busy:
            return
        self._thread = None
        todo = plans.listed(self.where)
        settle = []
        now = time.monotonic()
        if todo or now >= self._next_settle:
            # a flushed part waits for the other nodes' parts: looking at the folder (a parallel file system's
            # metadata server; every manifest read for _abandoned) once a round would be a scan every 0.25 s
            # for as long as a dead node's part never comes
            self._next_settle = now + SETTLE_EVERY
            settle = [(p, plan) for p, plan in plans.listed(self.where, "flushed")
                      if os.path.exists(os.path.join(plan.folder, folder.MANIFEST)) or self._abandoned(plan)]
        if not todo and not settle:
            return
        try:
            slot = self.node.register()
        except FileNotFoundError:  # the store is being destroyed: its plans go with it
            return
        self._thread = threading.Thread(target=self._run, args=(slot, todo, settle), name="shmstore-flush",
                                        daemon=True)
        self._thread.start()

    def waiting(self) -> bool:
        """Whether plans wait that no flush has taken yet (the next :meth:`step` starts on them)."""
        return bool(plans.listed(self.where))

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the flush thread to end; False if it is still running after ``timeout`` seconds."""
        t = self._thread
        if t is not None:
            t.join(timeout)
        return not self.busy

    def forget(self) -> None:
        """The store is gone: its plans go with it."""
        plans.remove_all(self.where)

    def _abandoned(self, plan: plans.Plan) -> bool:
        """A flushed part whose checkpoint will never complete: a newer one completed first."""
        newest = folder.latest(plan.persist_dir)
        return newest is not None and newest.created > plans.id_time(plan.id)

    def _run(self, slot: int, todo: list[tuple[str, plans.Plan]], settle: list[tuple[str, plans.Plan]]) -> None:
        kernels: dict[str, Kernel] = {}
        _lower_priority()
        try:
            self.node.prefault.pin_row(slot, self.node.cfg.name)
            for path, plan in todo:
                try:
                    self._flush(self._kernel(kernels, slot, plan.session), path, plan)
                except _Later:
                    continue
            for path, plan in settle:
                try:
                    self._settle(self._kernel(kernels, slot, plan.session), path, plan)
                except _Later:
                    continue
        except Exception:
            log.exception("%s: checkpoint flush failed", self.label)
        finally:
            gc.collect()  # views of what was flushed held in cycles (a pickler's) pin objects: the slot waits
            for k in kernels.values():
                k.close()
            if not kernels:
                self.node.deregister(slot)

    def _kernel(self, kernels: dict[str, Kernel], slot: int, session: str) -> Kernel:
        k = kernels.get(session)
        if k is None:
            if kernels:  # one slot, one session per run: the others in the next
                raise _Later()
            k = kernels[session] = Kernel(self.node, slot, session)
        return k

    def _flush(self, kernel: Kernel, path: str, plan: plans.Plan) -> None:
        hidden = [plans.hidden(plan.id, "@" + bundle) for bundle in plan.keys]  # one dict per process
        try:
            total = sum(kernel.info(h).size for h in hidden)
        except ShmStoreError as exc:
            return self._fail(path, plan, f"node {self.node.cfg.node!r} lost object(s) of checkpoint "
                                          f"{plan.name!r} before they were flushed: {exc}")
        start = time.monotonic()
        last = [0.0]

        def progress(done: int) -> None:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY:
                last[0] = now
                plans.write_progress(self.where, plan, done, total)

        plans.write_progress(self.where, plan, 0, total)
        try:
            index = folder.write_part(plan.folder, plan.part, _items(kernel, hidden), progress)
        except Exception as exc:  # the folder full, an I/O error, an object gone: the checkpoint never completes
            return self._fail(path, plan, f"{type(exc).__name__}: {exc}")
        plans.write_progress(self.where, plan, total, total)
        took = time.monotonic() - start
        log.info("%s: checkpoint %r part %d: %d object(s), %s flushed to %s in %.2f s (%s/s)", self.label,
                 plan.name, plan.part, len(plan.keys), format_size(index["bytes"]), plan.folder, took,
                 format_size(int(index["bytes"] / max(took, 1e-9))))
        path = plans.set_state(path, "flushed")
        if folder.try_complete(plan.folder, plan.skeleton) is not None:
            self._settle(kernel, path, plan)
        return None

    def _fail(self, path: str, plan: plans.Plan, message: str) -> None:
        log.error("%s: checkpoint %r part %d not flushed: %s", self.label, plan.name, plan.part, message)
        folder.write_error(plan.folder, plan.part, message)
        plans.set_state(path, "failed", message)

    def _settle(self, kernel: Kernel, path: str, plan: plans.Plan) -> None:
        """The checkpoint is complete (or given up): prune the folder and this node's store, drop the plan."""
        removed = folder.prune(plan.persist_dir, plan.keep)
        if removed:
            log.info("%s: removed %d older checkpoint(s) from %s (checkpoint_keep=%d)", self.label, len(removed),
                     plan.persist_dir, plan.keep)
        self._prune_store(kernel, plan)
        plans.remove(path)

    def _prune_store(self, kernel: Kernel, plan: plans.Plan) -> None:
        """Delete this node's copies of checkpoints (its own parts and its partners') that are no longer kept:
        older than the oldest complete one kept, and not the subject of a plan still here."""
        kept = folder.complete(plan.persist_dir)[-plan.keep:]
        if not kept:
            return
        keep_ids = {m.id for m in kept} | {p.id for state in ("plan", "flushed", "failed")
                                           for _, p in plans.listed(self.where, state)}
        since = min(m.created for m in kept)
        gone = []
        for info in kernel.list(hidden=True):
            cid = info.key[len(plans.PREFIX):].split("/", 1)[0]
            if info.key.startswith(plans.PREFIX) and cid not in keep_ids and plans.id_time(cid) < since:
                gone.append(info.key)
        if gone:
            kernel.delete_many(gone, missing_ok=True)
            log.info("%s: dropped %d object(s) of older checkpoints from the store", self.label, len(gone))


def _lower_priority() -> None:
    """This thread (Linux: a nice value is a thread's) at ``FLUSH_NICE``; where refused, as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), FLUSH_NICE)
    except (OSError, AttributeError):
        pass


def _items(kernel: Kernel, bundles: list[str]) -> Any:
    """(key, value) of every object in ``bundles`` (store keys of dicts), one bundle read at a time."""
    for h in bundles:
        yield from kernel.get(h).items()


class _Later(Exception):
    """A plan of another session: flushed in the next run."""


def progress_of(spill_path: str) -> list[dict[str, Any]]:
    """This node's checkpoint parts, flushed or flushing (for ``shmstore status``)."""
    return plans.read_progress(plans.plan_dir(spill_path))
