"""The Messenger's reply tags around frames pushed with answers (rpc.py, fetch.py): a tag whose frame no receive
has taken yet is never handed to a new call, and a drained frame frees its tag only where the drain took it
(a drain cancelled after ``timeout`` leaves the tag burnt: the frame may still come). Real MPI on COMM_SELF
(a frame is an ``Isend`` to this rank itself): runs at any rank count."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from shmstore.mpi import abandon
from shmstore.mpi import tags as T
from shmstore.mpi import wire as W
from shmstore.mpi.rpc import Messenger

CYCLE = T.TAG_REPLY_MAX - T.TAG_REPLY_MIN  # tags before next_tag comes round again


def _messenger(timeout: float) -> tuple[Messenger, MPI.Comm, MPI.Comm]:
    comm, frames = MPI.COMM_SELF.Dup(), MPI.COMM_SELF.Dup()
    return Messenger(comm, ["self"], [0], 0.0, timeout=timeout, frames=frames), comm, frames


def _pushed(tag: int, nbytes: int) -> W.Found:
    return W.Found(0, nbytes, 1, None, None, 0, tag)


def test_a_tag_owed_a_pushed_frame_is_never_handed_out_until_its_receive_is_posted():
    m, comm, frames = _messenger(60.0)
    try:
        tag = m.next_tag()
        m.owe(tag)
        assert tag not in {m.next_tag() for _ in range(2 * CYCLE)}
        m.paid(tag)
        assert tag in {m.next_tag() for _ in range(CYCLE)}
    finally:
        comm.Free()
        frames.Free()


def test_a_drained_frame_frees_its_tag_once_taken_and_its_bytes_are_dropped():
    m, comm, frames = _messenger(60.0)
    try:
        tag = m.next_tag()
        data = np.arange(1 << 18, dtype=np.uint8)
        send = frames.Isend([data, MPI.BYTE], dest=0, tag=tag)
        m.owe(tag)  # as call_tagged does when the answer says pushed
        m.drain(0, _pushed(tag, data.nbytes))
        assert abandon.wait_released(30), abandon.stats()
        assert send.Test()
        assert tag in {m.next_tag() for _ in range(CYCLE)}  # free again
        assert not frames.Iprobe(0, tag)  # nothing left for a later call to take
    finally:
        comm.Free()
        frames.Free()


def test_a_drain_that_never_sees_its_frame_is_cancelled_and_burns_the_tag():
    """This rank stopped past ``timeout`` (or its holder never sent): the drain's receive is cancelled, and a
    frame that comes after must never be taken by a later call on the same tag (it would seal another object's
    bytes): the tag is never used again."""
    m, comm, frames = _messenger(0.2)
    try:
        tag = m.next_tag()
        m.drain(0, _pushed(tag, 4096))
        assert abandon.wait_released(30), abandon.stats()
        assert tag not in {m.next_tag() for _ in range(2 * CYCLE)}
    finally:
        comm.Free()
        frames.Free()
