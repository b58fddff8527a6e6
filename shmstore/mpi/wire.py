"""The control messages between ranks and node services, by name.

A request travels as ``(reply_tag, message)`` on ``TAG_REQUEST`` to a node's
leader; the service answers on ``reply_tag`` with the handler's value (a
plain value or one of the replies below), or with a :class:`Failure`
carrying the exception. A ``reply_tag`` of 0 asks for no answer (a message
posted, e.g. the registration of a fetched copy). Every message is a
``NamedTuple``: fields by name on both ends. On the wire it is a plain
tuple, ``(code, fields)`` (:func:`encode`, :func:`decode`): pickle takes
a NamedTuple apart and rebuilds it through Python calls, 3 us a message
each way, a third of a small fetch's round trip; a plain tuple costs 0.5.
:func:`request`, :func:`request_nowait`, :func:`post`, :func:`reply`,
:func:`reply_nowait`, :func:`receive` and :func:`receive_reply` are the only
ways messages go out and come in. Small messages go by blocking sends (MPI
buffers them at once: 0.2 us less than a kept ``isend``, on every hop of a
small get); those that may pass MPI's eager size go without blocking and
are waited for with a deadline (``rpc.py``, ``outbox.py``): a blocking
send of one waits for its receiver, for ever if it died.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from mpi4py import MPI

from .. import errors
from . import tags as T

__all__ = [
    "Lookup", "LookupMany", "Data", "Release", "Has", "Delete", "Pull", "Read", "WriterOpen", "Write", "WriterClose",
    "DirAdd", "DirDrop", "DirGet", "DirTake", "DirReplace", "DirSource", "DirDone", "DirSourceMany",
    "DirDoneMany", "DirCopies", "Forward", "Stop",
    "Found", "FoundMany", "Sourced", "Chunk", "Failure", "LARGE",
    "encode", "decode", "request", "request_nowait", "post", "reply", "reply_nowait", "receive", "receive_reply",
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
    """Delete this node's copy of ``key``: True if there was one. With ``copy`` (its creation time) only
    that very object (a copy the directory listed or refused), never a later one under the key."""
    key: str
    copy: float | None = None


class Pull(NamedTuple):
    """Fetch ``key`` into this node from node ``source``, whose copy the directory listed as ``copy`` (a
    migration): None once it is here."""
    key: str
    source: int
    block: int
    copy: float | None = None


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
    """Node ``node`` holds complete copies of ``keys`` (of ``sizes`` bytes; ``copies``: each object's creation
    time there, what tells it from a later object under the key, None where unknown)."""
    keys: list[str]
    node: int
    sizes: list[int]
    copies: list[float | None] | None = None


class DirDrop(NamedTuple):
    """Node ``node`` is to hold no copy of ``key`` (sent before the copy is deleted): only if its listed copy
    is ``copy`` (not another object put there meanwhile) and, with ``keep`` >= 0, while node ``keep`` is
    listed (a move drops its sources only while its destination holds the key: two moves the opposite
    ways would otherwise drop both copies). True if it was dropped."""
    key: str
    node: int
    copy: float | None = None
    keep: int = -1


class DirCopies(NamedTuple):
    """The holders of ``key`` with their copies: a list of (node, copy)."""
    key: str


class DirGet(NamedTuple):
    """The holders of each key: a list of node-index lists."""
    keys: list[str]


class DirTake(NamedTuple):
    """The holders of ``key`` with their copies, a list of (node, copy), forgetting the key (a delete of every
    copy; fetches in flight are refused when they end)."""
    key: str


class DirReplace(NamedTuple):
    """Node ``node`` holds the only copy of ``key`` now (``nbytes``, its ``copy``; an overwrite): the other
    holders with their copies, a list of (node, copy), which the overwriter then deletes (fetches in flight
    are refused when they end)."""
    key: str
    node: int
    nbytes: int
    copy: float | None = None


class DirSource(NamedTuple):
    """The holder node ``node`` should fetch ``key`` from (None: no node has it); ``node`` is pending in the
    entry until its :class:`DirDone`. A large object's holder
    sends to one node at a time: the answer waits for a free holder, so copies spread as a tree. Where the
    home itself is that holder it looks the object up at once (``inline_max`` as in :class:`Lookup`) and
    answers a :class:`Sourced`: one round trip saved. With ``small_only`` an object larger than ``inline_max``
    gets the answer :data:`LARGE` instead (the fetcher deduplicates large transfers on its node first)."""
    key: str
    node: int
    inline_max: int = 0
    small_only: bool = False  # objects over inline_max: answer LARGE, nothing registered (see fetch.py)
    source: int = -1  # >= 0: a migration pulling from this node: answered at once (None: no entry any more,
    source_copy: float | None = None  # or ``source`` lists another copy than this one: replaced or moved since)
    forward: bool = False  # a holder on a third node answers instead of the home (a Forward): one hop saved
    token: int = 0  # names this fetch while it is pending; its DirDone brings it back (0: none, unit tests)


class Forward(NamedTuple):
    """From a key's home to a holder: look ``key`` up (``inline_max`` as in :class:`Lookup`) and answer rank
    ``rank`` on its reply ``tag`` with a :class:`Sourced`, as if it had asked (a forwarded DirSource)."""
    key: str
    inline_max: int
    rank: int
    tag: int


LARGE = -1  # a DirSource(small_only=True) answer: the object is larger than inline_max


class DirSourceMany(NamedTuple):
    """For a batch: the holders of each key other than ``node`` (a list per key); ``node`` is pending in
    every entry with one, until the batch's :class:`DirDoneMany`. No queueing (batches are of small objects)."""
    keys: list[str]
    node: int
    token: int = 0


