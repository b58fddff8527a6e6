"""The Cluster: one node store per node, objects moving between nodes over MPI.

Every rank attaches to its node's store; the lowest rank of each node (its
leader) runs the node's :class:`Service`. The parts, by concept:

- ``nodes.py``: which ranks form a node, and the node's name;
- ``wire.py`` and ``rpc.py``: the named control messages, and a rank's
  calls to node services;
- ``links.py``: what every part below shares (communicators, messenger,
  node index and names), built once here;
- ``directory.py`` and ``dirclient.py``: the location directory,
  partitioned across nodes (a bounded number of messages whatever the node
  count; a key is locatable as soon as ``put`` returns; hot objects spread
  as a tree), and a rank's requests to it;
- ``fetch.py``: transfers into this node, deduplicated per node through
  the migration map, the bytes going from the source's arena (or spill
  file) straight into the destination's arena as a few raw frames;
- ``copies.py``: migrations and deletions of a key's copies across nodes;
- ``streams.py``: readers and writers of objects on other nodes;
- ``service.py``: a node's answers to all of these.

The Cluster composes these parts and owns what they share; none of them
reaches into it or into another.

Deadlock freedom: no rank holds a store lock while it talks MPI; a service
never waits on another node's service (pulls and bulk sends run in their
own threads); room for incoming bytes is made (the destination's spill
process) before the source is asked for them.

Failures: every wait on another rank ends after ``peer_timeout`` seconds
(``rpc.py``); a Cluster left by an exception leaves without a collective
call, and the job aborts if nobody catches the exception (``abort.py``).
"""
from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from typing import Any

from mpi4py import MPI

import shmstore

from .. import errors
from ..checkpoint import Checkpoint, Restored
from ..client.kernel import NO_DEFAULT, check_get_args
from ..config import doorbell
from ..levels import Level
from ..meta import layout as L
from ..meta.keys import encode_key
from ..refs import Ref, register_cluster_finder, values_of
from ..refs import new_key as new_ref_key
from ..store import Store
from ..streams import Reader
from ..values import Conditions
from . import abandon, abort, checkpoints
from . import tags as T
from . import wire as W
from .copies import Copies
from .dirclient import DirectoryClient
from .directory import Directory
from .doorbell import Bells, Doorbell, kernel_id, my_card, pid_space
from .fetch import Fetcher
from .links import Links
from .nodes import identify
from .poll import idle_nap, spin_window
from .rpc import Messenger, bounded, gave_up
from .service import Service
from .streams import PublishedWriter, RemoteReader, RemoteWriter

__all__ = ["Cluster"]


_OPEN: weakref.WeakSet[Cluster] = weakref.WeakSet()  # open clusters of this process


