"""The wire codec (mpi/wire.py): every message survives encode/decode with its fields and types; plain values
pass through; a code no message has is refused naming it; a Failure becomes the exception it names.

No MPI traffic: runs on any rank count (every rank checks the same thing)."""
from __future__ import annotations

import pickle

import pytest

import shmstore
from shmstore.mpi import wire as W

FOUND = W.Found(3, 100, 2, b"<f8\0", b"x" * 100, 0)
OUT = W.Outcome.COPIED

# one example of every message (the test below checks that none is missing)
EXAMPLES: dict[type, object] = {
    W.Lookup: W.Lookup("k", 65536),
    W.LookupMany: W.LookupMany(["a", "b"], 1024),
    W.Data: W.Data(7, 1 << 20, 2),
    W.Release: W.Release(7),
    W.Has: W.Has("k"),
    W.Delete: W.Delete("k", 1.5),
    W.Pull: W.Pull("k", 2, 1 << 20, None),
    W.Read: W.Read("k", 10, 20),
    W.WriterOpen: W.WriterOpen("k", 99),
    W.Write: W.Write(3, b"\0\1\2"),
    W.WriterClose: W.WriterClose(3, True),
    W.Stop: W.Stop(),
    W.DirAdd: W.DirAdd(["a", "b"], 1, [10, 20], [1.0, None]),
    W.DirDrop: W.DirDrop("k", 1, 2.5, keep=0),
    W.DirGet: W.DirGet(["a", "b"]),
    W.DirTake: W.DirTake("k"),
    W.DirReplace: W.DirReplace("k", 1, 64, 3.0),
    W.DirSource: W.DirSource("k", 1, 65536, 99),
    W.DirSourceSmall: W.DirSourceSmall("k", 1, 65536, 98),
    W.DirSourceFor: W.DirSourceFor("k", 1, 2, 4.5, 97),
    W.DirDone: W.DirDone("k", 2, 1, W.Outcome.STALE, 0, None, 99),
    W.DirSourceMany: W.DirSourceMany(["a", "b"], 1, 5),
    W.DirDoneMany: W.DirDoneMany(1, [W.DoneItem("a", 0, OUT, 8, 1.0), W.DoneItem("b", 0, W.Outcome.FAILED, 0)], 5),
    W.DirCopies: W.DirCopies("k"),
    W.DirSettle: W.DirSettle("k", 7 << 40),
    W.Forward: W.Forward("k", 65536, 3, 1234),
    W.Found: FOUND,
    W.FoundMany: W.FoundMany([FOUND, None, FOUND._replace(inline=None, handle=9)]),
    W.Source: W.Source(2),
    W.Sourced: W.Sourced(0, FOUND),
    W.Holders: W.Holders([(0, 1.0), (2, None)], 2),
    W.Located: W.Located([[0, 2], []]),
    W.Refused: W.Refused([("k", 1.0)]),
    W.Chunk: W.Chunk(100, b"abc"),
    W.Failure: W.Failure("ObjectNotFoundError", "no object 'k'"),
}


def test_every_message_has_an_example_and_a_code_of_its_own():
    assert set(EXAMPLES) == set(W.MESSAGES.values())  # a new message needs an example here
    assert len(set(W.MESSAGES.values())) == len(W.MESSAGES)  # one code per message
    assert all(t.__name__ in W.__all__ and getattr(W, t.__name__) is t for t in W.MESSAGES.values())


@pytest.mark.parametrize("code", sorted(W.MESSAGES), ids=lambda c: W.MESSAGES[c].__name__)
def test_every_message_survives_the_wire(code):
    msg = EXAMPLES[W.MESSAGES[code]]
    frame = W.encode(msg)
    assert frame[0] == code
    back = W.decode(pickle.loads(pickle.dumps(frame)))  # as MPI's pickled send carries it
    assert type(back) is type(msg) and back == msg
    assert _types(back) == _types(msg)  # nested messages and enums come back as themselves


def _types(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return (type(value), [_types(v) for v in value])
    return type(value)


def test_on_the_wire_a_message_is_plain_data():
    """pickle rebuilds a NamedTuple or an enum through Python calls (3 us a message each way): the frame holds
    only builtins."""
    for msg in EXAMPLES.values():
        assert _plain(W.encode(msg)), msg


def _plain(value: object) -> bool:
    if type(value) in (list, tuple):
        return all(_plain(v) for v in value)
    return type(value) in (int, float, str, bytes, bool, type(None))


def test_plain_values_pass_through():
    for value in (None, True, 3, 2.5, "x", [1, [2]], (1, "a")):
        assert W.decode(W.encode(value)) == value


def test_an_unknown_code_is_refused_naming_it():
    with pytest.raises(shmstore.errors.TransferError, match="unknown message code 9999"):
        W.decode((9999, ()))


def test_a_failure_becomes_the_exception_it_names():
    exc = W.decode(W.encode(W.Failure.of(shmstore.errors.ObjectNotFoundError("no object 'k'", "k"))))
    err = exc.exception("node 'n1'", "k", 3)
    assert isinstance(err, shmstore.errors.ObjectNotFoundError) and "node 'n1': no object 'k'" in str(err)
    err = W.Failure.of(ValueError("bug")).exception("node 'n1'", "k", 3)
    assert isinstance(err, shmstore.errors.TransferError) and "ValueError: bug" in str(err)


def test_a_request_names_the_thread_that_sent_it():
    """A request carries its sending thread's id (a node service on the same machine gives its CPU to that thread
    where it waits for it, see poll.prober's partner), from any thread, through both ways of sending."""
    import threading

    from mpi4py import MPI

    comm = MPI.COMM_SELF.Dup()
    try:
        req = W.request_nowait(comm, W.Has("k"), 0, 9, 0.5)
        assert W.receive(comm, 0, W.T.TAG_REQUEST) == (9, W.Has("k"), 0.5, threading.get_native_id())
        req.wait()
        ids = []

        def other() -> None:  # a blocking send to this very rank: taken by the receive below
            ids.append(threading.get_native_id())
            W.request(comm, W.Release(3), 0, 0)

        t = threading.Thread(target=other)
        t.start()
        got = W.receive(comm, 0, W.T.TAG_REQUEST)
        t.join(60)
        assert got == (0, W.Release(3), 0.0, ids[0]) and ids[0] != threading.get_native_id()
    finally:
        comm.Free()
