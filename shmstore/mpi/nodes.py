"""Node identity: which ranks share a node (and its store), and what the node is called.

Ranks are grouped by host (``MPI.Comm.Split_type(COMM_TYPE_SHARED)``) and by
label: ``SHMSTORE_NODE``, else ``PMI_HOSTNAME`` (set by MPICH's hydra, also
for ``-launcher fork -hosts n0:2,n1:2``), else ``SLURMD_NODENAME``, else the
host name. ``SHMSTORE_NODE`` also splits one host into several emulated
nodes (their stores never share memory: the node id is part of the segment
names). The lowest rank of each node is its leader, which runs the node's
service.
"""
from __future__ import annotations

import socket
import warnings
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from ..config import default_node, node_label

__all__ = ["Nodes", "identify", "label"]


@dataclass(frozen=True)
class Nodes:
    """The nodes of a job, as every rank sees them alike."""
    # node names, by node index the leader rank of each node, by node index this rank's node ranks on this rank's host
    # (all its emulated nodes, whatever MPI thinks)
    names: list[str]
    leaders: list[int]
    index: int
    host_ranks: int

    @property
    def name(self) -> str:
        return self.names[self.index]


def label(kwargs: dict[str, Any]) -> str:
    """This rank's node label (see the module's docstring), made safe for segment names."""
    raw = kwargs.get("node") or node_label() or default_node()
    return "".join(c if c.isalnum() or c in "_.-" else "-" for c in str(raw))[:48] or "node"


def identify(comm: MPI.Comm, kwargs: dict[str, Any]) -> Nodes:
    """Group the ranks of ``comm`` into nodes (same host and same label) and name each node; collective."""
    mine = label(kwargs)
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    ranks = comm.allgather((socket.gethostname(), mine, shared.size))
    host_ranks = sum(host == socket.gethostname() for host, _, _ in ranks)
    warn_if_split_per_rank(ranks)
    labels = shared.allgather(mine)
    node_comm = shared.Split(color=sorted(set(labels)).index(mine), key=comm.rank)
    leader = node_comm.allreduce(comm.rank, op=MPI.MIN)
    node_comm.Free()
    shared.Free()
    by_leader = dict(comm.allgather((leader, mine)))
    counts = {lb: list(by_leader.values()).count(lb) for lb in by_leader.values()}
    # two hosts with the same label (or one label on two hosts) still get distinct node ids
    names = {ld: lb if counts[lb] == 1 else f"{lb}-{ld}" for ld, lb in by_leader.items()}
    leaders = sorted(by_leader)
    return Nodes([names[ld] for ld in leaders], leaders, leaders.index(leader), host_ranks)


def warn_if_split_per_rank(ranks: list[tuple[str, str, int]]) -> None:
    """Warn when MPI put every rank in a shared-memory group of its own although several ranks run on one
    host under one node label: each then gets a store of its own, silently."""
    if len(ranks) < 2 or any(size > 1 for _, _, size in ranks):
        return
    seen: dict[tuple[str, str], int] = {}
    for host, lb, _ in ranks:
        seen[(host, lb)] = seen.get((host, lb), 0) + 1
    crowded = [f"{lb!r} on {host} ({n} ranks)" for (host, lb), n in seen.items() if n > 1]
    if crowded:
        warnings.warn(f"MPI puts every rank in its own shared-memory group, but ranks share a host and a node "
                      f"label: {', '.join(crowded[:4])}; each rank gets a store of its own. The launcher's "
                      f"process-to-node mapping does not match the hosts (set SHMSTORE_NODE per node, or launch "
                      f"with the MPI's own mpiexec / srun --mpi=pmi2)", RuntimeWarning, stacklevel=4)