class Cluster:
    """This rank's view of a job-wide object store (collective to create and close).

    Args:
        comm: the communicator of the job (default ``MPI.COMM_WORLD``); the
            cluster works on a private duplicate of it.
        **connect_kwargs: passed to :func:`shmstore.connect` on every rank
            (the same on all ranks: ``name``, ``capacity``, ``session``, ...).

    Owns its store connection and duplicated communicator; ``close`` (also
    collective) releases both. Thread-safe.

    Raises:
        TransferError: MPI lacks ``MPI_THREAD_MULTIPLE``.
    """

    _closed = True
    _service: Service | None = None

    def __init__(self, comm: MPI.Comm | None = None, **connect_kwargs: Any) -> None:
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise errors.TransferError("shmstore.mpi needs MPI_THREAD_MULTIPLE (set mpi4py.rc.thread_level = "
                                       "'multiple' before importing MPI)")
        self._comm = (comm or MPI.COMM_WORLD).Dup()
        bulk = tuple(self._comm.Dup() for _ in range(T.STREAMS))  # bulk frames, one per stream
        self.rank, self.size = self._comm.rank, self._comm.size
        ids = identify(self._comm, connect_kwargs)
        self.nodes: list[str] = ids.names
        self.leaders: list[int] = ids.leaders
        self.node_index: int = ids.index
        self.node: str = ids.name
        self.store: Store = shmstore.connect(**dict(connect_kwargs, node=self.node))
        spin = spin_window(ids.host_ranks)
        leading = self.rank == ids.leaders[ids.index]
        bell = Doorbell() if leading and doorbell() else None  # the node service's, to sleep on when idle
        cards = self._comm.allgather(bell.card() if bell is not None else None)
        self._bells = Bells([cards[ld] for ld in ids.leaders], my_card())
        self._msg = Messenger(self._comm, self.nodes, self.leaders, spin, self.store.config.peer_timeout,
                              self._bells, bulk[0])
        self._links = Links(self._comm, bulk, self._msg, self.rank, ids.index, tuple(ids.names), tuple(ids.leaders))
        self.block_size = T.DEFAULT_BLOCK
        local = Directory(self.store.config.peer_timeout) if self._links.leader else None
        self._dirs = DirectoryClient(self._links, local)
        self._fetcher = Fetcher(self._links, self._dirs, self.store)
        self._copies = Copies(self._links, self._dirs, self._fetcher, self.store.kernel)
        if self._links.leader:
            self._service = Service(self._links, self._dirs, self.store, self._fetcher, spin,
                                    idle_nap(ids.host_ranks), bell, self._bells)
            self._service.start()
        # its start-up (imports, recovery) lands here, not in the first compute
        self.store.wait_spill_ready()
        # where each rank runs (its machine's kernel and process-id namespace: where thread ids name the same
        # threads) and its node service's thread: a wait on a service of this machine, and a service's spin after
        # a request from it, give way to the other thread where it waits for the same CPU (emulated nodes, a rank
        # asking its own node's service); a barrier as well
        here = (kernel_id(), pid_space())
        where = self._comm.allgather((here, self._service.thread_id if self._service is not None else 0))
        near = [here[0] != 0 and bool(here[1]) and w == here for w, _ in where]
        self._msg.partners = [where[ld][1] if near[ld] else 0 for ld in ids.leaders]
        if self._service is not None:
            self._service.near = frozenset(r for r, n in enumerate(near) if n)
        self._closed = False
        self._background: list[Any] = []  # background work close waits for (see hold_close)
        _OPEN.add(self)
        abort.opened()

    @property
    def streams(self) -> int:
        """Bulk streams per transfer into this rank's node (1 or 2; default: ``SHMSTORE_STREAMS``, else 2
        where MPICH runs several VCIs)."""
        return self._fetcher.streams

    @streams.setter
    def streams(self, value: int) -> None:
        self._fetcher.streams = value

    @property
    def links(self) -> Links:
        """What every part of this cluster shares (communicators, messenger, where this rank is); owned by the
        cluster (a seam for tools and tests: calls through ``links.messenger`` reach node services)."""
        return self._links

    @property
    def service(self) -> Service | None:
        """This node's service where this rank leads the node, else None (a seam for tools and tests)."""
        return self._service

    @property
    def comm(self) -> MPI.Comm:
        """The job's communicator as the cluster uses it (a private duplicate: its traffic never meets yours)."""
        return self._comm

    def barrier(self) -> None:
        """A barrier over every rank of the cluster. After it, every copy any rank fetched before it is
        listed in the directory (``locate`` names it; a fetch registers its copy by a posted message, which
        ``barrier`` waits to see handled). Where ranks outnumber the cores it waits without spinning
        (MPICH's blocking barrier busy-polls). Like MPI's own barrier it waits as long as the slowest rank
        computes: no deadline (a rank that died never arrives; see ``peer_timeout`` for the other waits)."""
        self._check()
        # what this rank posted (a fetch's registration) is in the directory when it returns
        self._msg.flush()
        self._msg.barrier([self._comm.Ibarrier()])

    @classmethod
    def opened(cls, name: str | None = None) -> Cluster | None:
        """A Cluster this process has open (over the store ``name``, if given), else None.

        For code that is handed only a store's settings and must find the
        job's cluster (the ProxyStore connector resolving a proxy).
        """
        for c in list(_OPEN):
            if not c._closed and (name is None or c.store.name == name):
                return c
        return None

    def _node_index(self, node: int | str) -> int:
        if isinstance(node, str):
            if node not in self.nodes:
                raise errors.InvalidArgumentError(f"no node {node!r} in this cluster (nodes: {self.nodes})")
            return self.nodes.index(node)
        if not 0 <= node < len(self.nodes):
            raise errors.InvalidArgumentError(f"node index {node} out of range (0..{len(self.nodes) - 1})")
        return int(node)

    def _check(self) -> None:
        if self._closed:
            raise errors.StoreClosedError("cluster is closed")

    # ---- objects ---------------------------------------------------------------
    def put(self, key: str, obj: Any, levels: Iterable[Level] | Level | None = None,
            overwrite: bool = False) -> Any:
        """Put ``obj`` in this node's store; locatable from every node when it returns (it is registered
        with the key's home node in the location directory).

        With ``overwrite=True`` this node's copy is replaced atomically (see
        :meth:`shmstore.Store.put`) and the copies other nodes hold are
        deleted before it returns, so that from then on every node's
        ``get`` fetches the new object; views of an old copy stay valid
        until dropped. Fetches of the old object in flight meanwhile are
        waited for (within ``peer_timeout``) and what they landed is deleted
        too: a get ordered after the overwrite (by a ``barrier()``, a
        message) never returns the old object. A get running at the same
        time may return either.

        Raises:
            TransferError: a node did not answer within ``peer_timeout`` (this node's copy is in place; the
                directory or another node's old copy may not be updated).
        """
        self._check()
        info = self.store.put(key, obj, levels, overwrite)
        try:
            # this copy replaces the entry; the old copies go after (each exactly: never a later one)
            if overwrite:
                self._copies.replace(key, info.size, info.created)
            else:
                self._dirs.ask(W.DirAdd([key], self.node_index, [info.size], [info.created]))
        except errors.TransferError as exc:
            gave_up(exc, "overwrite" if overwrite else "put", key)
            raise
        return info

    def publish(self, keys: Iterable[str] | str) -> None:
        """Make objects put on this node through a plain ``shmstore.connect()`` locatable from every node (one
        round trip per home node of the keys, not one per key).

        Raises:
            ObjectNotFoundError: this node has no such object (nothing is published).
            TransferError: a key's home did not answer within ``peer_timeout``.
        """
        self._check()
        names = [keys] if isinstance(keys, str) else list(dict.fromkeys(keys))
        infos = {}
        for key in names:
            try:
                infos[key] = self.store.get_info(key)
            except errors.ObjectNotFoundError:
                raise errors.ObjectNotFoundError(f"no object {key!r} on node {self.node!r} to publish", key) \
                    from None
        for home, group in self._dirs.by_home(names).items():
            try:
                self._dirs.ask_at(home, W.DirAdd(group, self.node_index, [infos[k].size for k in group],
                                                 [infos[k].created for k in group]))
            except errors.TransferError as exc:
                gave_up(exc, "publish", group[0])
                raise

    def get(self, key: str, default: Any = NO_DEFAULT, *misuse: Any, fetch: bool = True,
            conditions: Conditions | None = None,
            levels: Iterable[Level] | Level | None = None, timeout: float | None = None) -> Any:
        """The value of ``key``: a local hit, or (``fetch``) one deduplicated transfer into this node.

        ``default`` is returned where no node has ``key`` (or, with ``fetch=False``, this node has not), as
        with a dict; ``fetch``, ``conditions``, ``levels`` and ``timeout`` are keyword-only. ``timeout``:
        seconds the whole call may wait on other ranks (None: each wait up to ``peer_timeout``).

        Raises:
            ObjectNotFoundError: no node has it (or ``fetch`` is False and this node has not), and no
                ``default``.
            GetTimeoutError: not done within ``timeout`` (the transfer under way is given up; ask again).
            TransferError: the transfer failed, or a node did not answer within ``peer_timeout``.
            InvalidArgumentError: a third positional argument, or an index as ``default`` (``conditions`` by
                position).
        """
        check_get_args(key, default, misuse)  # the kernel's get sees _MISSED, not this default
        self._check()
        if timeout is None:  # (a local hit costs a few microseconds: no context manager on its way)
            return self._get(key, default, fetch, conditions, levels)
        with bounded(timeout):
            return self._get(key, default, fetch, conditions, levels)

    def _get(self, key: str, default: Any, fetch: bool, conditions: Conditions | None,
             levels: Iterable[Level] | Level | None) -> Any:
        kernel = self.store.kernel
        try:
            for _ in range(_FETCH_TRIES):
                value = kernel.get(key, _MISSED, conditions=conditions)  # a miss starts a fetch, not an error
                if value is not _MISSED:
                    return value
                if not fetch:
                    break
                self._fetcher.fetch_one(key, None, levels, self.block_size, missed=True)
        except errors.ObjectNotFoundError:
            if default is NO_DEFAULT:
                raise
            return default
        except errors.TransferError as exc:
            gave_up(exc, "get", key)
            raise
        # a miss here: fetched _FETCH_TRIES times and deleted each time before it was read (another rank of this
        # node deletes it as it comes), or not to be fetched
        if not fetch or default is not NO_DEFAULT:
            return kernel.get(key, default, conditions=conditions)
        value = kernel.get(key, _MISSED, conditions=conditions)
        if value is not _MISSED:
            return value
        interrupted = errors.TransferError(
            f"transfer of {key!r} into node {self.node!r} kept being interrupted: it came {_FETCH_TRIES} times and "
            f"was deleted here each time before this rank could read it (another rank deletes it: order the two)", key)
        gave_up(interrupted, "get", key)
        raise interrupted

    def fetch(self, keys: Iterable[str] | str, levels: Iterable[Level] | Level | None = None,
              block_size: int | None = None) -> None:
        """Bring every key of ``keys`` into this node (those already here cost nothing).

        Args:
            levels: where the copies go (default ``[MEMORY, DISK]``).
            block_size: bytes per MPI message of the bulk transfer.

        Raises:
            ObjectNotFoundError: a key no node has. TransferError: a transfer failed, or a node did not
                answer within ``peer_timeout``.
        """
        self._check()
        keys = [keys] if isinstance(keys, str) else list(dict.fromkeys(keys))
        try:
            self._fetch(keys, levels, self._block(block_size))
        except errors.TransferError as exc:
            gave_up(exc, "fetch", keys[0] if len(keys) == 1 else keys)
            raise

    def copy_from(self, node: int, keys: Iterable[str], levels: Iterable[Level] | Level | None = None,
                  publish: bool = True) -> None:
        """Copy ``keys`` from the node of index ``node`` (in :attr:`nodes`), which the caller knows holds them,
        without asking the directory first (two round trips per key fewer than :meth:`fetch`; ranks of this
        node copying one key at once make one transfer), then (``publish``) list the copies in the directory.

        Raises:
            ObjectNotFoundError: that node has no such key. TransferError: it did not answer.
        """
        self._check()
        keys = list(keys)
        for key in keys:
            self._fetcher.copy_from(node, key, levels, self.block_size)  # a key already here costs nothing
        if keys and publish:
            self.publish(keys)

    def _fetch(self, keys: list[str], levels: Iterable[Level] | Level | None, block: int) -> None:
        batch = len(keys) > 1
        landed = self._fetcher.fetch_batch(keys, levels, block) if batch else set()
        # What the batch left (being fetched by another rank of this node, stale, large): after a batch, not
        # as a miss, so that a key another rank of this node is fetching is waited for (its migration slot),
        # not fetched again inline, a round trip per key (the more, the slower the link).
        for key in keys:
            if key not in landed and key not in self.store:
                self._fetcher.fetch_one(key, None, levels, block, missed=not batch)

    def get_many(self, keys: Iterable[str | Ref], *, levels: Iterable[Level] | Level | None = None,
                 timeout: float | None = None) -> list[Any]:
        """The values of ``keys``: local hits, and the rest fetched in batches (one round trip per home node
        and one per source node for each 64 keys, not one per key); a :class:`~shmstore.refs.Ref` among them
        is resolved as ``ref.get()`` does. ``timeout``: as for :meth:`get`, for the whole call.

        Raises:
            ObjectNotFoundError: a key no node has (naming it). GetTimeoutError: not done within ``timeout``.
            TransferError: a transfer failed, or a node did not answer within ``peer_timeout``.
        """
        self._check()
        if timeout is None:
            return self._get_many(list(keys), levels)
        with bounded(timeout):
            return self._get_many(list(keys), levels)

    def _get_many(self, items: list[Any], levels: Iterable[Level] | Level | None) -> list[Any]:
        if any(type(k) is Ref for k in items):
            return values_of(items, lambda ks: self._get_many(ks, levels))
        names: list[str] = items  # no Ref among them
        try:
            self._fetch(list(dict.fromkeys(names)), levels, self.block_size)
        except errors.TransferError as exc:
            gave_up(exc, "get_many", names)
            raise
        return [self.store.get(k) for k in names]

    def _block(self, block_size: int | None) -> int:
        if block_size is None:
            return self.block_size
        if not 0 < int(block_size) <= T.MAX_BLOCK:
            raise errors.InvalidArgumentError(f"block_size must be in 1..{T.MAX_BLOCK}, got {block_size}")
        return int(block_size)

    def migrate(self, key: str, node: int | str, keep_source: bool = False) -> None:
        """Move (or with ``keep_source`` copy) ``key`` to ``node``; the copy keeps its key.

        Raises:
            ObjectNotFoundError: no node has it. TransferError: the transfer failed, or a node did not answer
                within ``peer_timeout`` (twice that for the destination's pull, which waits on the source).
        """
        self._check()
        encode_key(key)
        dest = self._node_index(node)
        try:
            self._copies.migrate(key, dest, keep_source, self.block_size)
        except errors.TransferError as exc:
            gave_up(exc, "migrate", key)
            raise

    def locate(self, key: str) -> list[str]:
        """Nodes holding a copy of ``key``, as the directory knows them (one round trip to its home).

        Raises:
            TransferError: its home did not answer within ``peer_timeout``.
        """
        self._check()
        encode_key(key)
        try:
            return [self.nodes[i] for i in sorted(self._dirs.ask(W.DirGet([key])).nodes[0])]
        except errors.TransferError as exc:
            gave_up(exc, "locate", key)
            raise

    def delete(self, key: str) -> int:
        """Delete every copy of ``key`` the directory knows, and this node's copy even where it does not (a
        copy whose registration never came: its fetcher died); returns how many copies went. When it
        returns, ``put(key, ...)`` on this node does not find an old object.

        Raises:
            TransferError: a node did not answer within ``peer_timeout`` (every copy on the nodes that
                answered is gone, this node's first).
        """
        self._check()
        encode_key(key)
        try:
            return self._copies.delete_all(key)
        except errors.TransferError as exc:
            gave_up(exc, "delete", key)
            raise

    def open_reader(self, key: str, node: int | str | None = None) -> Reader | RemoteReader:
        """A reader of ``key`` on ``node`` (default: this node if it has it, else the first that has),
        streaming it without copying it whole."""
        self._check()
        if node is None:
            node = self.node if key in self.store else (self.locate(key) or [self.node])[0]
        n = self._node_index(node)
        if n == self.node_index:
            return self.store.open_reader(key)
        return RemoteReader(self._links, n, key)

    def open_writer(self, key: str, size: int, node: int | str | None = None) -> PublishedWriter | RemoteWriter:
        """A writer of a new raw object ``key`` of ``size`` bytes on ``node`` (default: this node)."""
        self._check()
        n = self.node_index if node is None else self._node_index(node)
        if n == self.node_index:
            return PublishedWriter(self._dirs, self.store, self.store.open_writer(key, size), key, size)
        return RemoteWriter(self._links, self._dirs, n, key, size)

    def checkpoint(self, name: str, objects: Any) -> Checkpoint:
        """Checkpoint ``objects`` (a mapping of keys to values, or keys of objects in this node's store) of every
        rank as ``name``; collective. A key names one object of the whole checkpoint (two ranks giving one key
        fail it).

        The ranks wait only for the put of their objects into their node's store. Then, in the background,
        each node's part is copied into the next node's store (with 2+ nodes) and flushed by its spill process
        to ``persist_dir``; the manifest is written last. ``ck.wait()`` / ``ck.done()``: complete (every part
        flushed, this rank's share of the partner copy made). See :mod:`shmstore.mpi.checkpoints`.

        Raises:
            CheckpointError: a rank's put failed, or two ranks gave one key (on every rank; nothing is kept).
        """
        self._check()
        return checkpoints.checkpoint(self, name, objects)

    def restore(self, name: str | None = None) -> Restored:
        """The newest complete checkpoint (named ``name``) in ``persist_dir``, as a mapping of every key of it (of
        any rank: resharding is by key) to its value, read on first use from the nearest whole copy: this
        node's store, another node's (the partner's), else the folder; collective.

        Raises:
            CheckpointError: no complete checkpoint (on every rank); on reading a key, no whole copy anywhere.
        """
        self._check()
        return checkpoints.restore(self, name)

    def share(self, obj: Any, levels: Iterable[Level] | Level | None = None) -> Ref:
        """Put ``obj`` under a generated key (``@ref/`` and a uuid) on this node, locatable from every node, and
        return a :class:`~shmstore.refs.Ref`: a small picklable handle that resolves (``ref.get()``) on any
        node of the job, in any process that has this Cluster open (a local hit, or one deduplicated
        transfer into its node that every other rank of the node then reuses), and on this node in any
        process. ``ref.delete()`` (or the end of ``with cluster.share(obj) as ref:``) deletes every copy.

        Raises:
            StorageFullError, SpillError, SerializationError: as ``put``. TransferError: as ``put``.
        """
        key = new_ref_key()
        self.put(key, obj, levels)
        return Ref.shared(self.store, key, self)

    @property
    def requests(self) -> dict[str, int]:
        """Requests this rank sent to node services so far: ``calls`` (each a message and its reply),
        ``posts`` (one message, no reply), ``forwarded`` (calls whose node sent the request on to another,
        which answered: one message more each) and ``messages``, all the messages these were. What an
        operation costs in messages, whatever the node count: see mpi/README.md."""
        m = self._msg
        return {"calls": m.calls, "posts": m.posts, "forwarded": m.forwarded,
                "messages": 2 * m.calls + m.posts + m.forwarded}

    def stats(self) -> dict[str, int]:
        """Node-wide counters: transfers into this node, bytes received and sent, deduplicated requests."""
        t = L.unpack_transfer_stats(self.store.kernel.node.buf)  # the TRANSFER_STATS record, by name
        return {"transfers": t.transfers, "bytes_received": t.received, "bytes_sent": t.sent,
                "migrations_deduplicated": t.dedup}

    # ---- lifecycle -------------------------------------------------------------
    def close(self) -> None:
        """Collective: stop this node's service, free the communicator, close the store; idempotent.

        Like every collective it waits for every rank (no deadline). A rank that cannot count on the others
        to get here (it raised; a rank it waited on died) leaves by an exception instead: ``with Cluster()``
        then closes without a collective call (see :meth:`__exit__`)."""
        if self._closed:
            return
        self._finish_background()  # a partner copy under way needs the other nodes' services: before theirs go
        self._closed = True
        _OPEN.discard(self)
        abort.closed()
        try:
            self._msg.barrier([self._comm.Ibarrier()], "close")  # nobody sends requests any more
        except BaseException as exc:  # a rank left by an exception (it never comes), or a Ctrl-C: leave too
            self._leave(exc)
            raise
        if self._service is not None:
            self._service.close()
        self._comm.Barrier()
        self._msg.stop_watching()
        self._bells.close()
        if not abandon.wait_released(self.store.config.peer_timeout):  # MPI may still write into the store
            print(f"shmstore.mpi: rank {self.rank}: {abandon.held()} transfer(s) given up on still hold store "
                  f"space after {self.store.config.peer_timeout:g} s (their peer died or hangs): it is freed "
                  f"when this process ends", file=sys.stderr, flush=True)
        for c in self._links.bulk:
            c.Free()
        self._comm.Free()
        self.store.close()

    def hold_close(self, job: Any) -> None:
        """Make :meth:`close` wait for ``job`` (an object with ``running()`` and ``wait(timeout)``: a
        checkpoint's publish and partner copy) before it stops this node's service."""
        self._background[:] = [b for b in self._background if b.running()] + [job]

    def _finish_background(self) -> None:
        """Wait for this rank's checkpoints' background work (each bounded by ``peer_timeout`` per transfer);
        a failure was the checkpoint's to report (``wait``): here it is only logged."""
        for job in self._background:
            try:
                job.wait(None)
            except errors.ShmStoreError as exc:
                print(f"shmstore.mpi: rank {self.rank}: {exc}", file=sys.stderr, flush=True)
        self._background.clear()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        """Close collectively on a normal exit (``sys.exit(0)`` included); on an exception, leave without any
        collective call (the other ranks may never get here) and let the exception go on: if nobody catches
        it, it is printed and the job aborted (``abort.py``), in seconds rather than at the time limit."""
        if kind is None or (isinstance(exc, SystemExit) and exc.code in (None, 0)):
            self.close()
        elif not self._closed:
            self._closed = True
            _OPEN.discard(self)
            self._msg.say_left(exc)  # the others' close and barrier raise instead of waiting for this rank
            print(f"shmstore.mpi: rank {self.rank} of {self.size} (node {self.node!r}) left its Cluster by an "
                  f"exception ({type(exc).__name__}): the cluster's other ranks raise TransferError in their "
                  f"close() or barrier(); a collective call this rank makes on the job's communicator now waits "
                  f"for ranks that will not come", file=sys.stderr, flush=True)
            self._leave(exc)

    def _leave(self, exc: BaseException | None) -> None:
        """Stop this node's service and close the store on this rank alone: no collective call (see
        :func:`abort.leave`)."""
        self._closed = True
        abort.leave(exc)
        if self._service is not None:
            self._service.close(wait=1.0)
        self.store.close()

    def __repr__(self) -> str:
        return f"<shmstore.mpi.Cluster rank {self.rank}/{self.size} node {self.node!r} of {self.nodes}>"


_MISSED = object()  # Cluster.get's default for a local miss
# fetches a get makes of a key that is deleted here each time before this rank reads it (another rank of the node
# deletes it, an overwrite drops the copy, a migration moves it away) before it raises: with 3, a rank suite's
# racing test two jobs at once on 2 cores once failed on 3 in a row (CI, stop 52); each more try costs one fetch
_FETCH_TRIES = 8


def _find_cluster(name: str, session: str) -> Cluster | None:
    """An open Cluster of this process over store ``name`` and ``session`` (how a Ref finds one)."""
    found = Cluster.opened(name)
    return found if found is not None and found.store.session == session else None


register_cluster_finder(_find_cluster)
