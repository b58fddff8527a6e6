"""The control messages between ranks and node services, by name.

A request travels as ``(reply_tag, message, linger, thread)`` on
``TAG_REQUEST`` to a node's leader (``thread``: the sending thread's id, see
:func:`request`); the service answers on ``reply_tag`` with the handler's value (a
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

import enum
import threading
from typing import Any, Callable, NamedTuple, TypeAlias

from mpi4py import MPI

from .. import errors
from . import tags as T

__all__ = [
    "Version", "Outcome",
    "Lookup", "LookupMany", "Data", "Release", "Has", "Delete", "Pull", "Read", "WriterOpen", "Write", "WriterClose",
    "DirAdd", "DirDrop", "DirGet", "DirTake", "DirReplace", "DirSource", "DirSourceSmall", "DirSourceFor", "DirDone",
    "DirSourceMany", "GAVE_UP", "DoneItem", "DirDoneMany", "DirCopies", "DirSettle", "Forward", "Stop",
    "Found", "FoundMany", "Source", "Sourced", "Holders", "Located", "Refused", "Chunk", "Failure",
    "MESSAGES",
    "encode", "decode", "request", "request_nowait", "post", "reply", "reply_nowait", "receive", "receive_reply",
    "handles", "pushed",
]

Version: TypeAlias = float | None
"""Which object under a key a node's copy is: its creation time there (``ObjectInfo.created``); None: unknown.
What tells a copy from a later object put under the same key, so that a deletion removes exactly the copy it
means (see ``directory.py``)."""


class Outcome(enum.Enum):
    """How a fetch from a holder ended (:class:`DirDone`, :class:`DoneItem`)."""
    # the fetcher holds a copy now the holder had no copy (the directory drops it) the transfer failed (the holder is
    # free again, nothing listed)
    COPIED = "copied"
    STALE = "stale"
    FAILED = "failed"


# ---- requests to a node's objects ------------------------------------------------
class Lookup(NamedTuple):
    """Is ``key`` here? Replies :class:`Found` (pinned there until sent or released) or None. ``push_max``:
    a larger object of at most this many bytes in host memory comes without a :class:`Data` request, its
    one frame sent with the answer (``Found.pushed``; 0: none is)."""
    key: str
    inline_max: int
    push_max: int = 0


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
    """Delete this node's copy of ``key``: True if there was one. With ``version`` (its creation time) only
    that very object (a copy the directory listed or refused), never a later one under the key."""
    key: str
    version: Version = None


class Pull(NamedTuple):
    """Fetch ``key`` into this node from node ``source``, whose copy the directory listed as ``version`` (a
    migration): None once it is here."""
    key: str
    source: int
    block: int
    version: Version = None


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
    copies: list[Version] | None = None


class DirDrop(NamedTuple):
    """Node ``node`` is to hold no copy of ``key`` (sent before the copy is deleted): only if its listed copy
    is ``version`` (not another object put there meanwhile) and, with ``keep`` >= 0, while node ``keep`` is
    listed (a move drops its sources only while its destination holds the key: two moves the opposite
    ways would otherwise drop both copies). True if it was dropped."""
    key: str
    node: int
    version: Version = None
    keep: int = -1


class DirCopies(NamedTuple):
    """The holders of ``key`` with their copies: :class:`Holders`."""
    key: str


class DirGet(NamedTuple):
    """The holders of each key: :class:`Located`."""
    keys: list[str]


class DirTake(NamedTuple):
    """The holders of ``key`` with their copies (:class:`Holders`), forgetting the key (a delete of every copy).
    Fetches of it in flight are refused when they end; where there are (``Holders.pending``), the taker settles
    them (:class:`DirSettle`, named by its ``token``) so that no copy of the deleted object is left when it
    returns."""
    key: str
    token: int = 0


class DirReplace(NamedTuple):
    """Node ``node`` holds the only copy of ``key`` now (``nbytes``, its ``version``; an overwrite): the other
    holders with their copies (:class:`Holders`), which the overwriter then deletes (fetches of the old object
    in flight: as for :class:`DirTake`)."""
    key: str
    node: int
    nbytes: int
    version: Version = None
    token: int = 0


class DirSettle(NamedTuple):
    """The copies of ``key`` that fetches in flight when a :class:`DirTake` or :class:`DirReplace` named
    ``token`` took the entry landed since (refused: the taker deletes them), and how many are still out:
    :class:`Holders`. A fetch's registration is posted, so a get may return before its home hears of the copy:
    without this, a delete or an overwrite that came first left that old copy readable on its node for a
    while, even to a get ordered after them by a barrier."""
    key: str
    token: int


class DirSource(NamedTuple):
    """The holder node ``node`` should fetch ``key`` from (a :class:`Source`; None: no node has it); ``node`` is
    pending in the entry until its :class:`DirDone` (named by ``token``, which the DirDone brings back; 0: none,
    unit tests).
    A large object's holder sends to one node at a time: the answer waits for a free holder, so copies spread
    as a tree. Where the home itself is that holder it looks the object up at once (``inline_max`` as in
    :class:`Lookup`; 0: it does not) and answers a :class:`Sourced`: one round trip saved."""
    key: str
    node: int
    inline_max: int = 0
    token: int = 0
    push_max: int = 0


class DirSourceSmall(NamedTuple):
    """:class:`DirSource` asked by a get that missed, before its node's migration entry is taken (the fetcher
    takes it once the lookup says the object is large, see ``fetch.py``; where another rank of its node has it,
    the fetcher gives the source back with a failed :class:`DirDone`). Where a third node holds it, the home
    forwards the question there (:class:`Forward`) and that holder answers a :class:`Sourced`: one hop saved,
    small object or large."""
    key: str
    node: int
    inline_max: int
    token: int = 0
    push_max: int = 0


class DirSourceFor(NamedTuple):
    """A migration's pull of ``key`` into ``node`` from the holder ``source`` it chose, whose copy was listed
    as ``version``: ``Source(source)``, pending at once (no queueing, no choice), or None where the key has no entry
    any more or ``source`` lists another copy than this one (replaced or moved since)."""
    key: str
    node: int
    source: int
    version: Version
    token: int = 0


class Forward(NamedTuple):
    """From a key's home to a holder: look ``key`` up (``inline_max`` and ``push_max`` as in :class:`Lookup`)
    and answer rank ``rank`` on its reply ``tag`` with a :class:`Sourced`, as if it had asked (a forwarded
    DirSource)."""
    key: str
    inline_max: int
    rank: int
    tag: int
    push_max: int = 0




class DirSourceMany(NamedTuple):
    """For a batch: the holders of each key other than ``node`` (:class:`Located`); ``node`` is pending in
    every entry with one, until the batch's :class:`DirDoneMany`. No queueing (batches are of small objects)."""
    keys: list[str]
    node: int
    token: int = 0


