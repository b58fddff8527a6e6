"""Checkpoint and restart through the store: ``Store.checkpoint`` / ``Store.restore`` (and the pieces
``shmstore.mpi.Cluster`` builds its collective ones from).

A checkpoint puts its objects into the node's store as one object per process
(a dict of them, under a hidden key: ``persist/plans.py``): that put is the
only time the caller waits. The
node's spill process then writes them to ``persist_dir`` in the background
(``persist/flusher.py``) and writes the manifest last: only then is the
checkpoint complete (``Checkpoint.done()``) and what ``restore()`` finds.
The node keeps its copy too, until ``checkpoint_keep`` newer ones are
complete, so a restore on the same node (a later step of a Slurm allocation,
with ``persist=True``) reads views of it without touching the file system.

Why a flush target beside the levels, not a level: a level holds one copy
of live objects of one node's store, with a quota, moved by the spill
policy and removed with the store; the folder holds immutable, named sets
of objects shared by every node and by later jobs, complete only as a set
(the manifest), removed by age (``checkpoint_keep``), never by pressure. Its
files are written once and read by any node; nothing moves into or out of
it as the store fills.
"""
from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Callable

from .errors import CheckpointError, InvalidArgumentError, ShmStoreError
from .levels import Level
from .persist import folder, plans
from .units import format_size

if TYPE_CHECKING:
    from .store import Store

__all__ = ["Checkpoint", "Restored", "checkpoint", "restore", "items_of", "check_name", "Source", "MISS", "bundle_key",
           "bundled"]

log = logging.getLogger("shmstore.checkpoint")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MISS = object()  # what a Source answers where it has no copy
CHECKPOINT_LEVELS = [Level.MEMORY, Level.DISK]

# a place a restore reads a key from: (its tag in Restored.origins: "store", "nodes" or "folder"; words for
# messages; the reader: key -> value, or MISS)
Source = tuple[str, str, Callable[[str], Any]]


