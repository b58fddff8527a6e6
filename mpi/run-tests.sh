#!/usr/bin/env bash
# Run the MPI tests for real: 4 ranks on two emulated nodes, n0 and n1.
#
# MPICH's hydra with the fork launcher and fake host names runs every rank on
# this machine but tells each one its host (PMI_HOSTNAME), so MPI and shmstore
# both see two nodes. `python -m mpi4py` makes an uncaught exception on one
# rank abort the whole job instead of hanging it.
#
#   NP=8 HOSTS=n0:4,n1:4 mpi/run-tests.sh -k migrate     # more ranks, a subset
#
# TESTNODES=DIR: on the nodes that mpi/testnodes started under DIR instead (nodes apart: own network,
# /dev/shm and host name each; MPI between them over TCP), e.g.
#
#   mpi/testnodes start /tmp/nodes 2 && TESTNODES=/tmp/nodes mpi/run-tests.sh; mpi/testnodes stop /tmp/nodes
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-4}
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-400}  # hydra kills the job after this many seconds
HOSTS=${HOSTS:-n0:2,n1:2}
# several VCIs: transfers run over two streams, as in the README's commands
export MPIR_CVAR_CH4_NUM_VCIS=${MPIR_CVAR_CH4_NUM_VCIS:-4}
export MPI4PY_RC_FAST_REDUCE=${MPI4PY_RC_FAST_REDUCE:-0}  # see mpi/slurm/launch.sh
if [ -n "${TESTNODES:-}" ]; then
    exec mpi/testnodes exec "$TESTNODES" n0 mpiexec -launcher ssh -launcher-exec "$TESTNODES/bin/launch" \
        -hosts "$HOSTS" -n "$NP" python -m mpi4py -m pytest -q -p no:cacheprovider tests/mpi/ranks "$@"
fi
exec mpiexec -launcher fork -hosts "$HOSTS" -n "$NP" \
    python -m mpi4py -m pytest -q -p no:cacheprovider tests/mpi/ranks "$@"
