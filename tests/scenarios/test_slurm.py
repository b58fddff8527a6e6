"""Slurm for real: a throwaway cluster of two emulated nodes (mpi/slurm/testcluster.sh), the quick scaling
job and a job scancelled mid-transfer, submitted with sbatch and checked afterwards.

Every test runs twice: ``shared``, both slurmds on this host (one /dev/shm, one network), and ``apart``, each
slurmd in its own node's namespaces (mpi/testnodes: own /dev/shm, scratch, host name and address; MPI
between the nodes over TCP), where the job scripts, srun and the epilog of a node see only that node.

Needs Slurm's daemons (Debian: ``slurm-wlm munge``; ``.ci/run`` installs them) and root (``apart``: and
namespaces); skips with the reason otherwise.
"""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import time

import pytest

from helpers import ROOT, hand_over, wait_for

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(
    not (shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("munged") and shutil.which("sbatch"))
    or os.getuid() != 0, reason="no Slurm here (apt-get install slurm-wlm munge, as root; .ci/run does)"),
    pytest.mark.slow]
BIN = os.path.dirname(sys.executable)


class Slurm(dict):
    """The cluster's environment (SLURM_CONF, PATH with this interpreter first), and where its nodes keep
    their shared memory and scratch."""

    def __init__(self, env: dict[str, str], nodes: str | None) -> None:
        super().__init__(env)
        self.nodes = nodes  # the mpi/testnodes folder (apart), or None (shared)

    def shm(self, node: str) -> str:
        """The /dev/shm that node ``node``'s processes see."""
        if self.nodes is None:
            return "/dev/shm"
        with open(os.path.join(self.nodes, "nodes", node, "pid")) as f:
            return f"/proc/{f.read().strip()}/root/dev/shm"

    def spill(self, tmp_path) -> tuple[str, list[str]]:
        """The SHMSTORE_SPILL_DIR to give a job, and the folders behind it (one per node apart)."""
        if self.nodes is None:
            spill = tmp_path / "spill"
            spill.mkdir()
            return str(spill), [str(spill)]
        return os.path.join(self.nodes, "local"), [os.path.join(self.nodes, "nodes", n, "scratch")
                                                   for n in ("n1", "n2")]

    def segments(self, pattern: str) -> list[str]:
        """Entries of any node's /dev/shm (this host's too) whose name holds ``pattern``."""
        dirs = dict.fromkeys(["/dev/shm", self.shm("n1"), self.shm("n2")])
        return [os.path.join(d, e) for d in dirs for e in os.listdir(d) if pattern in e]


