# The one launch configuration of shmstore's job scripts (sourced by job.sbatch and scaling.sbatch).
#
# SHMSTORE_ROOT: this checkout (sbatch runs a copy of the script from its spool directory, so the scripts
# find the checkout through the installed package, and run from wherever they were submitted).
SHMSTORE_ROOT=${SHMSTORE_ROOT:-$(python -c 'import os, shmstore; print(os.path.dirname(os.path.dirname(os.path.abspath(shmstore.__file__))))')}
export SHMSTORE_ROOT
# Node-local scratch for spill files. Stock Slurm sets TMPDIR=/tmp and no SLURM_TMPDIR: point this at the
# site's node-local disk (its TmpFS= in slurm.conf, /local, /scratch/local, ...), never at a shared file system.
export SHMSTORE_SPILL_DIR=${SHMSTORE_SPILL_DIR:-${SLURM_TMPDIR:-/tmp}}
# Two bulk streams per transfer (MPICH): worth it for large objects; leave unset for latency-bound jobs
# (see mpi/README.md, "Beside the application").
export MPIR_CVAR_CH4_NUM_VCIS=${MPIR_CVAR_CH4_NUM_VCIS:-4}
# mpi4py's tree-based reductions of Python objects hold the GIL while they wait: a node's leader rank inside
# comm.reduce/allreduce of objects would stop serving its node (python -m mpi4py imports MPI before shmstore
# can switch them off). Off: the same results, gathered instead.
export MPI4PY_RC_FAST_REDUCE=${MPI4PY_RC_FAST_REDUCE:-0}
# How every step starts its ranks: --mpi=pmi2 (the pip 'mpich' wheel has no PMIx), -K so that a failed rank
# ends the step.
SHMSTORE_SRUN=(srun --mpi=pmi2 -K)
# The last step of a job, on every node, even after a failure: stores nobody uses any more and their spill
# files go; then the problems the job's spill processes logged (they never hold a step's output pipes, so
# they log to a file beside the spill directory: see README) go into this job's output.
shmstore_cleanup() {
    srun -N "$SLURM_NNODES" -n "$SLURM_NNODES" --ntasks-per-node=1 bash -c 'python -m shmstore gc
        cat "$SHMSTORE_SPILL_DIR"/shmstore-"$(id -u)"-job-"$SLURM_JOB_ID"-*.log 2>/dev/null >&2 || true' || true
}
