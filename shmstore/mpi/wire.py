"""The control messages between ranks and node services, by name.

A request travels as ``(reply_tag, message)`` on ``TAG_REQUEST`` to a node's
leader; the service answers on ``reply_tag`` with the handler's value (a
plain value or one of the replies below), or with a :class:`Failure`
carrying the exception. A ``reply_tag`` of 0 asks for no answer (a message
posted, e.g. the registration of a fetched copy). Every message is a
``NamedTuple``: fields by name on both ends, pickled small.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from .. import errors

__all__ = [
    "Lookup", "LookupMany", "Data", "Release", "Has", "Delete", "Pull", "Read", "WriterOpen", "Write", "WriterClose",
    "DirAdd", "DirDrop", "DirGet", "DirTake", "DirSource", "DirDone", "Stop",
    "Found", "Sourced", "Chunk", "Failure",
]


# ---- requests to a node's objects ------------------------------------------------
class Lookup(NamedTuple):
    """Is ``key`` here? Replies :class:`Found` (pinned there until sent or released) or None."""
    key: str
    inline_max: int


class LookupMany(NamedTuple):
    """:class:`Lookup` of each key: a list of Found or None."""
    keys: list[str]
    inline_max: int


class Data(NamedTuple):
    """Send the leased object ``handle``: replies its size, then raw frames on the reply tag."""
    handle: int
    block: int
    streams: int


class Release(NamedTuple):
    """Drop the lease ``handle`` without sending it."""
    handle: int


class Has(NamedTuple):
    """Does this node hold ``key``: a bool."""
    key: str


class Delete(NamedTuple):
    """Delete this node's copy of ``key``: True if there was one."""
    key: str


class Pull(NamedTuple):
    """Fetch ``key`` into this node from node ``source`` (a migration): None once it is here."""
    key: str
    source: int
    block: int


class Read(NamedTuple):
    """``n`` bytes of ``key`` from ``offset``: a :class:`Chunk`."""
    key: str
    offset: int
    n: int


class WriterOpen(NamedTuple):
    """Open a writer of a raw object on this node: its handle."""
    key: str
    size: int


class Write(NamedTuple):
    handle: int
    data: bytes


class WriterClose(NamedTuple):
    """Seal (or with ``abort`` drop) the object of writer ``handle``."""
    handle: int
    abort: bool


class Stop(NamedTuple):
    """Sent by a leader to its own service when the cluster closes: the loop ends."""


# ---- requests to a key's home node: the location directory ------------------------
class DirAdd(NamedTuple):
    """Node ``node`` holds complete copies of ``keys`` (of ``sizes`` bytes)."""
    keys: list[str]
    node: int
    sizes: list[int]


class DirDrop(NamedTuple):
    """Node ``node`` holds no copy of ``key`` any more (sent before the copy is deleted)."""
    key: str
    node: int


class DirGet(NamedTuple):
    """The holders of each key: a list of node-index lists."""
    keys: list[str]


class DirTake(NamedTuple):
    """The holders of ``key``, forgetting the key (a delete of every copy)."""
    key: str


class DirSource(NamedTuple):
    """The holder node ``node`` should fetch ``key`` from (None: no node has it). A large object's holder
    sends to one node at a time: the answer waits for a free holder, so copies spread as a tree. Where the
    home itself is that holder it looks the object up at once (``inline_max`` as in :class:`Lookup`) and
    answers a :class:`Sourced`: one round trip saved."""
    key: str
    node: int
    inline_max: int = 0


class DirDone(NamedTuple):
    """Node ``node``'s fetch of ``key`` from ``source`` ended: ``outcome`` is "copied" (``node`` now holds
    ``nbytes``), "stale" (``source`` had no copy) or "failed". Frees ``source`` for the next fetcher."""
    key: str
    source: int
    node: int
    outcome: str
    nbytes: int


# ---- replies ----------------------------------------------------------------------
class Found(NamedTuple):
    """An object a :class:`Lookup` found: its kind, size, blob count and array header; small objects
    come ``inline``, larger ones are pinned there under ``handle`` until a :class:`Data` request."""
    kind: int
    nbytes: int
    nblobs: int
    array_meta: Any
    inline: bytes | None
    handle: int


class Sourced(NamedTuple):
    """A :class:`DirSource` answer from a home that holds the object: the holder (the home) and what its
    :class:`Lookup` found (None: its copy is gone)."""
    node: int
    found: Found | None


class Chunk(NamedTuple):
    """What a :class:`Read` returns: the object's size and the bytes read."""
    size: int
    data: bytes


_KEYED = (errors.ObjectNotFoundError, errors.ObjectExistsError, errors.ObjectLockedError, errors.SpillError)


class Failure(NamedTuple):
    """A request failed with exception ``error`` (a name in :mod:`shmstore.errors`) saying ``message``."""
    error: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> "Failure":
        if isinstance(exc, errors.ShmStoreError):
            return cls(type(exc).__name__, str(exc))
        return cls("TransferError", f"{type(exc).__name__}: {exc}")  # a bug there: reported, not fatal

    def exception(self, where: str, key: Any = None, peer: int | None = None) -> Exception:
        """The exception to raise here, its message prefixed with ``where`` (the node that failed)."""
        cls = getattr(errors, self.error, errors.TransferError)
        message = f"{where}: {self.message}"
        if not (isinstance(cls, type) and issubclass(cls, errors.ShmStoreError)):
            return errors.TransferError(message, None, peer)
        if issubclass(cls, errors.TransferError):
            return cls(message, key if isinstance(key, str) else None, peer)
        try:
            return cls(message, key) if isinstance(key, str) and cls in _KEYED else cls(message)
        except TypeError:
            return errors.TransferError(message, None, peer)
