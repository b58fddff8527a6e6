"""The service of one node: answers other ranks' requests for this node's objects.

One per node, run as a daemon thread by the node's leader rank, on the
cluster's private communicator. It probes for requests with exponential
back-off (every 50 us while requests keep coming, every 2 ms after half a
second without one), so an idle node costs next to no CPU, instead
of spinning in a blocking receive (MPICH busy-polls, and a spinning thread
would steal a core from every rank of the node).

A bulk send pins the source object (a lease) from the LOOKUP that
announced it until its frames are sent, so the spill process cannot move it
and a delete is deferred; a lease the requester never collects expires after
``HANDLE_TTL`` seconds. Pulls (a migration into this node) run in their own
thread, so this loop never waits on another node's service.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import errors
from ..kernel import encode_key
from ..kernel import layout as L
from ..kernel import native
from ..levels import Level
from ..levels.gpu import GpuLevel, pin_token, to_host
from . import tags as T
from .cuda import cuda_aware
from .directory import Directory
from .staging import send_staged

__all__ = ["Service", "HANDLE_TTL"]

HANDLE_TTL = 120.0
_NO_REPLY = object()
_BUSY_PAUSE = 50e-6   # probe interval while requests came in recently
_IDLE_PAUSE = 1e-3    # probe interval of an idle node: the first request after a pause waits <= 1 ms
_IDLE_AFTER = 0.5     # seconds without a request before backing off to _IDLE_PAUSE


class Service:
    """Serves this node's store over ``comm``; owned by the leader's Cluster (``close`` stops it).

    Thread-safe towards the Cluster: it only uses the store's thread-safe API.
    """

    def __init__(self, comm: MPI.Comm, cluster: Any) -> None:
        self.comm = comm
        self.cluster = cluster
        self.store = cluster.store
        self.kernel = cluster.store._kernel
        self._ids = itertools.count(1)
        self._leases: dict[int, tuple[np.ndarray, float]] = {}
        self._writers: dict[int, Any] = {}
        self._stop = threading.Event()
        self._pulls: list[threading.Thread] = []
        self.directory = Directory()  # this node's share of the location directory (see directory.py)
        self._thread = threading.Thread(target=self._loop, name="shmstore-mpi-service", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop serving; idempotent. Drops uncollected leases and aborts remote writers."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(60)
        for t in self._pulls:
            t.join(60)
        self._leases.clear()
        for w in self._writers.values():
            w.abort()
        self._writers.clear()

    # ---- loop ------------------------------------------------------------------
    def _loop(self) -> None:
        native.set_timer_slack(2000)  # this thread's 50 us naps then last ~55 us, not ~105
        status = MPI.Status()
        last = time.monotonic()
        while not self._stop.is_set():
            if not self.comm.iprobe(MPI.ANY_SOURCE, T.TAG_REQUEST, status):
                idle = time.monotonic() - last
                time.sleep(_BUSY_PAUSE if idle < _IDLE_AFTER else _IDLE_PAUSE)
                if idle > 1.0:
                    self._expire()
                continue
            last = time.monotonic()
            src = status.Get_source()
            msg = self.comm.recv(source=src, tag=T.TAG_REQUEST)
            kind, reply_tag, args = msg[0], msg[1], msg[2:]
            try:
                reply = getattr(self, "_on_" + kind)(src, reply_tag, *args)
            except errors.ShmStoreError as exc:
                reply = ("error", type(exc).__name__, str(exc))
            except Exception as exc:  # a bad request must not kill the node's service
                reply = ("error", "TransferError", f"{type(exc).__name__}: {exc}")
            if reply is not _NO_REPLY:
                self.comm.send(reply, dest=src, tag=reply_tag)

    def _expire(self) -> None:
        now = time.monotonic()
        for h in [h for h, (_, deadline) in self._leases.items() if deadline < now]:
            del self._leases[h]
        self._pulls = [t for t in self._pulls if t.is_alive()]

    # ---- handlers --------------------------------------------------------------
    def _on_lookup(self, src: int, tag: int, key: str, inline_max: int) -> tuple[Any, ...]:
        k = self.kernel
        try:
            idx, e, _ = k.lookup(key, encode_key(key), True)
        except errors.ObjectNotFoundError:
            return ("missing",)
        lease = self._device_lease(idx, e) if e[L.E_LEVEL] == L.LEVEL_GPU else k.lease(idx, e)
        meta = (e[L.E_KIND], e[L.E_NBYTES], e[L.E_NBLOBS],
                L.entry_array_bytes(k._buf, k._lay.entry(idx)) if e[L.E_KIND] == L.KIND_NDARRAY else None)
        if e[L.E_NBYTES] <= inline_max:
            data = _host_bytes(lease)
            self._count_sent(len(data))
            return ("ok", meta, data, 0)
        h = next(self._ids)
        self._leases[h] = (lease, time.monotonic() + HANDLE_TTL)
        return ("ok", meta, None, h)

    def _device_lease(self, idx: int, e: tuple[Any, ...]) -> Any:
        """The stored bytes of a GPU object (pinned by the caller) as a device array holding the pin."""
        gpu = self.kernel.node.levels[Level.GPU]
        assert isinstance(gpu, GpuLevel)
        return gpu.array(e[L.E_OFFSET], e[L.E_NBYTES], pin_token(self.kernel._release, idx, e[L.E_GEN]))

    def _on_data(self, src: int, tag: int, handle: int, block: int, streams: int = 1) -> Any:
        entry = self._leases.pop(handle, None)
        if entry is None:
            return ("error", "TransferError", f"transfer handle {handle} expired (after {HANDLE_TTL:g} s)")
        lease = entry[0]
        streams = max(1, min(int(streams), len(self.cluster._bulk)))
        self.comm.send(("ok", lease.nbytes), dest=src, tag=tag)
        bulk = self.cluster._bulk
        plan = T.frames(lease.nbytes, block, streams)
        if hasattr(lease, "__cuda_array_interface__") and not cuda_aware():  # device bytes through host blocks
            send_staged(bulk[:streams], src, tag, plan, lambda pos, n, b: to_host(b, lease[pos: pos + n]))
        else:  # host memory, or device memory handed to a CUDA-aware MPI as it is
            reqs = [bulk[i % streams].Isend([lease[pos: pos + n], MPI.BYTE], dest=src, tag=tag)
                    for i, (pos, n) in enumerate(plan)]
            wait_quietly(reqs)
        self._count_sent(lease.nbytes)
        return _NO_REPLY

    def _on_release(self, src: int, tag: int, handle: int) -> tuple[Any, ...]:
        self._leases.pop(handle, None)
        return ("ok",)

    def _on_has(self, src: int, tag: int, key: str) -> tuple[Any, ...]:
        return ("ok", key in self.store)

    def _on_delete(self, src: int, tag: int, key: str) -> tuple[Any, ...]:
        try:
            self.store.delete(key)
            return ("ok", True)
        except errors.ObjectNotFoundError:
            return ("ok", False)

    def _on_pull(self, src: int, tag: int, key: str, from_node: int, block: int) -> Any:
        def run() -> None:
            try:
                self.cluster._fetch_one(key, from_node, None, block)
                reply: tuple[Any, ...] = ("ok",)
            except errors.ShmStoreError as exc:
                reply = ("error", type(exc).__name__, str(exc))
            except Exception as exc:
                reply = ("error", "TransferError", f"{type(exc).__name__}: {exc}")
            self.comm.send(reply, dest=src, tag=tag)
        t = threading.Thread(target=run, name="shmstore-mpi-pull", daemon=True)
        self._pulls.append(t)
        t.start()
        return _NO_REPLY

    # ---- the directory: answered at once, never waiting on anyone ------------------------
    def _on_dir_add(self, src: int, tag: int, key: str, node: int) -> tuple[Any, ...]:
        self.directory.add(key, node)
        return ("ok", None)

    def _on_dir_drop(self, src: int, tag: int, key: str, node: int) -> tuple[Any, ...]:
        self.directory.drop(key, node)
        return ("ok", None)

    def _on_dir_get(self, src: int, tag: int, key: str) -> tuple[Any, ...]:
        return ("ok", self.directory.get(key))

    def _on_dir_take(self, src: int, tag: int, key: str) -> tuple[Any, ...]:
        return ("ok", self.directory.take(key))

    def _on_dir_get_many(self, src: int, tag: int, keys: list[str]) -> tuple[Any, ...]:
        return ("ok", [self.directory.get(k) for k in keys])

    def _on_dir_add_many(self, src: int, tag: int, keys: list[str], node: int) -> tuple[Any, ...]:
        for k in keys:
            self.directory.add(k, node)
        return ("ok", None)

    def _on_lookup_many(self, src: int, tag: int, keys: list[str], inline_max: int) -> tuple[Any, ...]:
        return ("ok", [self._on_lookup(src, tag, k, inline_max) for k in keys])

    def _on_read(self, src: int, tag: int, key: str, offset: int, n: int) -> tuple[Any, ...]:
        with self.store.open_reader(key) as r:
            r.seek(offset)
            data = r.read(n)
            size = r.size
        self._count_sent(len(data))
        return ("ok", size, data)

    def _on_wopen(self, src: int, tag: int, key: str, size: int) -> tuple[Any, ...]:
        h = next(self._ids)
        self._writers[h] = self.store.open_writer(key, size)
        return ("ok", h)

    def _on_write(self, src: int, tag: int, handle: int, data: bytes) -> tuple[Any, ...]:
        w = self._writers.get(handle)
        if w is None:
            return ("error", "StoreClosedError", f"remote writer {handle} is closed")
        try:
            w.write(data)
        except errors.ShmStoreError:
            self._writers.pop(handle, None).abort()
            raise
        return ("ok",)

    def _on_wclose(self, src: int, tag: int, handle: int, abort: bool) -> tuple[Any, ...]:
        w = self._writers.pop(handle, None)
        if w is None:
            return ("ok",)
        if abort:
            w.abort()
        else:
            w.close()
        return ("ok",)

    def _count_sent(self, nbytes: int) -> None:
        node = self.store._node
        with node.admin:
            L.add_transfer_stats(node.buf, sent=nbytes)


def wait_quietly(reqs: list[Any]) -> None:
    """Wait for ``reqs`` without spinning: the receiving ranks copy the frames (MPICH's blocking
    calls busy-poll, which would take a core from them), this end only sees them finish."""
    while not MPI.Request.Testall(reqs):
        time.sleep(_BUSY_PAUSE)


def _host_bytes(lease: Any) -> bytes:
    """The bytes of a lease (host or device memory)."""
    if hasattr(lease, "__cuda_array_interface__"):
        host = np.empty(lease.nbytes, np.uint8)
        to_host(host, lease)
        return host.tobytes()
    return bytes(lease.tobytes())
