"""The communication parts a Cluster's pieces share: its communicators, its messenger, where this rank is.

Built once by :class:`~shmstore.mpi.Cluster` and handed to the directory
client, the fetcher, the service and the remote readers and writers, so that
none of them reaches into the Cluster (or into another piece) for them.
"""
from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI

from .rpc import Messenger

__all__ = ["Links"]


@dataclass(frozen=True)
class Links:
    """This rank's links to the other ranks of a Cluster (immutable; its parts are thread-safe).

    The Cluster owns the communicators and frees them at its collective close; whoever holds a Links only
    uses them.
    """
    # the private duplicate of the job's communicator: control messages bulk frames, one communicator per stream calls
    # to node services, with their deadline this rank in ``comm`` this rank's node index node names, by node index the
    # leader rank (its service's) of each node, by node index
    comm: MPI.Comm
    bulk: tuple[MPI.Comm, ...]
    messenger: Messenger
    rank: int
    node: int
    nodes: tuple[str, ...]
    leaders: tuple[int, ...]

    @property
    def name(self) -> str:
        """This rank's node's name."""
        return self.nodes[self.node]

    @property
    def leader(self) -> bool:
        """Whether this rank leads its node (runs its service and keeps its share of the directory)."""
        return self.rank == self.leaders[self.node]
