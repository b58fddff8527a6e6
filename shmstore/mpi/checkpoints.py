"""``Cluster.checkpoint`` and ``Cluster.restore``: checkpoints of a whole job, node memory first, a partner node
for redundancy, the persistent folder in the background (see ``shmstore/checkpoint.py`` for one process).

A checkpoint, collectively:

1. each rank puts its objects into its node's store as one object (a dict,
   under a hidden key) and says which keys; one ``allgather`` tells every
   rank the whole checkpoint (a key given by two ranks, or a rank whose put
   failed, fails it on every rank, each rank's copies deleted); the ranks
   return: their only wait was the put and that exchange;
2. in a background thread per rank (``Cluster.close`` waits for it): each
   node's leader hands its node's part to its spill process (``Plan``),
   which flushes it to ``persist_dir``; the last part written writes the
   manifest;
3. in the same thread: its copy is published in the location
   directory and, with 2+ nodes, its share of node ``i - 1``'s part (the
   ranks' objects, split among the ranks of node ``i``) is copied from that
   node, known to hold it (no directory round trip first), over the
   cluster's own transfers, and published.

A restore finds the newest complete manifest (rank 0 reads the folder; every
rank gets the same), republishes the copies this node still holds (a later
job's directory is empty), and gives each rank a lazy mapping: any key from
its node's store, else from the nearest node that has it (the partner), else
from the folder.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from .. import errors
from ..checkpoint import (
    CHECKPOINT_LEVELS,
    MISS,
    Checkpoint,
    Restored,
    Source,
    bundle_key,
    bundled,
    check_name,
    find,
    folder_source,
    items_of,
    local_source,
    manifest_skeleton,
    post_plan,
)
from ..persist import folder, plans

if TYPE_CHECKING:
    from .cluster import Cluster

__all__ = ["checkpoint", "restore", "partner_of"]


def partner_of(node: int, nnodes: int) -> int | None:
    """The node holding a copy of node ``node``'s part: the next one; None alone."""
    return (node + 1) % nnodes if nnodes > 1 else None


class _Background:
    """What a rank does for a checkpoint after its ranks stop waiting, in a thread: hand its node's part to the
    spill process (the node's leader: ``plan``), publish its own copy in the location directory, then (2+
    nodes) copy its share of the previous node's part from that node, directly (the holder is known: no
    directory round trip before the bytes move) and publish the copies. ``wait(timeout)`` -> done."""

    def __init__(self, cluster: Cluster, plan: Callable[[], None] | None, own: str, source: int | None,
                 keys: list[str]) -> None:
        self._cluster = cluster
        self._plan = plan
        self._own = own
        self._source = source
        self._keys = keys
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shmstore-partner-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._plan is not None:
                self._plan()
            self._cluster.publish(self._own)
            if self._source is not None and self._keys:
                self._cluster.copy_from(self._source, self._keys, levels=CHECKPOINT_LEVELS)
        except BaseException as exc:  # reported by wait()
            self.error = exc

    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout: float | None) -> bool:
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if self.error is not None:
            steps = (["handing the node's part to its spill process"] if self._plan is not None else []) + \
                [f"publishing {self._own!r}"] + \
                ([f"the partner copy of {len(self._keys)} object(s) into node {self._cluster.node!r}"]
                 if self._keys else [])
            raise errors.CheckpointError(f"the checkpoint's background work on rank {self._cluster.rank} "
                                         f"({', '.join(steps)}) failed: {self.error}") from self.error
        return True


