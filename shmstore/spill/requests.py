"""Requests from clients to the spill process: make room, move an object, make a device level's arena.

Each client has one request record in its CLIENT record. The client writes
it (status ``pending``, a new sequence number) and posts the store's wake
semaphore; the spill process serves pending records in turn and writes
``done`` or ``failed`` with an error kind and message; the client polls its
own record with backoff. Nobody holds a store lock while waiting, so the
spill process can always take every lock a move needs.

If the spill process dies, the waiting client restarts it (``ensure_spill``)
and the new one serves the still-pending record.

The status is each side's publishing store, written last and alone: the
client fills in a request while its status says idle, then makes it
pending; the spill process writes the error and message, then done or
failed. So neither side ever reads a request or an answer half written.
"""
from __future__ import annotations

import time
from typing import Callable

from ..errors import LockTimeoutError
from ..meta import layout as L
from ..meta.lock import held_here
from ..node.nodestore import NodeStore
from ..primitives.interrupts import interruptible
from .supervisor import ensure_spill

__all__ = ["submit", "wait", "pending", "complete", "request_arena"]

_KINDS = {L.REQ_SPACE: "make room", L.REQ_MOVE: "move an object", L.REQ_GPU: "make a GPU arena"}


def submit(node: NodeStore, slot: int, kind: int, nbytes: int = 0, idx: int = 0, gen: int = 0,
           level: int = 0, arena: int = 0) -> int:
    """Post a request for client ``slot``; returns its sequence number.

    Raises:
        LockTimeoutError: the calling thread holds a lock of the store (a bug in shmstore): the spill process
            may need that lock to serve any request, and a client taking every lock (``check``) would wait on
            this one while it waits on the spill process. Said at once, instead of all three waiting for a
            lock timeout (a first GPU put did, under its stripe lock: stop 52's CI).
    """
    held = held_here([*node.stripes, node.alloc_lock, node.admin])
    if held:
        raise LockTimeoutError(
            f"a request to the spill process ({_KINDS.get(kind, kind)}) from a thread that holds the store's lock(s) "
            f"{', '.join(held)}: the spill process may need them to serve it, and waiting would stand until a "
            f"lock timeout (a bug in shmstore: please report it with this traceback)")
    buf, at = node.buf, node.layout.client(slot) + L.REQUEST_OFFSET
    seq: int = (L.REQUEST.get(buf, at, "seq") + 1) & 0xFFFFFFFF
    L.REQUEST.set(buf, at, "status", L.RS_IDLE)  # then the rest, then pending: the publishing store
    L.REQUEST.pack(buf, at, kind=kind, seq=seq, idx=idx, gen=gen, level=level, status=L.RS_IDLE, nbytes=nbytes,
                   arena=arena)
    L.REQUEST.set(buf, at, "status", L.RS_PENDING)
    node.wake.post()
    return seq


@interruptible
def wait(node: NodeStore, slot: int, seq: int, timeout: float,
         progress: Callable[[L.SpillState], None] | None = None) -> L.Request | None:
    """Wait for request ``seq`` of client ``slot`` to finish; None on timeout (then it is withdrawn).

    Interruptible (Ctrl-C raises here at once): the request is withdrawn; a
    spill the spill process already began finishes, as for any request.
    """
    try:
        return _wait(node, slot, seq, timeout, progress)
    except BaseException:
        withdraw(node, slot, seq)
        raise


def withdraw(node: NodeStore, slot: int, seq: int) -> None:
    """Withdraw request ``seq`` of client ``slot`` if it is still pending (its client gave up on it)."""
    at = node.layout.client(slot) + L.REQUEST_OFFSET
    if L.REQUEST.get(node.buf, at, "seq") == seq and L.REQUEST.get(node.buf, at, "status") == L.RS_PENDING:
        L.REQUEST.set(node.buf, at, "status", L.RS_IDLE)


@interruptible
def _wait(node: NodeStore, slot: int, seq: int, timeout: float,
          progress: Callable[[L.SpillState], None] | None) -> L.Request | None:
    buf, coff = node.buf, node.layout.client(slot)
    deadline = time.monotonic() + timeout
    pause, next_check = 0.0002, time.monotonic() + 0.5
    while True:
        r = L.unpack_request(buf, coff)
        if r.seq != seq:
            return None  # withdrawn or superseded
        if r.status in (L.RS_DONE, L.RS_FAILED):
            return r
        now = time.monotonic()
        if now > deadline:
            L.REQUEST.set(buf, coff + L.REQUEST_OFFSET, "status", L.RS_IDLE)  # withdrawn
            return None
        if now > next_check:  # the spill process may have died: restart it, it serves the record
            ensure_spill(node)
            node.wake.post()
            next_check = now + 0.5
        if progress is not None:
            progress(L.unpack_spill_state(buf))
        time.sleep(pause)
        pause = min(pause * 2, 0.005)


def pending(node: NodeStore) -> list[tuple[int, L.Request]]:
    """(slot, request) of every attached client with a pending request (spill process side)."""
    buf, lay = node.buf, node.layout
    t = L.client_table(buf, lay)
    slots = ((t["state"] == 1) & (t["req_status"] == L.RS_PENDING)).nonzero()[0]
    return [(int(s), L.unpack_request(buf, lay.client(int(s)))) for s in slots]


def complete(node: NodeStore, slot: int, req: L.Request, error: int = 0, message: str = "") -> None:
    """Finish ``req`` of client ``slot`` (unless the client withdrew it meanwhile)."""
    buf, at = node.buf, node.layout.client(slot) + L.REQUEST_OFFSET
    if L.REQUEST.get(buf, at, "seq") == req.seq and L.REQUEST.get(buf, at, "status") == L.RS_PENDING:
        L.REQUEST.set(buf, at, "error", error)
        L.REQUEST.set(buf, at, "message", message.encode()[:120])
        L.REQUEST.set(buf, at, "status", L.RS_FAILED if error else L.RS_DONE)  # the answer, last


def request_arena(node: NodeStore, slot: int, level: int, d: int) -> str | None:
    """Ask the spill process to make arena slot ``d`` of ``level`` (``REQ_GPU``) for client ``slot``, and
    wait for it (``spill_timeout``): None once made, else why not. What a client's device level is opened
    with (``open_levels``), so that the level sends no request of its own."""
    seq = submit(node, slot, L.REQ_GPU, idx=d, level=level)
    r = wait(node, slot, seq, node.cfg.spill_timeout)
    if r is None:
        return "no answer from the spill process"
    return None if r.status == L.RS_DONE else str(r.message)
