"""Multi-node shmstore over MPI: :class:`Cluster` (needs the ``mpi`` extra)."""
import sys

try:
    import mpi4py
    if "mpi4py.MPI" not in sys.modules:
        # mpi4py's tree-based reductions of Python objects (comm.reduce/allreduce of objects) hold the GIL while
        # they wait: a node leader inside one would serve nobody (see rpc.gil_hint). Where the application
        # imported MPI first, MPI4PY_RC_FAST_REDUCE=0 does the same (mpi/slurm/launch.sh sets it).
        mpi4py.rc.fast_reduce = False
    from mpi4py import MPI  # noqa: F401  (fail early, with the hint below)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("shmstore.mpi needs mpi4py: pip install 'shmstore[mpi]' (or 'shmstore[mpich]' "
                      "for a self-contained MPICH)") from exc

from .cluster import Cluster
from .poll import quiet_barrier

__all__ = ["Cluster", "quiet_barrier"]
