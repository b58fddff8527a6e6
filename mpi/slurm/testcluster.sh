#!/bin/bash
# A throwaway Slurm cluster of two emulated nodes (n1, n2) on this machine, all state under one directory:
# for CI and for trying the job scripts without a real cluster. Needs the Debian/Ubuntu packages
# slurm-wlm munge slurmd slurmctld slurm-client, and root (slurmd runs jobs as their users).
#
#   mpi/slurm/testcluster.sh start DIR     # then: export SLURM_CONF=DIR/slurm.conf; sbatch ...
#   mpi/slurm/testcluster.sh stop DIR      # stops every daemon by its pid file
#
# TESTNODES=NODES_DIR: on nodes apart (mpi/testnodes started under NODES_DIR, with at least nodes n1 and n2):
# each slurmd runs in its node's namespaces with the node's own address, so job scripts, srun and the epilog
# run per node and see only that node's /dev/shm; slurmctld stays on this host, reached at the bridge's
# address. Jobs that spill should set SHMSTORE_SPILL_DIR=NODES_DIR/local (each node's own scratch).
set -euo pipefail
cmd=${1:?usage: testcluster.sh start|stop DIR}
dir=$(realpath -m "${2:?usage: testcluster.sh start|stop DIR}")
cpus=${TESTCLUSTER_CPUS:-4}   # what each node advertises (a 2-core machine runs 4 ranks per node)
# task/affinity: srun --cpu-bind=cores pins a task to a core, as on real clusters (no binding unless asked)

# slurmstepd processes of this cluster (they run in its log folder), and their tasks: a job still running when
# the cluster stops (a test that failed mid-job) must not outlive it, spinning ranks and holding /dev/shm
steps() {
    for p in /proc/[0-9]*; do
        [ "$(readlink "$p/cwd" 2>/dev/null)" = "$dir/log" ] && [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] \
            && echo "${p#/proc/}"
    done
}
tree() {
    local kid
    for kid in $(cat /proc/"$1"/task/*/children 2>/dev/null); do tree "$kid"; done
    echo "$1"
}

stop() {
    if [ -e "$dir/run/slurmctld.pid" ]; then
        jobs=$(SLURM_CONF="$dir/slurm.conf" timeout 20 squeue -h -o %A 2>/dev/null || true)
        [ -z "$jobs" ] || SLURM_CONF="$dir/slurm.conf" timeout 20 scancel $jobs 2>/dev/null || true
        for _ in $(seq 100); do [ -z "$(steps)" ] && break; sleep 0.1; done
    fi
    for step in $(steps); do
        kill -9 $(tree "$step") 2>/dev/null || true
    done
    for pid in "$dir"/run/*.pid; do
        [ -e "$pid" ] || continue
        kill "$(cat "$pid" 2>/dev/null)" 2>/dev/null || true
    done
    for pid in "$dir"/run/*.pid; do
        [ -e "$pid" ] || continue
        for _ in $(seq 50); do kill -0 "$(cat "$pid" 2>/dev/null)" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$(cat "$pid" 2>/dev/null)" 2>/dev/null || true
        rm -f "$pid"
    done
}

if [ "$cmd" = stop ]; then
    stop
    exit 0
fi

mkdir -p "$dir"/{run,log,state,spool/n1,spool/n2,munge,tmp/n1,tmp/n2}
chmod 700 "$dir/munge"
dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge/munge.key"
munged --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" --pid-file="$dir/run/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed" --force
here=$(cd "$(dirname "$0")" && pwd)
cat > "$dir/epilog.sh" <<EPI
#!/bin/bash
export SHMSTORE_PYTHON=${SHMSTORE_PYTHON:-$(command -v python3)}
exec $here/epilog.sh
EPI
chmod +x "$dir/epilog.sh"
ctld_port=$((16000 + RANDOM % 2000))
ctld_host=localhost addr1=127.0.0.1 addr2=127.0.0.1
if [ -n "${TESTNODES:-}" ]; then
    # shellcheck disable=SC1091
    net=$(. "$TESTNODES/state" && echo "$NET")
    ctld_host="localhost($net.254)" addr1=$(awk '$2 == "n1" {print $1}' "$TESTNODES/hosts")
    addr2=$(awk '$2 == "n2" {print $1}' "$TESTNODES/hosts")
    [ -n "$addr1" ] && [ -n "$addr2" ] || { echo "testcluster: $TESTNODES has no nodes n1 and n2" >&2; exit 1; }
fi
cat > "$dir/slurm.conf" <<CONF
ClusterName=shmstore-ci
SlurmctldHost=$ctld_host
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=${TESTCLUSTER_TASKPLUGIN:-task/affinity}
MpiDefault=pmi2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
InactiveLimit=0
MinJobAge=30
Epilog=$dir/epilog.sh
NodeName=n1 NodeAddr=$addr1 Port=$((ctld_port + 2001)) CPUs=$cpus State=UNKNOWN TmpDisk=1024
NodeName=n2 NodeAddr=$addr2 Port=$((ctld_port + 2002)) CPUs=$cpus State=UNKNOWN TmpDisk=1024
PartitionName=ci Nodes=n1,n2 Default=YES MaxTime=UNLIMITED State=UP OverSubscribe=YES
CONF
export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$SLURM_CONF"
if [ -n "${TESTNODES:-}" ]; then
    "$TESTNODES/bin/testnodes" exec "$TESTNODES" n1 slurmd -f "$SLURM_CONF" -N n1
    "$TESTNODES/bin/testnodes" exec "$TESTNODES" n2 slurmd -f "$SLURM_CONF" -N n2
else
    slurmd -f "$SLURM_CONF" -N n1
    slurmd -f "$SLURM_CONF" -N n2
fi
for _ in $(seq 100); do
    if [ "$(sinfo -h -o '%T' 2>/dev/null | sort -u | tr -d '\n')" = "idle" ]; then
        echo "testcluster: up (SLURM_CONF=$SLURM_CONF)"
        exit 0
    fi
    sleep 0.2
done
echo "testcluster: nodes did not come up:" >&2
sinfo >&2 || true
tail -n 20 "$dir"/log/*.log >&2 || true
stop
exit 1
