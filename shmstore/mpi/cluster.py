"""The Cluster: one node store per node, objects moving between nodes over MPI.

Every rank attaches to its node's store. Node identity is the host (ranks
grouped by ``MPI.Comm.Split_type(COMM_TYPE_SHARED)``), labelled by
``SHMSTORE_NODE``, else ``PMI_HOSTNAME`` (set by MPICH's hydra, also for
``-launcher fork -hosts n0:2,n1:2``), else the host name; ``SHMSTORE_NODE``
also splits one host into several emulated nodes (their stores never share
memory: the node id is part of the segment names).

The lowest rank of each node (its leader) runs the node's :class:`Service`.
Locating a key asks its home node's share of the location directory
(``directory.py``: a bounded number of messages whatever the node count;
a key is locatable as soon as ``put`` returns); a fetch goes through the node's
migration map, so concurrent requests for one key cause one transfer; the
bytes go from the source's arena (or spill file) straight into the
destination's arena as a few raw frames, whatever the number of blobs.

Deadlock freedom: no rank holds a store lock while it talks MPI; a service
never waits on another node's service (pulls run in their own thread); room
for incoming bytes is made (the destination's spill process) before the
source is asked for them.
"""
from __future__ import annotations

import itertools
import os
import socket
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable

import numpy as np
from mpi4py import MPI

import shmstore

from .. import errors
from ..config import node_label
from ..kernel import encode_key
from ..kernel import layout as L
from ..kernel import migrations
from ..levels import Level, parse_levels
from ..placement import DEFAULT_PUT_LEVELS
from ..store import Store
from . import tags as T
from .cuda import cuda_aware
from .directory import home_of
from .staging import recv_staged
from .service import Service
from .streams import RemoteReader, RemoteWriter

__all__ = ["Cluster"]


def _label(kwargs: dict[str, Any]) -> str:
    raw = kwargs.get("node") or node_label() or os.environ.get("PMI_HOSTNAME") \
        or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    return "".join(c if c.isalnum() or c in "_.-" else "-" for c in str(raw))[:48] or "node"


def _warn_if_split_per_rank(ranks: list[tuple[str, str, int]]) -> None:
    """Warn when MPI put every rank in a shared-memory group of its own although several ranks run on one
    host under one node label: each then gets a store of its own, silently."""
    if len(ranks) < 2 or any(size > 1 for _, _, size in ranks):
        return
    seen: dict[tuple[str, str], int] = {}
    for host, label, _ in ranks:
        seen[(host, label)] = seen.get((host, label), 0) + 1
    crowded = [f"{label!r} on {host} ({n} ranks)" for (host, label), n in seen.items() if n > 1]
    if crowded:
        warnings.warn(f"MPI puts every rank in its own shared-memory group, but ranks share a host and a node "
                      f"label: {', '.join(crowded[:4])}; each rank gets a store of its own. The launcher's "
                      f"process-to-node mapping does not match the hosts (set SHMSTORE_NODE per node, or launch "
                      f"with the MPI's own mpiexec / srun --mpi=pmi2)", RuntimeWarning, stacklevel=3)