class DirDone(NamedTuple):
    """Node ``node``'s fetch of ``key`` from ``source`` ended with ``outcome``: copied (``node`` now holds
    ``nbytes``), stale (``source`` had no copy) or failed. Frees ``source`` for the next fetcher. Posted;
    where the home answers it (on its own node) the answer is False if the copy was refused: ``node`` was not
    pending any more (the key was deleted or overwritten meanwhile) and its copy must go."""
    key: str
    source: int
    node: int
    outcome: Outcome
    nbytes: int
    # the fetched object's creation time on ``node`` (what a refusal deletes); None: none
    version: Version = None
    # the DirSource's: which pending fetch this is (a fetch named in an entry replaced since
    token: int = 0
    #                 must not be taken for another fetch of the same node, named in the new one)


GAVE_UP = -1  # a DirDone's source where the fetcher gave its DirSource up before the answer came (see directory.py)


class DoneItem(NamedTuple):
    """One key's :class:`DirDone` in a :class:`DirDoneMany`."""
    key: str
    source: int
    outcome: Outcome
    nbytes: int
    version: Version = None


class DirDoneMany(NamedTuple):
    """:class:`DirDone` of each of a batch's keys from node ``node``. Posted; where the home answers it, the
    copies it refused (:class:`Refused`)."""
    node: int
    items: list[DoneItem]
    token: int = 0