def checkpoint(cluster: Cluster, name: str, objects: Any) -> Checkpoint:
    """``Cluster.checkpoint`` (see the module's docstring). Collective.

    Raises:
        CheckpointError: on every rank, where a rank's put failed or two ranks gave one key (naming them);
            nothing of the checkpoint is left in any store then.
        InvalidArgumentError: a bad name (on every rank: the name is the same everywhere).
    """
    check_name(name)
    comm, store = cluster.comm, cluster.store
    cid = comm.bcast(plans.new_id() if comm.rank == 0 else None, root=0)
    bundle = f"r{comm.rank}"
    asked: list[str] = []
    failure = None
    put = False
    try:
        items = items_of(store, objects)
        asked = list(items)
        store.put(bundle_key(cid, bundle), items, levels=CHECKPOINT_LEVELS)
        put = True
    except errors.ShmStoreError as exc:
        failure = f"rank {comm.rank} on node {cluster.node!r}: {type(exc).__name__}: {exc}"
    table = comm.allgather((cluster.node_index, asked, failure))
    problem = _problem(table)
    if problem is not None:
        if put:
            store.delete(bundle_key(cid, bundle), missing_ok=True)
        raise errors.CheckpointError(f"checkpoint {name!r} failed, nothing of it kept: {problem}", name)
    bundles = {f"r{rank}": node for rank, (node, _, _) in enumerate(table)}
    cfg = store.config

    def plan() -> None:  # the manifest's skeleton: one entry per key of the job (thousands per rank)
        nnodes = len(cluster.nodes)
        keys = {key: node for node, ks, _ in table for key in ks}
        bundle_of = {key: f"r{rank}" for rank, (_, ks, _) in enumerate(table) for key in ks}
        partners = {i: p for i in range(nnodes) if (p := partner_of(i, nnodes)) is not None}
        part = [b for b, node in bundles.items() if node == cluster.node_index]
        skeleton = manifest_skeleton(name, cid, nnodes, keys, bundles, bundle_of, list(cluster.nodes), comm.size,
                                     partners)
        post_plan(store, plans.Plan(name, cid, cfg.persist_dir, cfg.session, cluster.node_index, part, skeleton,
                                    cfg.checkpoint_keep))

    # every rank's put came before the allgather: the partner copy can start; the rest is in the background
    leader = cluster.leaders[cluster.node_index] == comm.rank
    after = _Background(cluster, plan if leader else None, bundle_key(cid, bundle),
                        *_partner_share(cluster, bundles, cid))
    cluster.hold_close(after)
    return Checkpoint(store, name, cid, cfg.persist_dir, after.wait)


def _problem(table: list[tuple[int, list[str], str | None]]) -> str | None:
    """What fails the checkpoint: a key given by two ranks (first: a rank of the same node then fails its put on
    the other's copy), else a rank's failed put; None if nothing."""
    owner: dict[str, int] = {}
    for rank, (_, ks, _) in enumerate(table):
        for k in ks:
            if k in owner:
                return f"key {k!r} given by ranks {owner[k]} and {rank} (a checkpoint's keys name one object each)"
            owner[k] = rank
    failed = [f for _, _, f in table if f is not None]
    return "; ".join(failed) if failed else None


def _partner_share(cluster: Cluster, bundles: dict[str, int], cid: str) -> tuple[int | None, list[str]]:
    """This rank's share of the partner copy: node ``i`` copies node ``i - 1``'s part (one object per rank
    there), split among its ranks; (the source node's index, keys); (None, []) alone."""
    nnodes = len(cluster.nodes)
    if nnodes < 2:
        return None, []
    source = (cluster.node_index - 1) % nnodes
    here = [int(b[1:]) for b, node in bundles.items() if node == cluster.node_index]
    wanted = [bundle_key(cid, b) for b, node in bundles.items() if node == source]
    return source, wanted[here.index(cluster.comm.rank)::len(here)]


def restore(cluster: Cluster, name: str | None = None) -> Restored:
    """``Cluster.restore`` (see the module's docstring). Collective.

    Raises:
        CheckpointError: on every rank, where the folder has no complete checkpoint (named ``name``).
    """
    if name is not None:
        check_name(name)
    comm, store = cluster.comm, cluster.store
    found: Any = None
    if comm.rank == 0:
        try:
            found = find(store.config.persist_dir, name).path
        except errors.CheckpointError as exc:
            found = exc
    found = comm.bcast(found, root=0)
    if isinstance(found, Exception):
        raise found
    m = folder.manifest_at(found)
    if m is None:
        raise errors.CheckpointError(f"checkpoint folder {found} vanished while it was being restored", name)
    held: list[str] = []
    if cluster.leaders[cluster.node_index] == comm.rank:
        prefix = plans.hidden(m.id, "")
        held = [i.key for i in store.kernel.list(hidden=True) if i.key.startswith(prefix)]
        cluster.publish(held)
    # which node holds which key: a key no other node holds is read from the folder without asking the
    # directory (a later job's stores hold nothing of it: one round trip per key saved)
    holders: dict[str, set[int]] = {}
    for node, keys in comm.allgather((cluster.node_index, held)):  # also: every node's copies are published
        for k in keys:
            holders.setdefault(k, set()).add(node)
    return Restored(m, [local_source(store, m), _remote_source(cluster, m, holders), folder_source(m)])


def _remote_source(cluster: Cluster, m: folder.Manifest, holders: dict[str, set[int]]) -> Source:
    me, n = cluster.node_index, len(cluster.nodes)

    def get(h: str) -> Any:
        others = holders.get(h, set()) - {me}
        if not others:
            return MISS
        try:  # straight from the nearest node the ranks said holds it (no directory round trips first)
            cluster.copy_from(min(others, key=lambda i: (i - me) % n), [h], levels=CHECKPOINT_LEVELS,
                              publish=False)
        except errors.ObjectNotFoundError:  # it lost it since: the directory knows where else
            return cluster.get(h, MISS)
        return cluster.store.get(h, MISS)
    return "nodes", "the other nodes' stores", bundled(m, get)
