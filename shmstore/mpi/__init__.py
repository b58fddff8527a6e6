"""Multi-node shmstore over MPI: :class:`Cluster` (needs the ``mpi`` extra)."""
try:
    from mpi4py import MPI  # noqa: F401  (fail early, with the hint below)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("shmstore.mpi needs mpi4py: pip install 'shmstore[mpi]' (or 'shmstore[mpich]' "
                      "for a self-contained MPICH)") from exc

from .cluster import Cluster
from .poll import quiet_barrier

__all__ = ["Cluster", "quiet_barrier"]