# ---- replies ----------------------------------------------------------------------
class Found(NamedTuple):
    """An object a :class:`Lookup` found: its kind, size, blob count and array header; small objects
    come ``inline``, larger ones are pinned there under ``handle`` until a :class:`Data` request, or
    ``pushed``: sent at once as one raw frame on the first bulk communicator, on the reply tag given here
    (0: not pushed), pinned there until the asker takes it (it must: it takes it or drains it)."""
    kind: int
    nbytes: int
    nblobs: int
    array_meta: Any
    inline: bytes | None
    handle: int
    pushed: int = 0


class FoundMany(NamedTuple):
    """What a :class:`LookupMany` found: a Found or None per key."""
    items: list[Found | None]


class Source(NamedTuple):
    """A :class:`DirSource` (or :class:`DirSourceSmall`, :class:`DirSourceFor`) answer: fetch from the holder
    ``node`` (its Lookup comes next); the fetcher is pending there until its :class:`DirDone`."""
    node: int


class Sourced(NamedTuple):
    """A :class:`DirSource` answer from a home that holds the object: the holder (the home) and what its
    :class:`Lookup` found (None: its copy is gone)."""
    node: int
    found: Found | None


class Holders(NamedTuple):
    """The holders of a key, each with its copy: what :class:`DirCopies`, :class:`DirTake`,
    :class:`DirReplace` and :class:`DirSettle` answer; ``pending``: fetches of the object taken still in flight
    (see :class:`DirSettle`)."""
    copies: list[tuple[int, Version]]
    pending: int = 0

    @property
    def nodes(self) -> list[int]:
        return [n for n, _ in self.copies]


class Located(NamedTuple):
    """The holders of each key asked (a list of node indices per key): what :class:`DirGet` and
    :class:`DirSourceMany` answer."""
    nodes: list[list[int]]


class Refused(NamedTuple):
    """The copies a home refused, ``(key, copy)`` each (deleted or replaced while they came): what a
    :class:`DirDoneMany` answered on the home's own node gets; those copies must go."""
    copies: list[tuple[str, Version]]


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
    def of(cls, exc: BaseException) -> Failure:
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
MESSAGES: dict[int, type[Any]] = {  # every message by its code on the wire (codes never reused)
    0: Lookup, 1: LookupMany, 2: Data, 3: Release, 4: Has, 5: Delete, 6: Pull, 7: Read, 8: WriterOpen, 9: Write,
    10: WriterClose, 11: Stop, 12: DirAdd, 13: DirDrop, 14: DirGet, 15: DirTake, 16: DirReplace, 17: DirSource,
    18: DirDone, 19: Found, 20: FoundMany, 21: Sourced, 22: Chunk, 23: Failure, 24: DirSourceMany,
    25: DirDoneMany, 26: DirCopies, 27: Forward, 28: DirSourceSmall, 29: DirSourceFor, 30: Holders, 31: Located,
    32: Refused, 33: Source, 35: DirSettle,  # (34: Large, a DirSourceSmall answer no more)
}
_PLAIN = -1
_OUTCOMES = {o.value: o for o in Outcome}

# Messages whose fields hold other messages or enums, taken apart to plain data and made again (pickle would
# rebuild them through Python calls); the others travel as ``tuple(msg)`` and come back by ``cls._make``.
_PACK: dict[type, Callable[[Any], Any]] = {
    Sourced: lambda m: (m.node, None if m.found is None else tuple(m.found)),
    FoundMany: lambda m: [None if f is None else tuple(f) for f in m.items],
    DirDone: lambda m: (m.key, m.source, m.node, m.outcome.value, m.nbytes, m.version, m.token),
    DirDoneMany: lambda m: (m.node, [(i.key, i.source, i.outcome.value, i.nbytes, i.version) for i in m.items],
                            m.token),
}
_UNPACK: dict[type, Callable[[Any], Any]] = {
    Sourced: lambda f: Sourced(f[0], None if f[1] is None else Found._make(f[1])),
    FoundMany: lambda f: FoundMany([None if x is None else Found._make(x) for x in f]),
    DirDone: lambda f: DirDone(f[0], f[1], f[2], _OUTCOMES[f[3]], f[4], f[5], f[6]),
    DirDoneMany: lambda f: DirDoneMany(f[0], [DoneItem(k, s, _OUTCOMES[o], n, c) for k, s, o, n, c in f[1]], f[2]),
}
_ENCODE: dict[type, tuple[int, Callable[[Any], Any]]] = {
    t: (code, _PACK.get(t, tuple)) for code, t in MESSAGES.items()}