@pytest.fixture(scope="module", params=["shared", "apart"])
def slurm(request, tmp_path_factory):
    """The cluster (see :class:`Slurm`); stopped at the end, and its nodes apart with it."""
    d = str(tmp_path_factory.mktemp("slurm"))
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""), PYTHONPATH=ROOT,
               SLURM_CONF=os.path.join(d, "slurm.conf"), SHMSTORE_PYTHON=sys.executable)
    for var in [v for v in env if v.startswith(("SLURM_JOB", "SLURM_NNODES", "SHMSTORE_NODE"))]:
        env.pop(var)
    testnodes = os.path.join(ROOT, "mpi", "testnodes")
    nodes = None
    if request.param == "apart":
        r = subprocess.run(["unshare", "--net", "--mount", "--uts", "true"], capture_output=True, text=True)
        if r.returncode or not (shutil.which("nsenter") and shutil.which("ip") and shutil.which("tc")):
            pytest.skip(f"no namespaces here for nodes apart ({r.stderr.strip() or 'no nsenter, ip or tc'})")
        nodes = str(tmp_path_factory.mktemp("nodes"))
        r = subprocess.run([testnodes, "start", nodes, "3", "--owner", str(os.getpid())], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        # MPI between the nodes over TCP (as on every node apart: mpi/testnodes), one VCI
        env.update(TESTNODES=nodes, UCX_TLS="tcp,self", UCX_NET_DEVICES="eth0", MPIR_CVAR_CH4_NUM_VCIS="1")
    script = os.path.join(ROOT, "mpi", "slurm", "testcluster.sh")
    r = subprocess.run(["bash", script, "start", d], env=env, capture_output=True, text=True, timeout=120)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        yield Slurm(env, nodes)
    finally:
        subprocess.run(["bash", script, "stop", d], env=env, capture_output=True, timeout=60)
        if nodes is not None:
            r = subprocess.run([testnodes, "stop", nodes], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr


def sbatch(env: dict[str, str], *args: str) -> str:
    r = subprocess.run(["sbatch", "--parsable", *args], env=env, capture_output=True, text=True, timeout=30,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def running(env: dict[str, str], job: str) -> bool:
    r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
    return bool(r.stdout.strip())


def leftovers(slurm: Slurm, job: str, spill_dirs: list[str]) -> list[str]:
    """Whatever job ``job`` left on any node: store segments, semaphores, spill files, spill processes."""
    left = slurm.segments(f"-job-{job}-")
    left += [os.path.join(r, f) for d in spill_dirs for r, _, fs in os.walk(d) for f in fs]
    r = subprocess.run(["pgrep", "-af", f"shmstore.spill --name job-{job} "], capture_output=True, text=True)
    return left + r.stdout.split("\n")[:-1]


@pytest.mark.timeout(300)
def test_quick_scaling_job_writes_its_csv_and_plots_and_leaves_nothing(slurm, tmp_path):
    out = tmp_path / "results"
    spill, spill_dirs = slurm.spill(tmp_path)
    env = dict(slurm, SCALING_OUT=str(out), SHMSTORE_SPILL_DIR=spill)
    job = sbatch(env, "-N", "2", "--ntasks-per-node=2", "-o", str(tmp_path / "job.out"),
                 os.path.join(ROOT, "mpi", "slurm", "scaling.sbatch"), "--quick")
    assert wait_for(lambda: not running(env, job), timeout=240), (tmp_path / "job.out").read_text()[-3000:]
    log = (tmp_path / "job.out").read_text()
    assert "rows in" in log, log[-3000:]
    with open(out / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["nodes"] for r in rows} == {"1", "2"}, log[-2000:]  # real nodes from the allocation
    assert {"fetch_bw", "remote_get_lat", "broadcast", "local_put_ops", "spill_bw"} <= {r["workload"] for r in rows}
    assert all(float(r["value"]) > 0 and float(r["baseline_value"]) > 0 for r in rows)
    try:
        import matplotlib  # noqa: F401
        for png in ("throughput_vs_ranks", "bandwidth_vs_size", "latency_vs_nodes", "messages_vs_nodes",
                    "broadcast_vs_nodes"):
            assert (out / f"{png}.png").stat().st_size > 10_000
    except ImportError:
        assert "no matplotlib" in log
    assert wait_for(lambda: not leftovers(slurm, job, spill_dirs), timeout=30), leftovers(slurm, job, spill_dirs)


@pytest.mark.timeout(300)
def test_job_cancelled_mid_transfer_leaves_no_store_spill_file_or_process(slurm, tmp_path):
    spill, spill_dirs = slurm.spill(tmp_path)
    env = dict(slurm, SHMSTORE_SPILL_DIR=spill)
    log = tmp_path / "job.out"
    job = sbatch(env, "-N", "2", "--ntasks-per-node=2", "-o", str(log), "--wrap",
                 f"srun --mpi=pmi2 -K {sys.executable} -m mpi4py {ROOT}/tests/mpi/jobs/transfer_loop.py")
    assert wait_for(lambda: log.exists() and "transferring" in log.read_text(), timeout=120), \
        log.read_text()[-3000:] if log.exists() else "no output"
    # one store per node, named by the job (apart: each in its own node's /dev/shm, and only there)
    assert [s for s in os.listdir(slurm.shm("n1")) if f"-job-{job}-n1-" in s]
    assert [s for s in os.listdir(slurm.shm("n2")) if f"-job-{job}-n2-" in s]
    if slurm.nodes is not None:
        assert not [s for s in os.listdir(slurm.shm("n1")) if f"-job-{job}-n2-" in s]
        assert not [s for s in os.listdir("/dev/shm") if f"-job-{job}-" in s]
    time.sleep(0.3)  # well inside the transfer loop
    subprocess.run(["scancel", job], env=env, check=True, timeout=30)
    assert wait_for(lambda: not running(env, job), timeout=60)
    assert wait_for(lambda: not leftovers(slurm, job, spill_dirs), timeout=30), leftovers(slurm, job, spill_dirs)


@pytest.fixture
def job_user():
    """A throwaway user whose job this is: the epilog's gc (every stale store of the job's user) then touches
    nothing but what this test made, though other test runs may keep dead stores of root on this machine."""
    import pwd
    import uuid
    login = "shmep" + uuid.uuid4().hex[:8]
    r = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", login],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"useradd failed: {r.stderr.strip()}")
    try:
        yield pwd.getpwnam(login).pw_uid
    finally:
        subprocess.run(["userdel", login], capture_output=True)


def _nodes_idle(env: dict[str, str]) -> bool:
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
    return r.stdout.split() == ["idle"]


@pytest.mark.timeout(300)
def test_epilog_ends_within_seconds_beside_a_fifo_a_socket_and_garbage_under_the_store_prefix(slurm, tmp_path,
                                                                                             job_user):
    """Regression (issue 19): `mkfifo /dev/shm/shmstore-<uid>-x-n-meta` by any user of the node hung the epilog's
    `shmstore gc` forever (Slurm sets no epilog timeout): the node stayed completing. Here the job's store names
    on both nodes hold a FIFO, a socket and garbage, and a dead store of the job's user waits to be removed."""
    import socket
    uid = job_user
    job = sbatch(slurm, "-H", f"--uid={uid}", f"--gid={uid}", "-N", "2", "-o", "/dev/null", "--wrap", "sleep 1")
    n1, n2 = slurm.shm("n1"), slurm.shm("n2")
    planted = [f"{n1}/shmstore-{uid}-job-{job}-n1-meta", f"{n2}/shmstore-{uid}-job-{job}-n2-meta",
               f"{n1}/shmstore-{uid}-job-{job}x-n1-meta"]
    dead = f"job{job}dead"
    try:
        os.mkfifo(planted[0])
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(planted[1])
        with open(planted[2], "wb") as f:
            f.write(os.urandom(8192))
        for p in planted:
            os.lchown(p, uid, uid)
        hand_over(dead, str(tmp_path), uid)
        if n1 != "/dev/shm":  # apart: the dead store is node n1's (its spill folder stays where n1 sees it)
            for seg in [s for s in os.listdir("/dev/shm") if f"-{dead}-" in s]:
                shutil.copy2(os.path.join("/dev/shm", seg), os.path.join(n1, seg))
                os.chown(os.path.join(n1, seg), uid, uid)
                os.unlink(os.path.join("/dev/shm", seg))
        subprocess.run(["scontrol", "release", job], env=slurm, check=True, timeout=30)
        assert wait_for(lambda: not running(slurm, job), timeout=60)
        t0 = time.monotonic()
        assert wait_for(lambda: _nodes_idle(slurm), timeout=30), "the epilog hangs: nodes stay completing"
        assert time.monotonic() - t0 < 15
        assert wait_for(lambda: not slurm.segments(f"-{dead}-"), timeout=10)
        assert not os.listdir(tmp_path)
        assert all(os.path.lexists(p) for p in planted)  # not the epilog's to remove
    finally:
        for p in planted:
            if os.path.lexists(p):
                os.unlink(p)
        for s in slurm.segments(f"-{dead}-"):
            os.unlink(s)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launch", ["job.sbatch", "plain srun"])
def test_a_job_whose_rank_raises_ends_long_before_its_time_limit_with_the_traceback(slurm, tmp_path, launch):
    """Issue 19: a rank raising inside ``with Cluster()`` while the others fetch from its node or ask the
    directory kept the job until Slurm cancelled it at its time limit, the traceback never printed. Under
    the project's job.sbatch (``srun -K python -m mpi4py``) and under plain ``srun`` with a plain ``python``
    script, the job ends within seconds of the raise, its output holds the traceback, and neither node keeps
    a store segment, spill file or spill process of the job, nor MPI's shared memory once the epilog ran."""
    spill, spill_dirs = slurm.spill(tmp_path)
    env = dict(slurm, SHMSTORE_SPILL_DIR=spill)
    log = tmp_path / "job.out"
    script = os.path.join(ROOT, "tests", "mpi", "jobs", "raise_in_cluster.py")
    mpich = set(slurm.segments("mpich_"))
    how = [os.path.join(ROOT, "mpi", "slurm", "job.sbatch"), script, "-", "leader", "get"] \
        if launch == "job.sbatch" else ["--wrap", f"srun --mpi=pmi2 {sys.executable} {script} - leader get"]
    start = time.monotonic()
    job = sbatch(env, "-N", "2", "--ntasks-per-node=2", "--time=5", "-o", str(log), *how)
    assert wait_for(lambda: not running(env, job), timeout=120), log.read_text()[-3000:] if log.exists() else ""
    took = time.monotonic() - start
    out = log.read_text()
    assert "raising on rank 0" in out, out[-3000:]
    assert took < 60, f"{took:.0f} s (the time limit is 5 minutes):\n{out[-3000:]}"
    assert "Traceback (most recent call last)" in out and "RuntimeError: boom from rank 0" in out, out[-3000:]
    assert "DUE TO TIME LIMIT" not in out, out[-3000:]
    assert wait_for(lambda: not leftovers(slurm, job, spill_dirs), timeout=30), leftovers(slurm, job, spill_dirs)
    # nor MPICH's own shared memory (issue 35 item 8): the epilog's gc waits for the aborted job's segments, seconds
    # old when it runs, to come of age (it left 2 x 32 MiB of them on a node before)
    assert wait_for(lambda: not mpi_orphans(slurm, mpich), timeout=30), mpi_orphans(slurm, mpich)


def mpi_orphans(slurm: Slurm, before: set[str]) -> list[str]:
    """MPICH's shared memory segments on any node that appeared since ``before`` and that no live process maps
    or holds open: what an aborted job left (another job's, live, are not)."""
    from shmstore.stores import _in_use
    idents = {}
    for path in set(slurm.segments("mpich_")) - before:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        idents[path] = (st.st_dev, st.st_ino)
    used = _in_use({os.path.basename(p): ident for p, ident in idents.items()})
    return sorted(p for p in idents if os.path.basename(p) not in used)


@pytest.mark.timeout(300)
def test_ranks_pinned_to_a_core_each_leave_the_spill_process_the_nodes_cpus(slurm, tmp_path):
    """Issue 35 item 5 under Slurm: ``srun --cpu-bind=cores`` pins each rank to one core (the test cluster runs
    task/affinity); the spill process a rank starts runs on the node's CPUs, not on that rank's core, and the
    job's puts of four times the memory level all spill and read back."""
    spill, _ = slurm.spill(tmp_path)
    env = dict(slurm, SHMSTORE_SPILL_DIR=spill)
    log = tmp_path / "job.out"
    script = os.path.join(ROOT, "tests", "mpi", "jobs", "pinned_spill.py")
    job = sbatch(env, "-N", "2", "--ntasks-per-node=2", "--time=5", "-o", str(log), "--wrap",
                 f"srun --mpi=pmi2 --cpu-bind=cores {sys.executable} -m mpi4py {script}; "
                 f"srun -N 2 -n 2 --ntasks-per-node=1 {sys.executable} -m shmstore gc")
    assert wait_for(lambda: not running(env, job), timeout=240), log.read_text()[-3000:] if log.exists() else ""
    out = log.read_text()
    results = [line.split() for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 4, out[-3000:]
    for _, _, rank, _, mine, _, spill_cpus, ok in results:
        assert ok == "ok" and "," not in mine and "-" not in mine, (rank, mine, out[-2000:])  # pinned: one CPU
        assert spill_cpus != mine and ("-" in spill_cpus or "," in spill_cpus), (rank, mine, spill_cpus)


def _scancel_usr1(env: dict[str, str], job: str) -> None:
    """What ``#SBATCH --signal=B:USR1@60`` does sixty seconds before the time limit: SIGUSR1 to the batch shell."""
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)


@pytest.mark.timeout(300)
def test_a_job_warned_of_its_time_limit_checkpoints_and_a_dependent_job_goes_on_from_it(slurm, tmp_path):
    """Issue 34, Slurm (a): checkpoint.sbatch checkpoints every 25 steps; Slurm's warning signal (USR1 to the
    batch shell) makes the ranks checkpoint at once, wait for it and exit 0; a job submitted with
    --dependency=afterany restores that checkpoint from the folder (the first job's stores are gone), checks
    every value and goes on."""
    spill, spill_dirs = slurm.spill(tmp_path)
    env = dict(slurm, SHMSTORE_SPILL_DIR=spill, SHMSTORE_PERSIST_DIR=str(tmp_path / "persist"))
    first, second = tmp_path / "first.out", tmp_path / "second.out"
    script = os.path.join(ROOT, "mpi", "slurm", "checkpoint.sbatch")
    job = sbatch(env, "-N", "2", "--ntasks-per-node=2", "-o", str(first), script, "--steps", "100000",
                 "--every", "25", "--step-seconds", "0.01")
    assert wait_for(lambda: first.exists() and "step 50: checkpoint" in first.read_text(), timeout=120), \
        first.read_text()[-3000:] if first.exists() else "no output"
    _scancel_usr1(env, job)
    after = sbatch(env, f"--dependency=afterany:{job}", "-N", "2", "--ntasks-per-node=2", "-o", str(second),
                   script, "--steps", "10", "--every", "5", "--expect", "folder")
    assert wait_for(lambda: not running(env, job) and not running(env, after), timeout=200), \
        first.read_text()[-2000:] + (second.read_text()[-2000:] if second.exists() else "")
    out1, out2 = first.read_text(), second.read_text()
    assert "SIGUSR1: the time limit is near" in out1 and "checkpointed, exiting" in out1, out1[-3000:]
    stopped = [ln for ln in out1.splitlines() if "checkpointed, exiting" in ln][0]
    at = int(stopped.split()[1].rstrip(":"))
    assert f"restored 'step{at}' at step {at}" in out2 and "'folder'" in out2, out2[-3000:]
    assert f"done at step {at + 10}" in out2, out2[-3000:]
    for job_id in (job, after):
        assert wait_for(lambda j=job_id: not leftovers(slurm, j, spill_dirs), timeout=30), \
            leftovers(slurm, job_id, spill_dirs)


@pytest.mark.timeout(300)
def test_a_failed_step_is_restored_from_the_nodes_memory_by_the_next_step(slurm, tmp_path):
    """Issue 34, Slurm (b): in one allocation, a step fails after its checkpoint of step 20 completed; the
    next srun step restores it from the nodes' persistent stores (its own node's copy, or the partner's),
    reading nothing from the folder, checks every value and goes on; the job's last steps remove the stores."""
    spill, spill_dirs = slurm.spill(tmp_path)
    env = dict(slurm, SHMSTORE_SPILL_DIR=spill, SHMSTORE_PERSIST_DIR=str(tmp_path / "persist"))
    log = tmp_path / "job.out"
    job = sbatch(env, "-N", "2", "--ntasks-per-node=2", "-o", str(log),
                 os.path.join(ROOT, "mpi", "slurm", "checkpoint-retry.sbatch"), "--step-seconds", "0.01")
    assert wait_for(lambda: not running(env, job), timeout=200), log.read_text()[-3000:] if log.exists() else ""
    out = log.read_text()
    assert "failing on purpose after the checkpoint of step 20" in out, out[-3000:]
    assert "restored 'step20' at step 20" in out and "'folder'" not in out, out[-3000:]
    assert "done at step 30" in out, out[-3000:]
    assert wait_for(lambda: not leftovers(slurm, job, spill_dirs), timeout=30), leftovers(slurm, job, spill_dirs)
