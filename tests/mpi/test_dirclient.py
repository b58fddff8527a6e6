"""The directory client (mpi/dirclient.py): a request goes to its key's home node; this rank's own share answers
without a message where this rank keeps it; posts get no answer. A recording messenger stands in for the
other nodes (no MPI traffic: runs at any rank count)."""
from __future__ import annotations

from mpi4py import MPI

from shmstore.mpi import wire as W
from shmstore.mpi.dirclient import DirectoryClient
from shmstore.mpi.directory import Directory, home_of
from shmstore.mpi.links import Links


class Recorder:
    """The messenger of a Links: records what would go to which node, answers calls with a Located."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, object]] = []

    def call(self, node: int, msg: object, linger: float = 0.0, any_source: bool = False) -> object:
        self.sent.append(("call", node, msg))
        return W.Located([[node]])

    def post(self, node: int, msg: object) -> None:
        self.sent.append(("post", node, msg))


def client(node: int, local: bool, nodes: int = 4) -> tuple[DirectoryClient, Recorder]:
    m = Recorder()
    links = Links(MPI.COMM_SELF, (), m, 0, node, tuple(f"n{i}" for i in range(nodes)),
                  tuple(range(nodes)))
    return DirectoryClient(links, Directory() if local else None), m


def keys_homed_at(home: int, nodes: int = 4) -> list[str]:
    return [k for k in (f"k{i}" for i in range(200)) if home_of(k, nodes) == home][:3]


def test_a_request_goes_to_its_keys_home_and_this_ranks_share_answers_here():
    c, m = client(1, local=True)
    mine, theirs = keys_homed_at(1), keys_homed_at(2)
    c.ask(W.DirAdd(mine[:1], 1, [10]))
    assert c.ask(W.DirGet(mine[:1])) == W.Located([[1]]) and m.sent == []  # its own share: no message
    assert c.ask(W.DirGet(theirs[:1])) == W.Located([[2]])
    assert m.sent == [("call", 2, W.DirGet(theirs[:1]))]
    assert c.ask(W.DirDone(theirs[0], 0, 1, W.Outcome.FAILED, 0), post=True) is None
    assert m.sent[-1] == ("post", 2, W.DirDone(theirs[0], 0, 1, W.Outcome.FAILED, 0))


def test_a_rank_without_its_nodes_share_asks_its_leader():
    c, m = client(1, local=False)
    key = keys_homed_at(1)[0]
    c.ask(W.DirCopies(key))
    assert m.sent == [("call", 1, W.DirCopies(key))]


def test_keys_are_grouped_by_home_in_order():
    c, _ = client(0, local=False)
    keys = [f"k{i}" for i in range(50)]
    groups = c.by_home(keys)
    assert sorted(k for ks in groups.values() for k in ks) == sorted(keys)
    for home, ks in groups.items():
        assert all(home_of(k, 4) == home for k in ks) and ks == [k for k in keys if k in ks]