_DECODE: dict[int, Callable[[Any], Any]] = {
    code: _UNPACK.get(t, t._make) for code, t in MESSAGES.items()}


def encode(obj: Any) -> tuple[int, Any]:
    """``obj`` as plain data: ``(code, fields)`` of a message above, ``(-1, obj)`` of anything else."""
    coder = _ENCODE.get(type(obj))
    if coder is None:
        return _PLAIN, obj
    return coder[0], coder[1](obj)


def decode(frame: tuple[int, Any]) -> Any:
    """The message (or value) :func:`encode` made ``frame`` of.

    Raises:
        TransferError: ``frame`` names no message (a peer of another version).
    """
    code, fields = frame
    if code == _PLAIN:
        return fields
    try:
        make = _DECODE[code]
    except KeyError:
        raise errors.TransferError(f"unknown message code {code} (ranks of different shmstore versions?)") \
            from None
    return make(fields)


def request(comm: MPI.Comm, msg: Any, dest: int, reply_tag: int, linger: float = 0.0) -> None:
    """Send request ``msg`` to the service on rank ``dest``; it answers on ``reply_tag`` (0: no answer).
    ``linger``: seconds the service should keep probing without naps after it (more requests follow soon:
    a batched fetch's rounds). The request names the sending thread (its id on its machine): where the service
    runs on the same machine, its spin after answering gives way to that thread when it waits for the same CPU
    (``poll.prober``'s ``partner``). For small messages, which MPI buffers at once: a larger one, or one that may
    be, goes by :func:`request_nowait` (a blocking send of it would wait for the receiver, for ever if the
    receiver died)."""
    comm.send((reply_tag, encode(msg), linger, threading.get_native_id()), dest=dest, tag=T.TAG_REQUEST)


def request_nowait(comm: MPI.Comm, msg: Any, dest: int, reply_tag: int, linger: float = 0.0) -> MPI.Request:
    """:func:`request` without waiting for the receiver to take it: the request, which holds the message's
    bytes, must be waited for with a deadline (or cancelled)."""
    return comm.isend((reply_tag, encode(msg), linger, threading.get_native_id()), dest=dest, tag=T.TAG_REQUEST)


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


def receive(comm: MPI.Comm, source: int, tag: int,
            status: MPI.Status | None = None) -> tuple[int, Any, float, int]:
    """A request waiting from ``source``: (its reply tag, the message, its linger, the sending thread's id)."""
    reply_tag, frame, linger, thread = comm.recv(source=source, tag=tag, status=status)
    return reply_tag, decode(frame), linger, thread


def handles(reply: Any) -> list[int]:
    """The handles of the large objects a reply pinned for Data requests (a Found, a Sourced's, a FoundMany's)."""
    if isinstance(reply, Sourced):
        reply = reply.found
    items = reply.items if isinstance(reply, FoundMany) else [reply]
    return [f.handle for f in items if isinstance(f, Found) and f.handle]


def pushed(reply: Any) -> list[Found]:
    """The objects a reply's answers pushed as frames with it (a Found's, a Sourced's): the asker takes each
    frame, or drains it (its holder's pin ends only once MPI is done with the frame)."""
    if isinstance(reply, Sourced):
        reply = reply.found
    return [reply] if isinstance(reply, Found) and reply.pushed else []


def receive_reply(comm: MPI.Comm, source: int, tag: int, status: MPI.Status | None = None) -> Any:
    """The answer waiting from ``source`` (or ``MPI.ANY_SOURCE``) on reply ``tag``."""
    return decode(comm.recv(source=source, tag=tag, status=status))