def check_name(name: str) -> str:
    """``name`` if it names a checkpoint (1-64 characters of A-Z a-z 0-9 _ . -).

    Raises:
        InvalidArgumentError: it does not.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidArgumentError(f"a checkpoint's name is 1-64 characters of A-Z a-z 0-9 _ . -, got {name!r}")
    return name


def items_of(store: Store, objects: Any) -> dict[str, Any]:
    """``objects`` as a dict of keys to values: a mapping of keys to values, or keys of objects in ``store``.

    Raises:
        InvalidArgumentError: a key that is not a non-empty str, or not a mapping or keys.
        ObjectNotFoundError: an existing key that is not in the store.
    """
    if isinstance(objects, Mapping):
        pairs = list(objects.items())
    elif isinstance(objects, (str, bytes)) or not isinstance(objects, Iterable):
        raise InvalidArgumentError(f"checkpoint objects are a mapping of keys to values, or keys in the store; "
                                   f"got {type(objects).__name__}")
    else:
        keys = list(objects)
        pairs = list(zip(keys, store.get_many(keys)))
    out = {}
    for key, value in pairs:
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(f"checkpoint keys are non-empty str, got {key!r}")
        out[key] = value
    return out


def bundle_key(cid: str, bundle: str) -> str:
    """The store key of one process's objects of checkpoint ``cid``: one object (a dict of them all), so that
    the put is one allocation and one copy (1,000 arrays of 256 KiB: 1.0x an ``np.copyto`` of their bytes, 2x
    as 1,000 objects) and a partner copy moves one object per rank."""
    return plans.hidden(cid, "@" + bundle)


class Checkpoint:
    """A checkpoint on its way to the folder: ``done()``, ``wait()``, ``progress()``.

    Complete when its manifest is in ``persist_dir`` (every part flushed) and, in a cluster, the partner
    copies are made. Thread-safe.
    """

    def __init__(self, store: Store, name: str, cid: str, persist_dir: str,
                 partner: Callable[[float | None], bool] | None = None) -> None:
        self.name = name
        self.id = cid
        self.persist_dir = persist_dir
        self.path = folder.checkpoint_dir(persist_dir, name, cid)
        self._store = store
        self._partner = partner  # waits for this rank's partner copies (timeout) -> done
        self._manifest: folder.Manifest | None = None
        self._gone = False  # complete, then pruned: newer ones replaced it

    def done(self) -> bool:
        """Whether the checkpoint is complete (never raises: a failed one is not done; ``wait`` says why)."""
        if self._partner is not None and not self._partner(0):
            return False
        return self._complete() is not None or self._gone or folder.pruned(self.persist_dir, self.id) == "complete"

    def _complete(self) -> folder.Manifest | None:
        if self._manifest is None:
            self._manifest = folder.manifest_at(self.path)
        return self._manifest

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until complete; False if it is not after ``timeout`` seconds.

        Raises:
            CheckpointError: a part could not be flushed (the message says why: the folder full, an object
                lost) or the partner copy failed; the previous complete checkpoint is still what
                ``restore()`` finds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        nap, checked = 0.001, time.monotonic()
        while True:
            if self._complete() is not None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                return self._partner is None or self._partner(left)
            failed = folder.errors(self.path)
            if not failed and not os.path.isdir(self.path):
                how = folder.pruned(self.persist_dir, self.id)
                if how == "complete":  # it completed; newer checkpoints (checkpoint_keep) replaced it since
                    self._gone = True
                    return self._partner is None or self._partner(None if deadline is None else
                                                                   max(0.0, deadline - time.monotonic()))
                if how is not None:
                    failed = [f"it never completed, and {self.persist_dir} kept newer ones (checkpoint_keep)"]
            if failed:
                raise CheckpointError(f"checkpoint {self.name!r} ({self.path}) failed: {'; '.join(failed)}",
                                      self.name)
            if self._partner is not None:
                self._partner(0)  # raises where the background work (the plan, the partner copy) failed
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if time.monotonic() - checked > 0.2:
                checked = time.monotonic()
                self._store.spill_pid  # noqa: B018  (restarted here if it died: it resumes the flush)
            time.sleep(nap if deadline is None else min(nap, max(0.0, deadline - time.monotonic())))
            nap = min(nap * 2, 0.02)  # a look at the folder (gentle on a parallel file system)

    def progress(self) -> tuple[int, int]:
        """(bytes flushed, bytes to flush) of this checkpoint's parts on this node (once complete, the bytes of
        the whole checkpoint, twice)."""
        m = self._complete()
        if m is not None:
            return m.nbytes, m.nbytes
        done = total = 0
        for rec in plans.read_progress(plans.plan_dir(self._store.node_store.spill_path)):
            if rec.get("id") == self.id:
                done += rec["done"]
                total += rec["total"]
        return done, total

    def __repr__(self) -> str:
        state = "complete" if self.done() else "flushing"
        return f"<Checkpoint {self.name!r} id {self.id} {state} -> {self.path}>"


def checkpoint(store: Store, name: str, objects: Any, persist_dir: str | None = None,
               keep: int | None = None) -> Checkpoint:
    """``Store.checkpoint``: put ``objects`` into the node's store (the only wait), then flush them to
    ``persist_dir`` (default: the store's setting) in the background (one part, no partner), keeping the newest
    ``keep`` (default: ``checkpoint_keep``) complete ones there."""
    check_name(name)
    cfg = store.config
    pdir = cfg.persist_dir if persist_dir is None else os.path.abspath(persist_dir)
    cid = plans.new_id()
    items = items_of(store, objects)
    store.put(bundle_key(cid, "p0"), items, levels=CHECKPOINT_LEVELS)
    skeleton = manifest_skeleton(name, cid, 1, {k: 0 for k in items}, {"p0": 0}, {k: "p0" for k in items},
                                 [store.node], 1, {})
    post_plan(store, plans.Plan(name, cid, pdir, cfg.session, 0, ["p0"], skeleton,
                                cfg.checkpoint_keep if keep is None else keep))
    return Checkpoint(store, name, cid, pdir)


def manifest_skeleton(name: str, cid: str, parts: int, keys: dict[str, int], bundles: dict[str, int],
                      bundle_of: dict[str, str], nodes: list[str], ranks: int,
                      partners: dict[int, int]) -> dict[str, Any]:
    """The manifest less what the flush adds: ``keys`` (key -> part), ``bundles`` (bundle -> part: the store
    object of one process's keys), ``bundle_of`` (key -> bundle)."""
    return {"name": name, "id": cid, "created": plans.id_time(cid), "parts": parts, "keys": keys,
            "bundles": bundles, "bundle_of": bundle_of, "nodes": nodes, "ranks": ranks,
            "partners": {str(k): v for k, v in partners.items()}, "job": os.environ.get("SLURM_JOB_ID", "")}


def post_plan(store: Store, plan: plans.Plan) -> None:
    """Hand ``plan`` to the node's spill process (restarted if it died) and wake it."""
    node = store.node_store
    plans.write(plans.plan_dir(node.spill_path), plan)
    store.spill_pid  # noqa: B018  (started if it is not running)
    node.wake.post()


class Restored(Mapping[str, Any]):
    """The objects of a complete checkpoint, each read on first use from the nearest place that has it whole.

    ``sources`` are tried in order (this node's store, another node's, the folder); a place that fails (a
    checksum that does not match, a node that does not answer) is logged and the next one tried.
    """

    def __init__(self, manifest: folder.Manifest, sources: list[Source]) -> None:
        self.manifest = manifest
        self.name = manifest.name
        self.id = manifest.id
        self._sources = sources
        self._values: dict[str, Any] = {}
        self.origins: dict[str, str] = {}  # key -> where it was read: "store", "nodes" (another's) or "folder"

    def __getitem__(self, key: str) -> Any:
        got = self._values.get(key, MISS)
        if got is not MISS:
            return got
        if key not in self.manifest.keys:
            raise KeyError(key)
        tried = []
        for tag, where, read in self._sources:
            try:
                value = read(key)
            except ShmStoreError as exc:
                log.warning("checkpoint %r: %r from %s failed (%s); trying the next place", self.name, key,
                            where, exc)
                tried.append(f"{where} ({exc})")
                continue
            if value is MISS:
                tried.append(f"{where} (no copy)")
                continue
            self._values[key] = value
            self.origins[key] = tag
            return value
        raise CheckpointError(f"no whole copy of {key!r} of checkpoint {self.name!r} (id {self.id}); tried: "
                              f"{'; '.join(tried)}", self.name, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.manifest.keys)

    def __len__(self) -> int:
        return len(self.manifest.keys)

    def __repr__(self) -> str:
        return f"<Restored {self.name!r} id {self.id}: {len(self)} key(s), {format_size(self.manifest.nbytes)}>"


def find(persist_dir: str, name: str | None) -> folder.Manifest:
    """The newest complete checkpoint (named ``name``, if given) in ``persist_dir``.

    Raises:
        CheckpointError: there is none.
    """
    m = folder.latest(persist_dir, name)
    if m is None:
        what = f"named {name!r} " if name is not None else ""
        raise CheckpointError(f"no complete checkpoint {what}in {persist_dir} (persist_dir= / "
                              f"SHMSTORE_PERSIST_DIR; a checkpoint is complete once ck.wait() returns)", name)
    return m


def bundled(m: folder.Manifest, get: Callable[[str], Any]) -> Callable[[str], Any]:
    """A reader of keys from ``get(bundle key)`` (a dict of one process's keys, or MISS), each bundle got once."""
    bundles: dict[str, Any] = {}
    of = m.data.get("bundle_of", {})

    def read(key: str) -> Any:
        b = of.get(key)
        if b is None:
            return MISS
        got = bundles.get(b, MISS)
        if got is MISS:
            got = get(bundle_key(m.id, b))
            if got is MISS:
                return MISS
            bundles[b] = got
        return got[key]
    return read


def local_source(store: Store, m: folder.Manifest) -> Source:
    return "store", f"node {store.node!r}'s store", bundled(m, lambda h: store.get(h, MISS))


def folder_source(m: folder.Manifest) -> Source:
    return "folder", f"the folder {m.path}", lambda key: folder.read_object(m, key)


def restore(store: Store, name: str | None = None, persist_dir: str | None = None) -> Restored:
    """``Store.restore``: the newest complete checkpoint (named ``name``) in ``persist_dir`` (default: the store's
    setting), read from this node's store where it still holds it, else from the folder."""
    if name is not None:
        check_name(name)
    m = find(store.config.persist_dir if persist_dir is None else os.path.abspath(persist_dir), name)
    return Restored(m, [local_source(store, m), folder_source(m)])
