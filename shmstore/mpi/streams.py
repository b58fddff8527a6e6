"""Streaming an object to or from another node, one request per read or write; a local writer that registers
its object in the directory."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import errors
from . import wire as W
from .dirclient import DirectoryClient
from .links import Links

if TYPE_CHECKING:
    from ..store import Store
    from ..streams import Writer

__all__ = ["RemoteReader", "RemoteWriter", "PublishedWriter"]


class RemoteReader:
    """Streams an object from another node, one request per read (nothing copied whole).

    Not thread-safe.
    """

    def __init__(self, links: Links, node: int, key: str) -> None:
        self._msg, self._node, self.key = links.messenger, node, key
        self.size: int = self._msg.call(node, W.Read(key, 0, 0)).size
        self._pos = 0
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        if self.closed:
            raise errors.StoreClosedError(f"reader of {self.key!r} is closed")
        n = self.size - self._pos if n is None or n < 0 else min(n, self.size - self._pos)
        if n <= 0:
            return b""
        data: bytes = self._msg.call(self._node, W.Read(self.key, self._pos, n)).data
        self._pos += len(data)
        return data

    def readinto(self, buf: Any) -> int:
        mv = memoryview(buf).cast("B")
        data = self.read(len(mv))
        mv[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> RemoteReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class RemoteWriter:
    """Writes a new raw object on another node, one request per write; sealed on close.

    Not thread-safe.
    """

    CHUNK = 16 << 20

    def __init__(self, links: Links, dirs: DirectoryClient, node: int, key: str, size: int) -> None:
        self._msg, self._dirs, self._node, self.key, self.size = links.messenger, dirs, node, key, size
        self._handle = self._msg.call(node, W.WriterOpen(key, size))
        self.closed = False

    def write(self, data: Any) -> int:
        if self.closed:
            raise errors.StoreClosedError(f"writer of {self.key!r} is closed")
        mv = memoryview(data).cast("B")
        for pos in range(0, len(mv), self.CHUNK):
            self._msg.call(self._node, W.Write(self._handle, bytes(mv[pos: pos + self.CHUNK])), self.key)
        return len(mv)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            version = self._msg.call(self._node, W.WriterClose(self._handle, False), self.key)
            self._dirs.ask(W.DirAdd([self.key], self._node, [self.size], [version]))  # sealed there: locatable

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self._msg.call(self._node, W.WriterClose(self._handle, True), self.key)

    def __enter__(self) -> RemoteWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class PublishedWriter:
    """A writer of this node's store that registers its object in the directory once sealed (a Cluster's
    ``open_writer`` for this node). Not thread-safe."""

    def __init__(self, dirs: DirectoryClient, store: Store, writer: Writer, key: str, size: int) -> None:
        self._dirs, self._store, self._writer, self.key, self._size = dirs, store, writer, key, size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)

    def close(self) -> None:
        closed = self._writer.closed
        self._writer.close()
        if not closed:
            try:
                ctime: W.Version = self._store.get_info(self.key).created
            except errors.ObjectNotFoundError:
                return  # deleted already
            self._dirs.ask(W.DirAdd([self.key], self._dirs.links.node, [self._size], [ctime]))

    def __enter__(self) -> PublishedWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self._writer.abort()