_OPEN: "weakref.WeakSet[Cluster]" = weakref.WeakSet()  # open clusters of this process


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
        self._bulk = [self._comm.Dup() for _ in range(T.STREAMS)]  # bulk frames, one per stream
        self.rank, self.size = self._comm.rank, self._comm.size
        self._identify(connect_kwargs)
        connect_kwargs = dict(connect_kwargs, node=self.node)
        self.store: Store = shmstore.connect(**connect_kwargs)
        self._tags = itertools.count()
        self._tag_lock = threading.Lock()
        self.block_size = T.DEFAULT_BLOCK
        self.streams = T.default_streams()
        if self.rank == self._leaders[self.node_index]:
            self._service = Service(self._comm, self)
            self._service.start()
        self._comm.Barrier()
        self._closed = False
        _OPEN.add(self)

    @property
    def comm(self) -> MPI.Comm:
        """The job's communicator as the cluster uses it (a private duplicate: its traffic never meets yours)."""
        return self._comm

    def barrier(self) -> None:
        """A barrier over every rank of the cluster."""
        self._check()
        self._comm.Barrier()

    @classmethod
    def opened(cls, name: str | None = None) -> "Cluster | None":
        """A Cluster this process has open (over the store ``name``, if given), else None.

        For code that is handed only a store's settings and must find the
        job's cluster (the ProxyStore connector resolving a proxy).
        """
        for c in list(_OPEN):
            if not c._closed and (name is None or c.store.name == name):
                return c
        return None

    def _identify(self, kwargs: dict[str, Any]) -> None:
        """Group ranks into nodes: same host (Split_type) and same label; name each node."""
        mine = _label(kwargs)
        shared = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        _warn_if_split_per_rank(self._comm.allgather((socket.gethostname(), mine, shared.size)))
        labels = shared.allgather(mine)
        node_comm = shared.Split(color=sorted(set(labels)).index(mine), key=self.rank)
        leader = node_comm.allreduce(self.rank, op=MPI.MIN)
        node_comm.Free()
        shared.Free()
        by_leader = dict(self._comm.allgather((leader, mine)))
        counts = {lb: list(by_leader.values()).count(lb) for lb in by_leader.values()}
        # two hosts with the same label (or one label on two hosts) still get distinct node ids
        names = {ld: lb if counts[lb] == 1 else f"{lb}-{ld}" for ld, lb in by_leader.items()}
        self._leaders = sorted(by_leader)
        self.nodes = [names[ld] for ld in self._leaders]
        self.node_index = self._leaders.index(leader)
        self.node = self.nodes[self.node_index]

    # ---- messaging -------------------------------------------------------------
    def _next_tag(self) -> int:
        with self._tag_lock:
            return T.TAG_REPLY_MIN + next(self._tags) % (T.TAG_REPLY_MAX - T.TAG_REPLY_MIN)

    def _rpc(self, node: int, kind: str, *args: Any) -> tuple[int, tuple[Any, ...]]:
        """Send a request to ``node``'s leader and wait for its reply; (reply tag, reply)."""
        dest, tag = self._leaders[node], self._next_tag()
        self._comm.send((kind, tag) + args, dest=dest, tag=T.TAG_REQUEST)
        reply = self._comm.recv(source=dest, tag=tag)
        if reply[0] == "error":
            cls = getattr(errors, reply[1], errors.TransferError)
            raise _remote_error(cls, f"node {self.nodes[node]!r}: {reply[2]}", args[0] if args else None, dest)
        return tag, reply

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
        until dropped. A fetch of ``key`` already in flight on another node
        may still land the old object there: order overwrites and other
        nodes' reads of the same key (e.g. with ``barrier()``).
        """
        self._check()
        info = self.store.put(key, obj, levels, overwrite)
        if overwrite:
            for i in self._dir(T.DIR_GET, key):
                if i != self.node_index:
                    self._dir(T.DIR_DROP, key, i)  # before the copy goes: never a copy the directory misses
                    self._delete_on(i, key)
        self._dir(T.DIR_ADD, key, self.node_index)
        return info

    def publish(self, keys: Iterable[str] | str) -> None:
        """Make objects put on this node through a plain ``shmstore.connect()`` locatable from every node.

        Raises:
            ObjectNotFoundError: this node has no such object.
        """
        self._check()
        for key in [keys] if isinstance(keys, str) else list(keys):
            if key not in self.store:
                raise errors.ObjectNotFoundError(f"no object {key!r} on node {self.node!r} to publish", key)
            self._dir(T.DIR_ADD, key, self.node_index)

    def _dir(self, kind: str, key: str, *args: Any) -> Any:
        """A request to ``key``'s home node's share of the directory (answered there at once)."""
        return self._dir_at(home_of(key, len(self.nodes)), kind, key, *args)

    def _dir_at(self, home: int, kind: str, *args: Any) -> Any:
        """A directory request to node ``home``: answered by this rank's own service where it keeps it."""
        if home == self.node_index and self._service is not None:
            return getattr(self._service, "_on_" + kind)(self.rank, 0, *args)[1]
        return self._rpc(home, kind, *args)[1][1]

    def get(self, key: str, fetch: bool = True, conditions: Any = None,
            levels: Iterable[Level] | Level | None = None) -> Any:
        """The value of ``key``: a local hit, or (``fetch``) one deduplicated transfer into this node.

        Raises:
            ObjectNotFoundError: no node has it (or ``fetch`` is False and this node has not).
            TransferError: the transfer failed.
        """
        self._check()
        try:
            return self.store.get(key, conditions)
        except errors.ObjectNotFoundError:
            if not fetch:
                raise
        self._fetch_one(key, None, levels, self.block_size)
        return self.store.get(key, conditions)

    def fetch(self, keys: Iterable[str] | str, levels: Iterable[Level] | Level | None = None,
              block_size: int | None = None) -> None:
        """Bring every key of ``keys`` into this node (those already here cost nothing).

        Args:
            levels: where the copies go (default ``[MEMORY, DISK]``).
            block_size: bytes per MPI message of the bulk transfer.
        """
        self._check()
        block = self._block(block_size)
        keys = [keys] if isinstance(keys, str) else list(dict.fromkeys(keys))
        if len(keys) > 1:
            self._fetch_batch(keys, levels, block)
        for key in keys:  # what the batch left (being fetched by another rank of this node, stale, large)
            if key not in self.store:
                self._fetch_one(key, None, levels, block)

    def get_many(self, keys: Iterable[str], levels: Iterable[Level] | Level | None = None) -> list[Any]:
        """The values of ``keys``: local hits, and the rest fetched in batches (one round trip per home node
        and one per source node for each 64 keys, not one per key).

        Raises:
            ObjectNotFoundError: a key no node has (naming it). TransferError: a transfer failed.
        """
        keys = list(keys)
        self.fetch(keys, levels)
        return [self.store.get(k) for k in keys]

    def _fetch_batch(self, keys: list[str], levels: Any, block: int) -> None:
        """Fetch the missing ``keys`` in rounds of ``T.BATCH``: holders asked per home node, objects looked up
        per source node (small ones come back inside the reply), new copies registered per home."""
        kernel = self.store.kernel
        node, sid, me = kernel.node, kernel.sid, self.node_index
        missing = [k for k in keys if k not in self.store]
        for start in range(0, len(missing), T.BATCH):
            chunk = missing[start: start + T.BATCH]
            mine: list[tuple[str, int]] = []  # (key, migration slot) this rank transfers
            try:
                for k in chunk:
                    owner, slot = migrations.begin(node, sid, encode_key(k))
                    if owner:
                        mine.append((k, slot))
                done = self._fetch_round([k for k, _ in mine], levels, block)
                for home, ks in self._by_home(done).items():
                    self._dir_at(home, T.DIR_ADD_MANY, ks, me)
            finally:
                for k, slot in mine:
                    migrations.finish(node, slot, None if k in self.store else "retry")

    def _fetch_round(self, keys: list[str], levels: Any, block: int) -> list[str]:
        """One round of a batched fetch; returns the keys now here."""
        holders: dict[str, list[int]] = {}
        for home, ks in self._by_home(keys).items():
            holders.update(zip(ks, self._dir_at(home, T.DIR_GET_MANY, ks)))
        by_src: dict[int, list[str]] = {}
        for k in keys:
            hs = [h for h in holders[k] if h != self.node_index]
            if hs:
                by_src.setdefault(hs[self.node_index % len(hs)], []).append(k)
        done = []
        for src, ks in by_src.items():
            _, reply = self._rpc(src, T.LOOKUP_MANY, ks, T.INLINE_MAX)  # pins each there
            for k, r in zip(ks, reply[1]):
                if r[0] != "missing":
                    self._transfer(k, src, r, levels, block)
                    done.append(k)
        return done

    def _by_home(self, keys: list[str]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for k in keys:
            out.setdefault(home_of(k, len(self.nodes)), []).append(k)
        return out

    def _block(self, block_size: int | None) -> int:
        if block_size is None:
            return self.block_size
        if not 0 < int(block_size) <= T.MAX_BLOCK:
            raise errors.InvalidArgumentError(f"block_size must be in 1..{T.MAX_BLOCK}, got {block_size}")
        return int(block_size)

    def _fetch_one(self, key: str, source: int | None, levels: Any, block: int) -> None:
        """One deduplicated transfer of ``key`` into this node (see the migration map)."""
        kb = encode_key(key)
        kernel = self.store.kernel
        node, sid = kernel.node, kernel.sid
        for _ in range(4):
            if key in self.store:
                return
            owner, slot = migrations.begin(node, sid, kb)
            if not owner:
                err = migrations.wait(node, slot, sid, kb, self.store.config.spill_timeout * 2)
                if err is None or err == "retry":
                    continue
                raise _shared_error(key, self.node, err)  # the error of the transfer we waited for
            try:
                if key not in self.store:
                    self._transfer_from_any(key, source, levels, block)
                    self._dir(T.DIR_ADD, key, self.node_index)  # a new copy: others may fetch from here
            except BaseException as exc:
                migrations.finish(node, slot, f"{type(exc).__name__}:{exc}")
                raise
            migrations.finish(node, slot)
            return
        if key not in self.store:
            raise errors.TransferError(f"transfer of {key!r} into node {self.node!r} kept being interrupted", key)

    def _transfer_from_any(self, key: str, source: int | None, levels: Any, block: int) -> None:
        """Transfer ``key`` from ``source``, else from a holder the directory names (one round trip to
        the key's home, one to the holder); a holder without it is dropped from the directory."""
        if source is not None:
            candidates = [source]
        else:
            holders = [i for i in self._dir(T.DIR_GET, key) if i != self.node_index]
            k = self.node_index % len(holders) if holders else 0
            candidates = holders[k:] + holders[:k]  # nodes start at different holders: load spreads
        for src in candidates:
            _, reply = self._rpc(src, T.LOOKUP, key, T.INLINE_MAX)  # pins it there if found
            if reply[0] != "missing":
                return self._transfer(key, src, reply, levels, block)
            if source is None:
                self._dir(T.DIR_DROP, key, src)  # removed behind the directory's back
        raise errors.ObjectNotFoundError(f"no node has {key!r} (nodes: {self.nodes})", key)

    def _transfer(self, key: str, src: int, reply: tuple[Any, ...], levels: Any, block: int) -> None:
        (kind, nbytes, nblobs, meta), inline, handle = reply[1], reply[2], reply[3]
        order = parse_levels(levels, DEFAULT_PUT_LEVELS)
        kernel = self.store.kernel
        kb = encode_key(key)
        try:
            res = self.store._placement.place(
                key, order, lambda level: (level,) + kernel.reserve(key, kb, kind, nbytes, nbytes, nblobs, meta,
                                                                    level=level))
        except errors.ObjectExistsError:  # put here meanwhile (an overwrite on this node): what we wanted
            if handle:
                self._rpc(src, T.RELEASE, handle)
            return
        except BaseException:
            if handle:
                self._rpc(src, T.RELEASE, handle)
            raise
        level, idx, off, stored, _, stripe = res
        try:
            self._receive(src, level, idx, off, stored, nbytes, inline, handle, block)
        except BaseException:
            kernel.abort(idx)
            raise
        kernel.seal(idx, stripe)
        with kernel.node.admin:
            L.add_transfer_stats(kernel.node.buf, transfers=1, received=nbytes)

    def _receive(self, src: int, level: int, idx: int, off: int, stored: int, nbytes: int,
                 inline: bytes | None, handle: int, block: int) -> None:
        kernel = self.store.kernel
        gen = L.entry_gen(kernel._buf, kernel._lay.entry(idx))
        sink = kernel.node.levels[Level(level)].sink(idx, gen, off, nbytes, "incoming transfer")
        try:
            dst = sink.buffer()  # host memory MPI can receive into (the arena), or None
            if dst is None and cuda_aware() and hasattr(sink, "cuda_buffer"):
                dst = sink.cuda_buffer()  # the device array itself: CUDA-aware MPI receives into it
            if inline is not None:
                if isinstance(dst, np.ndarray):
                    dst[:] = np.frombuffer(inline, np.uint8)
                else:
                    sink.write(np.frombuffer(inline, np.uint8), 0)
            elif nbytes and dst is not None:
                self._receive_frames(src, dst, nbytes, handle, block)
            elif nbytes:  # a file or a device without CUDA-aware MPI: frames through host blocks
                self._receive_frames(src, None, nbytes, handle, block, copy_in=lambda pos, n, b: sink.write(b, pos))
            sink.close()
        except BaseException:
            sink.abort()
            raise

    def _receive_frames(self, src: int, dst: Any, nbytes: int, handle: int, block: int,
                        copy_in: Callable[[int, int, np.ndarray], None] | None = None) -> None:
        """Receive an object's frames into ``dst`` (host or device memory), or with ``copy_in`` through
        host blocks handed to it; one thread per stream (this one runs the first)."""
        streams = max(1, min(self.streams, len(self._bulk)))
        tag, _ = self._rpc(src, T.DATA, handle, block, streams)
        plan, peer = T.frames(nbytes, block, streams), self._leaders[src]
        failed: list[BaseException] = []

        def stream(i: int) -> None:
            try:
                if copy_in is not None:
                    recv_staged(self._bulk[i], peer, tag, plan[i::streams], copy_in)
                    return
                for pos, n in plan[i::streams]:
                    self._bulk[i].Recv([dst[pos: pos + n], MPI.BYTE], source=peer, tag=tag)
            except BaseException as exc:  # re-raised on the calling thread
                failed.append(exc)

        threads = [threading.Thread(target=stream, args=(i,), name="shmstore-mpi-stream", daemon=True)
                   for i in range(1, min(streams, len(plan)))]
        for t in threads:
            t.start()
        stream(0)
        for t in threads:
            t.join()
        if failed:
            raise failed[0]

    def migrate(self, key: str, node: int | str, keep_source: bool = False) -> None:
        """Move (or with ``keep_source`` copy) ``key`` to ``node``; the copy keeps its key.

        Raises:
            ObjectNotFoundError: no node has it. TransferError: the transfer failed.
        """
        self._check()
        encode_key(key)
        dest = self._node_index(node)
        holders = self._dir(T.DIR_GET, key)
        if not holders:
            raise errors.ObjectNotFoundError(f"no node has {key!r}", key)
        if dest not in holders:
            src = holders[0]
            if dest == self.node_index:
                self._fetch_one(key, src, None, self.block_size)
            else:
                self._rpc(dest, T.PULL, key, src, self.block_size)  # the pull registers the new copy
        if not keep_source:
            for n in holders:
                if n != dest:
                    self._dir(T.DIR_DROP, key, n)  # before the copy goes (see put)
                    self._delete_on(n, key)

    def locate(self, key: str) -> list[str]:
        """Nodes holding a copy of ``key``, as the directory knows them (one round trip to its home)."""
        self._check()
        encode_key(key)
        return [self.nodes[i] for i in sorted(self._dir(T.DIR_GET, key))]

    def delete(self, key: str) -> int:
        """Delete every copy of ``key`` the directory knows; returns how many there were."""
        self._check()
        encode_key(key)
        holders = self._dir(T.DIR_TAKE, key)
        return sum(self._delete_on(i, key) for i in holders)

    def _delete_on(self, node: int, key: str) -> bool:
        if node == self.node_index:
            try:
                self.store.delete(key)
                return True
            except errors.ObjectNotFoundError:
                return False
        return bool(self._rpc(node, T.DELETE, key)[1][1])

    def open_reader(self, key: str, node: int | str | None = None) -> Any:
        """A reader of ``key`` on ``node`` (default: this node if it has it, else the first that has),
        streaming it without copying it whole."""
        self._check()
        if node is None:
            node = self.node if key in self.store else (self.locate(key) or [self.node])[0]
        n = self._node_index(node)
        if n == self.node_index:
            return self.store.open_reader(key)
        return RemoteReader(self, n, key)

    def open_writer(self, key: str, size: int, node: int | str | None = None) -> Any:
        """A writer of a new raw object ``key`` of ``size`` bytes on ``node`` (default: this node)."""
        self._check()
        n = self.node_index if node is None else self._node_index(node)
        if n == self.node_index:
            return _Published(self, self.store.open_writer(key, size), key)
        return RemoteWriter(self, n, key, size)

    def stats(self) -> dict[str, int]:
        """Node-wide counters: transfers into this node, bytes received and sent, deduplicated requests."""
        t = L.unpack_transfer_stats(self.store.kernel.node.buf)
        return {"transfers": t[0], "bytes_received": t[1], "bytes_sent": t[2], "migrations_deduplicated": t[3]}

    # ---- lifecycle -------------------------------------------------------------
    def close(self) -> None:
        """Collective: stop this node's service, free the communicator, close the store; idempotent."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        self._comm.Barrier()  # nobody sends requests any more
        if self._service is not None:
            self._service.close()
        self._comm.Barrier()
        for c in self._bulk:
            c.Free()
        self._comm.Free()
        self.store.close()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<shmstore.mpi.Cluster rank {self.rank}/{self.size} node {self.node!r} of {self.nodes}>"


def _remote_error(cls: Any, message: str, key: Any, peer: int) -> Exception:
    exc: Exception
    if issubclass(cls, errors.TransferError):
        exc = cls(message, key if isinstance(key, str) else None, peer)
        return exc
    try:
        exc = cls(message, key) if isinstance(key, str) and cls in _KEYED else cls(message)
        return exc
    except TypeError:
        return errors.TransferError(message, None, peer)


def _shared_error(key: str, node: str, err: str) -> Exception:
    name, _, msg = err.partition(":")
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.ObjectNotFoundError):
        return cls(msg, key)
    return errors.TransferError(f"transfer of {key!r} into node {node!r} failed: {msg or err}", key)


_KEYED = (errors.ObjectNotFoundError, errors.ObjectExistsError, errors.ObjectLockedError, errors.SpillError)


class _Published:
    """A local writer that registers its object in the directory once sealed."""

    def __init__(self, cluster: Cluster, writer: Any, key: str) -> None:
        self._cluster, self._writer, self.key = cluster, writer, key

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)

    def close(self) -> None:
        closed = self._writer.closed
        self._writer.close()
        if not closed:
            self._cluster._dir(T.DIR_ADD, self.key, self._cluster.node_index)

    def __enter__(self) -> "_Published":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self._writer.abort()
