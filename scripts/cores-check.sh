#!/usr/bin/env bash
# The figures that need a core per process, on a machine that has them (the GPU test machine has 16): every
# process of the benchmark on a core of its own, where this project's 2-core VMs time-share 4 ranks, 2 spill
# processes and 2 node services. One command of at most CORES_CHECK_BUDGET = 290 s; each step under its own
# timeout within it, its output appended to one log as it comes, so that an outer kill loses nothing done.
#
#   scripts/cores-check.sh              # after scripts/gpu-check.sh (its .venv-gpu: mpich, mpi4py, shmstore)
#   CORES_CHECK_BUDGET=200 scripts/cores-check.sh
#   CORES_CHECK_STEPS=ckpt-1proc,latency scripts/cores-check.sh    # some steps
#
# Steps (two emulated nodes sharing the host's /dev/shm, `mpiexec -launcher fork -hosts n0:..,n1:..`):
#   ckpt-128      scripts/bench_checkpoint_mpi.py, 4 ranks on 2 nodes, 128 MiB per rank (256 MiB per node),
#                 medians of 5: blocked time against np.copyto and torch.save + fsync (issue 34)
#   ckpt-256      the same at 256 MiB per rank (512 MiB per node), medians of 3, where /dev/shm has 8 GiB free
#   ckpt-1proc    scripts/bench_checkpoint.py, one process, 256 MiB in 1,000 arrays, medians of 3: the background
#                 flush against a plain write + fsync of the same bytes, numpy compute beside the flush against
#                 alone, restore from the folder against a plain read and torch.load (issue 34)
#   latency       scripts/bench_latency.py, 2 ranks on 2 nodes: a 64 B get after 1 s and 10 s of silence, 300
#                 back to back, a 1 MiB get, the holder asleep / computing / in a barrier (issue 36)
#   link          scripts/bench_link.py: 1 MiB, 128 MiB and 1 GiB fetches against raw Send/Recv, a 1,000-array
#                 state dict against one buffer, 64 B gets against the raw round trip (issue 36)
# Output: $OUT/cores-check.log where OUT is set (else cores-check-out/).
set -uo pipefail  # never -e: a failed step must not stop the ones after it
cd "$(dirname "$0")/.."
ROOT=$PWD
OUTDIR=${OUT:-$ROOT/cores-check-out}
LOG=$OUTDIR/cores-check.log
BUDGET=${CORES_CHECK_BUDGET:-290}
DEADLINE=$(( $(date +%s) + BUDGET ))
mkdir -p "$OUTDIR" || exit 1
[ -f .venv-gpu/bin/activate ] && . .venv-gpu/bin/activate
P=python
command -v python >/dev/null 2>&1 || P=python3
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
# the checkpoints' folder on the machine's own disk, not /dev/shm
CKDIR=$(mktemp -d "${TMPDIR:-/var/tmp}/cores-check.XXXXXX")
trap 'rm -rf "$CKDIR"' EXIT

say() { echo "$*" | tee -a "$LOG"; }
STEPS=${CORES_CHECK_STEPS:-ckpt-128,ckpt-256,ckpt-1proc,latency,link}
step() {  # step NAME TIMEOUT CMD...: run CMD under its timeout (cut to what the budget has left), log it
    local name=$1 limit=$2 left rc t0
    shift 2
    [[ ",$STEPS," == *",$name,"* ]] || return 0
    left=$(( DEADLINE - $(date +%s) ))
    if (( left < 15 )); then say "==== $name: NOT RUN (the budget of $BUDGET s is spent)"; return; fi
    (( limit > left )) && limit=$left
    say "==== $name (timeout $limit s): $*"
    t0=$(date +%s)
    MPIEXEC_TIMEOUT=$(( limit > 10 ? limit - 5 : limit )) timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    say "==== $name: exit $rc in $(( $(date +%s) - t0 )) s"
}

: >"$LOG"
say "cores-check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
    "host $(uname -n) cpus $(nproc) python $($P -c 'import sys; print(sys.version.split()[0])')"
say "$(df -h /dev/shm "$CKDIR" | sed 's/^/df: /')"
SHM_FREE_MIB=$(df -Pm /dev/shm | awk 'NR == 2 {print $4}')
M4=(mpiexec -launcher fork -hosts n0:2,n1:2 -n 4 "$P" -m mpi4py)
M2=(mpiexec -launcher fork -hosts n0:1,n1:1 -n 2 "$P" -m mpi4py)
step ckpt-128 75 "${M4[@]}" scripts/bench_checkpoint_mpi.py --mib 128 --repeats 5 --dir "$CKDIR"
if (( ${SHM_FREE_MIB:-0} >= 8192 )) || [[ ",$STEPS," != *",ckpt-256,"* ]]; then
    step ckpt-256 75 "${M4[@]}" scripts/bench_checkpoint_mpi.py --mib 256 --repeats 3 --dir "$CKDIR"
else
    say "==== ckpt-256: NOT RUN (/dev/shm has ${SHM_FREE_MIB:-0} MiB free, under 8192)"
fi
step ckpt-1proc 75 "$P" scripts/bench_checkpoint.py --mib 256 --repeats 3 --dir "$CKDIR"
step latency 100 "${M2[@]}" scripts/bench_latency.py --silence 1,10 --repeats 2
step link 45 "${M2[@]}" scripts/bench_link.py
say "cores-check: done in $(( $(date +%s) - DEADLINE + BUDGET )) s"