class DirDone(NamedTuple):
    """Node ``node``'s fetch of ``key`` from ``source`` ended: ``outcome`` is "copied" (``node`` now holds
    ``nbytes``), "stale" (``source`` had no copy) or "failed". Frees ``source`` for the next fetcher. Posted;
    where the home answers it (on its own node) the answer is False if the copy was refused: ``node`` was not
    pending any more (the key was deleted or overwritten meanwhile) and its copy must go."""
    key: str
    source: int
    node: int
    outcome: str
    nbytes: int
    copy: float | None = None  # the fetched object's creation time on ``node`` (what a refusal deletes); None: none
    token: int = 0  # the DirSource's: which pending fetch this is (a fetch named in an entry replaced since
    #                 must not be taken for another fetch of the same node, named in the new one)


class DirDoneMany(NamedTuple):
    """:class:`DirDone` of each of a batch's keys from node ``node``: ``items`` of (key, source, outcome,
    nbytes, copy). Posted; where the home answers it, the (key, copy) of the copies it refused."""
    node: int
    items: list[tuple[str, int, str, int, float | None]]
    token: int = 0


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


class FoundMany(NamedTuple):
    """What a :class:`LookupMany` found: a Found or None per key."""
    items: list[Found | None]


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


# ---- on the wire ------------------------------------------------------------------
_TYPES: tuple[Any, ...] = (
    Lookup, LookupMany, Data, Release, Has, Delete, Pull, Read, WriterOpen, Write, WriterClose, Stop,
    DirAdd, DirDrop, DirGet, DirTake, DirReplace, DirSource, DirDone, Found, FoundMany, Sourced, Chunk, Failure,
    DirSourceMany, DirDoneMany, DirCopies, Forward)
_CODE = {t: i for i, t in enumerate(_TYPES)}
_PLAIN, _SOURCED, _FOUND_MANY = -1, _CODE[Sourced], _CODE[FoundMany]


def encode(obj: Any) -> tuple[int, Any]:
    """``obj`` as plain data: ``(code, fields)`` of a message above, ``(-1, obj)`` of anything else."""
    code = _CODE.get(type(obj))
    if code is None:
        return _PLAIN, obj
    if code == _SOURCED:
        return code, (obj.node, None if obj.found is None else tuple(obj.found))
    if code == _FOUND_MANY:
        return code, [None if f is None else tuple(f) for f in obj.items]
    return code, tuple(obj)


def decode(frame: tuple[int, Any]) -> Any:
    """The message (or value) :func:`encode` made ``frame`` of."""
    code, fields = frame
    if code == _PLAIN:
        return fields
    if code == _SOURCED:
        return Sourced(fields[0], None if fields[1] is None else Found._make(fields[1]))
    if code == _FOUND_MANY:
        return FoundMany([None if f is None else Found._make(f) for f in fields])
    return _TYPES[code]._make(fields)


def request(comm: MPI.Comm, msg: Any, dest: int, reply_tag: int, linger: float = 0.0) -> None:
    """Send request ``msg`` to the service on rank ``dest``; it answers on ``reply_tag`` (0: no answer).
    ``linger``: seconds the service should keep probing without naps after it (more requests follow soon:
    a batched fetch's rounds). For small messages, which MPI buffers at once: a larger one, or one that may
    be, goes by :func:`request_nowait` (a blocking send of it would wait for the receiver, for ever if the
    receiver died)."""
    comm.send((reply_tag, encode(msg), linger), dest=dest, tag=T.TAG_REQUEST)


def request_nowait(comm: MPI.Comm, msg: Any, dest: int, reply_tag: int, linger: float = 0.0) -> MPI.Request:
    """:func:`request` without waiting for the receiver to take it: the request, which holds the message's
    bytes, must be waited for with a deadline (or cancelled)."""
    return comm.isend((reply_tag, encode(msg), linger), dest=dest, tag=T.TAG_REQUEST)


def post(comm: MPI.Comm, msg: Any, dest: int) -> None:
    """Send a small ``msg`` to the service on rank ``dest`` for no answer."""
    request(comm, msg, dest, 0)


def reply(comm: MPI.Comm, value: Any, dest: int, tag: int) -> None:
    """Answer a request of rank ``dest`` on its reply ``tag`` with a small value (see :func:`request`)."""
    comm.send(encode(value), dest=dest, tag=tag)


def reply_nowait(comm: MPI.Comm, value: Any, dest: int, tag: int) -> MPI.Request:
    """:func:`reply` without waiting for the requester to take it (a reply over MPI's eager size waits for
    that): the request, which holds the reply's bytes, must be kept until it completes (or cancelled)."""
    return comm.isend(encode(value), dest=dest, tag=tag)


def receive(comm: MPI.Comm, source: int, tag: int, status: MPI.Status | None = None) -> tuple[int, Any, float]:
    """A request waiting from ``source``: (its reply tag, the message, its linger)."""
    reply_tag, frame, linger = comm.recv(source=source, tag=tag, status=status)
    return reply_tag, decode(frame), linger


def receive_reply(comm: MPI.Comm, source: int, tag: int, status: MPI.Status | None = None) -> Any:
    """The answer waiting from ``source`` (or ``MPI.ANY_SOURCE``) on reply ``tag``."""
    return decode(comm.recv(source=source, tag=tag, status=status))
