#!/bin/bash
# A Slurm epilog (runs as root on every node of a job when it ends, also after scancel or a time limit):
# removes the job user's stores that nobody uses any more, with their spill files. Point Epilog= in
# slurm.conf at a copy of this file; SHMSTORE_PYTHON must name an interpreter with shmstore installed.
# It never fails: a failing epilog drains the node.
PYTHON=${SHMSTORE_PYTHON:-python3}
"$PYTHON" -m shmstore gc --uid "${SLURM_JOB_UID:-0}" --json || true
exit 0
