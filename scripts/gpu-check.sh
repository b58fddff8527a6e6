#!/usr/bin/env bash
# The GPU checks, in one go, on a machine with a CUDA device: one command of at most 7 minutes. The steps share a
# budget of GPU_CHECK_BUDGET = 380 s (a step still running when it is spent is stopped; one with under 20 s left is
# NOT RUN), each step has its own timeout within it, and the archive and summary are written after every step, so
# that an outer kill loses nothing already done. Expected on an H200: 3 to 4 minutes.
#
#   scripts/gpu-check.sh                  # offline where .whl/ holds wheels, else online
#   scripts/gpu-check.sh --offline        # or --online: the install mode, whatever .whl/ holds
#   scripts/gpu-check.sh --plan           # print the mode and every command it would run; run nothing
#   scripts/gpu-check.sh --only conformance,mpi-full-levels   # again, some steps, in the venv made before
#   scripts/gpu-check.sh --no-install --only env               # with the python on PATH, no venv
#
# From a networked machine: scripts/gpu-wheels.sh once (fills the git-ignored .whl/, 13 MB), then send the
# checkout with .whl/ to the GPU machine (a device command there carries .whl/ as an ignored path) and run
# `bash scripts/gpu-check.sh` there with a timeout of 420 s (OUT set by the device command: the two outputs
# come back from it). Without a device, scripts/gpu-check-rehearse.sh runs the same on the tests' CuPy stand-in
# from a venv standing in for the image (about 80 s on 2 cores).
#
# The image's python (python3, or GPU_CHECK_PYTHON) may itself be a virtual environment, as on the GPU test
# machine (its venv holds CuPy cupy-cuda13x, torch, numpy, mpi4py, pytest, pytest-timeout, setuptools, wheel,
# cloudpickle). A venv made from a venv with --system-site-packages sees only the base interpreter's
# site-packages, so the check's venv .venv-gpu gets a .pth (_gpu_check_parent.pth) that calls site.addsitedir on
# each site-packages folder of the image's venv, as that interpreter names them (its own .pth files run too);
# it comes after .venv-gpu's own site-packages, so what is installed there (mpich) wins.
#
# Install, offline (no package index): that venv, with --system-site-packages (the image's CuPy as it is: a
# second CuPy beside it conflicts, so no GPU extra and no CuPy wheel ever) and --without-pip where the image has
# pip; the wheels of .whl/ (posix_ipc, mpich: scripts/gpu-wheels.sh downloads them on a networked machine) with
# --no-index --no-deps --ignore-installed (into .venv-gpu even where the image has them: mpich's libmpi and
# mpiexec must be in the venv, where mpi4py and PATH find them), then the project with --no-index --no-deps
# --no-build-isolation -e . (the C helpers are optional: without a compiler shmstore runs on its pure-Python
# kernel), no extras.
# Online (a networked machine): the same venv and .pth; CuPy from the gpu12/gpu13 extra that matches the
# driver's CUDA version, unless a CuPy is importable already; mpich; pytest and pytest-timeout.
#
# The real CuPy only: SHMSTORE_FAKE_CUPY is set empty for the check unless given (the tests' CuPy stand-in,
# tests/fakecuda, is never used behind its back where CuPy finds no device: the GPU tests then skip and the
# steps say NO GPU). Given a path (a rehearsal without a device), every step runs on the stand-in, and the
# summary says so.
#
# Steps, in this order (device tests first, benchmarks last), each with its own timeout (s) and log, each
# outcome printed even when one before it failed:
#   install          90   as above
#   env              45   the device, CuPy, mpi4py and its MPI library, numpy and pytest (from where), the C
#                         helpers, free /dev/shm (also asked before it: the benchmarks' size)
#   device-tests     180  tests/levels/test_gpu.py (the gpu marker included; 60-90 s on a cold device)
#   conformance      100  the level conformance suite on Level.GPU (tests/levels/test_conformance.py -k gpu)
#   mpi-full-levels  90   two emulated nodes fetching from each other while both GPU levels are full
#                         (tests/mpi/ranks/test_full_levels.py; a deadlock ends in TransferError after 30 s)
#   cuda-aware       30   whether MPI takes device buffers (else transfers are staged through host memory): a
#                         probe, PASS either way (the pip mpich says False)
#   bench-gpu        60   device put against a raw CuPy copy, get, get from a second process through CUDA IPC
#   bench-gpu-mpi    75   a device fetch between two ranks of two emulated nodes against raw mpi4py Send/Recv
#   sweep            90   small-op rates of 1, 2, 4, 8 and 16 processes at once (scripts/bench_local.py --sweep)
# The benchmarks' stores take up to 2.5 GiB of /dev/shm at full size (2.1 GiB measured: two 1 GiB prefaulted
# stores at once in bench-gpu-mpi): with under 3 GiB free there they run sized down (64 MiB objects, SHMSTORE_PREFAULT=64MiB,
# smaller sweep arrays: about 0.3 GiB), and the summary says so (GPU_CHECK_SHM_WANT_MIB: the threshold, in MiB).
#
# Writes two files: $OUT/gpu-check-summary.txt where OUT is set (else gpu-check-out/), the outcome of every
# step, and beside it $OUT/gpu-check-logs.tar.gz, every step's log (gpu-check-logs/<step>.log, the sweep's
# bench_local.json). Exit status 0 only if every step passed (on the stand-in where SHMSTORE_FAKE_CUPY names
# one: the summary's overall line says which).
set -uo pipefail  # never -e: a failed step must not stop the ones after it
cd "$(dirname "$0")/.."
ROOT=$PWD

MODE="" PLAN=0 INSTALL=1 ONLY=""
while (( $# )); do
    case $1 in
        --offline) MODE=offline;;
        --online) MODE=online;;
        --plan|--dry-run) PLAN=1;;
        --no-install) INSTALL=0;;
        --only) ONLY=${2:-}; shift;;
        --only=*) ONLY=${1#--only=};;
        -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0;;
        *) echo "gpu-check: unknown option $1 (see --help)" >&2; exit 2;;
    esac
    shift
done

WHEELS=${GPU_CHECK_WHEELS:-.whl}
VENV=${GPU_CHECK_VENV:-.venv-gpu}
PY=${GPU_CHECK_PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-380}
OUTDIR=${OUT:-$ROOT/gpu-check-out}
SUMMARY=$OUTDIR/gpu-check-summary.txt
ARCHIVE=$OUTDIR/gpu-check-logs.tar.gz
STEPS="install env device-tests conformance mpi-full-levels cuda-aware bench-gpu bench-gpu-mpi sweep"
SHM_WANT_MIB=${GPU_CHECK_SHM_WANT_MIB:-3072}  # the benchmarks at full size: about 2.5 GiB of /dev/shm, and a margin
for s in ${ONLY//,/ }; do
    [[ " $STEPS " == *" $s "* ]] || { echo "gpu-check: no step $s (steps: $STEPS)" >&2; exit 2; }
done
export SHMSTORE_FAKE_CUPY=${SHMSTORE_FAKE_CUPY-}  # the real CuPy unless a stand-in is named (see above)

# ---- the install mode and its commands -------------------------------------------------------------------
wheel_files=()
if [ -d "$WHEELS" ]; then
    for w in "$WHEELS"/*.whl; do [ -e "$w" ] && wheel_files+=("$w"); done
fi
if [ -z "$MODE" ]; then
    if (( ${#wheel_files[@]} )); then MODE=offline; WHY="$WHEELS/ holds ${#wheel_files[@]} wheel(s)"
    else MODE=online; WHY="no wheels in $WHEELS/"; fi
else
    WHY="--$MODE"
fi

install_wheels=() notes=()
for w in "${wheel_files[@]}"; do
    case $(basename "$w" | tr 'A-Z' 'a-z') in
        cupy*) notes+=("left out $(basename "$w"): the image's own CuPy is used, a second one conflicts");;
        *) install_wheels+=("$w");;
    esac
done
if [ "$MODE" = offline ]; then
    for need in posix_ipc mpich; do
        found=0
        for w in "${install_wheels[@]}"; do [[ $(basename "$w") == "$need"-* ]] && found=1; done
        (( found )) || notes+=("no $need wheel in $WHEELS/: run scripts/gpu-wheels.sh on a networked machine and carry $WHEELS/")
    done
fi

cuda_major() {  # the driver's CUDA major version (nvidia-smi's "CUDA Version: 13.0"), 12 where none is said
    local v
    v=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\).*/\1/p' | head -n 1)
    if [ -n "$v" ] && (( v >= 13 )); then echo 13; else echo 12; fi
}

# The site-packages folders of the image's venv that a venv made from it with --system-site-packages would
# not see (those of the base interpreter it sees already), as a Python list in double quotes; [] where the
# image's python is no venv. Asked of that interpreter itself.
read -r -d '' PARENT_PY <<'EOF'
import json, site, sys
base = set(site.getsitepackages([sys.base_prefix, sys.base_exec_prefix]))
mine = [p for p in site.getsitepackages() if p not in base] if sys.prefix != sys.base_prefix else []
print(json.dumps(mine))
EOF
parent_sites() { "$PY" -c "$PARENT_PY" 2>/dev/null || echo "[]"; }

install_commands() {  # the install, one command a line (run by bash in the install step, printed by --plan)
    local venv_opts="--system-site-packages" sites pth
    if [ "$MODE" = offline ] && "$PY" -m pip --version >/dev/null 2>&1; then
        venv_opts="$venv_opts --without-pip"  # the image's pip runs in the venv: no ensurepip, no index
    fi
    echo "grep -qs 'include-system-site-packages = true' $VENV/pyvenv.cfg || $PY -m venv --clear $venv_opts $VENV"
    echo ". $VENV/bin/activate"
    sites=$(parent_sites)
    if [ "$sites" != "[]" ]; then  # the image's venv, after the venv's own site-packages; its .pth files run
        pth="import site; list(map(site.addsitedir, $sites))"  # no comprehension: before 3.12 it cannot see site
        echo "python -c 'import sys, sysconfig; f = sysconfig.get_path(\"purelib\") + \"/_gpu_check_parent.pth\";" \
             "open(f, \"w\").write(sys.argv[1] + \"\\n\"); print(\"linked the image venv:\", f)' '${pth//\'/\'\\\'\'}'"
    fi
    if [ "$MODE" = offline ]; then
        (( ${#install_wheels[@]} )) && echo "python -m pip install --no-index --no-deps --ignore-installed ${install_wheels[*]}"
        echo "python -m pip install --no-index --no-deps --no-build-isolation -e ."
    else
        local extras=mpich
        "$PY" -c "import cupy" >/dev/null 2>&1 || extras="gpu$(cuda_major),mpich"
        echo "python -m pip install -e '.[$extras]' 'pytest>=7' 'pytest-timeout>=2'"
    fi
}

# ---- the steps ------------------------------------------------------------------------------------------
read -r -d '' ENV_PY <<'EOF'
import importlib, os, platform, shutil, sys
bad = False
print("env: python", sys.version.split()[0], sys.executable, "glibc", platform.libc_ver()[1], "cpus", os.cpu_count())
try:
    import shmstore
    print("env: shmstore", shmstore.__version__, "from", os.path.dirname(shmstore.__file__))
    for m in ("shmstore.meta._fast", "shmstore.primitives._copy", "shmstore.mpi._probe"):
        try:
            importlib.import_module(m)
            print("env: C helper", m, "built")
        except ImportError as exc:
            print("env: C helper", m, "missing (pure Python instead):", exc)
    from shmstore.levels.device import cupy_or_reason
    cp, why = cupy_or_reason()
    if cp is None:
        print("env: no GPU level:", why)
    else:
        rt = cp.cuda.runtime

        def asked(f):  # a version number, or why not (the stand-in has no CUDA versions)
            try:
                return getattr(rt, f)()
            except Exception as exc:
                return f"unknown ({type(exc).__name__})"

        stand_in = "(the CuPy STAND-IN of tests/fakecuda, not CUDA)" if "fakecuda" in cp.__version__ else ""
        print("env: cupy", cp.__version__, "from", os.path.dirname(cp.__file__), "runtime",
              asked("runtimeGetVersion"), "driver", asked("driverGetVersion"), "devices", rt.getDeviceCount(),
              stand_in)
        for d in range(rt.getDeviceCount()):
            p = rt.getDeviceProperties(d)
            print(f"env: device {d}: {p['name'].decode()} {p['totalGlobalMem'] / 2**30:.0f} GiB,"
                  f" compute mode {p['computeMode']} (0 default, 3 exclusive process)")
except Exception as exc:
    print("env: shmstore or CuPy failed:", repr(exc))
    bad = True
try:
    import mpi4py
    from mpi4py import MPI
    print("env: mpi4py", mpi4py.__version__, "|", MPI.Get_library_version().splitlines()[0].strip(),
          "| mpiexec", shutil.which("mpiexec"))
    libs = [line.split()[-1] for line in open("/proc/self/maps") if "libmpi" in line and "/" in line]
    print("env: libmpi", sorted(set(libs))[0] if libs else "not mapped")
except Exception as exc:
    print("env: mpi4py failed:", repr(exc))
    bad = True
try:
    import numpy, pytest
    print("env: numpy", numpy.__version__, "from", os.path.dirname(numpy.__file__), "| pytest", pytest.__version__)
except Exception as exc:
    print("env: numpy or pytest failed:", repr(exc))
    bad = True
st = os.statvfs("/dev/shm")
print(f"env: /dev/shm {st.f_bavail * st.f_frsize / 2**30:.1f} GiB free of {st.f_blocks * st.f_frsize / 2**30:.1f} GiB")
sys.exit(bad)
EOF

read -r -d '' AWARE_PY <<'EOF'
from mpi4py import MPI  # noqa: F401
from shmstore.mpi.cuda import cuda_aware
print("MPI CUDA-aware:", cuda_aware())
EOF

MPI2=(mpiexec -launcher fork -hosts n0:1,n1:1 -n 2)

names=() outcomes=() seconds=() results=()
DEADLINE=$(( $(date +%s) + BUDGET ))
START=$(date +%s)

wanted() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

shown() {  # a command as a line, quoted where needed (an inline script as its first line)
    local a out=""
    for a in "$@"; do
        if [[ $a == *$'\n'* ]]; then a="<${a%%$'\n'*} ...>"; fi
        if [[ $a =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then out+="$a "; else out+="'${a//\'/\'\\\'\'}' "; fi
    done
    echo "${out% }"
}

result_of() {  # the lines of a step's log that say how it went
    local name=$1 log=$2 pat
    case $name in
        env) pat='^env: (cupy|device|no GPU|mpi4py|libmpi|C helper .* missing|.* failed)';;
        install) pat='^linked the image venv|Successfully installed|ERROR|error:|not found|No matching';;
        bench-gpu|bench-gpu-mpi) pat='^device|no GPU level|Error';;
        sweep) pat='^small ops, several|Error';;
        cuda-aware) pat='CUDA-aware|Error';;
        *) pat='(^|[ =])[0-9]+ (passed|failed|errors?|skipped)|no tests ran|Error';;
    esac
    grep -E "$pat" "$log" 2>/dev/null | tail -n 4 | cut -c1-700 | paste -sd '|' -
}

step() {  # step NAME TIMEOUT CMD...: run CMD under its own timeout into its log; record and print the outcome
    local name=$1 limit=$2 left rc t0 secs outcome log
    shift 2
    wanted "$name" || return 0
    if (( PLAN )); then
        echo "step $name (timeout ${limit} s): $(shown "$@")"
        return 0
    fi
    left=$(( DEADLINE - $(date +%s) ))
    if (( left < 20 )); then
        record "$name" "NOT RUN" 0 "the check's budget of ${BUDGET} s is spent (GPU_CHECK_BUDGET)"
        return 0
    fi
    (( limit > left )) && limit=$left
    log=$LOGS/$name.log t0=$(date +%s)
    echo "---- $name (timeout ${limit} s, log gpu-check-logs/$name.log in $ARCHIVE)"
    MPIEXEC_TIMEOUT=$(( limit > 20 ? limit - 10 : limit )) timeout -k 10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    case $rc in
        0) outcome=PASS;;
        124|137) outcome="TIMEOUT";;
        *) outcome="FAIL (exit $rc)";;
    esac
    if [ $rc = 0 ] && grep -qE "no GPU level( here|:)|GPU level unavailable|gpu is not available here" "$log"; then
        outcome="NO GPU"
    fi
    record "$name" "$outcome" "$secs" "$(result_of "$name" "$log")"
    if [ "$outcome" != PASS ]; then tail -n 25 "$log" | sed 's/^/    | /'; fi
}

record() {  # one step's outcome: printed, and the summary and the archive written again (an outer kill loses nothing)
    names+=("$1") outcomes+=("$2") seconds+=("$3") results+=("$4")
    printf '%-16s %-14s %4s s  %s\n' "$1" "$2" "$3" "$4"
    write_outputs
}

write_outputs() {  # the summary, and every log so far in one archive (each written beside, then renamed)
    local passed=0 o verdict
    for o in "${outcomes[@]}"; do [ "$o" = PASS ] && passed=$(( passed + 1 )); done
    if (( passed == ${#outcomes[@]} )); then verdict=PASS; else verdict=FAIL; fi
    [ -n "$SHMSTORE_FAKE_CUPY" ] && verdict="$verdict on the CuPy stand-in ($SHMSTORE_FAKE_CUPY), not on a device"
    {
        echo "gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
             "host $(uname -n) mode $MODE ($WHY); $(( $(date +%s) - START )) s of a ${BUDGET} s budget"
        for n in "${notes[@]}"; do echo "note: $n"; done
        grep -hE '^env: ' "$LOGS/env.log" 2>/dev/null
        printf '%-16s %-14s %6s  %s\n' step outcome secs result
        for i in "${!names[@]}"; do
            printf '%-16s %-14s %4s s  %s\n' "${names[$i]}" "${outcomes[$i]}" "${seconds[$i]}" "${results[$i]}"
        done
        echo "overall: $verdict ($passed of ${#outcomes[@]} steps passed; every log in $ARCHIVE)"
    } >"$SUMMARY.part" && mv -f "$SUMMARY.part" "$SUMMARY"
    tar -czf "$ARCHIVE.part" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" && mv -f "$ARCHIVE.part" "$ARCHIVE"
}

# ---- the benchmarks' size: /dev/shm may be small -----------------------------------------------------------
SHM_FREE_MIB=$(df -Pm /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
SHM_FREE_MIB=${SHM_FREE_MIB:-0}
BENCH_MIB=256 BIG_MIB=64 SD_MIB=16 BENCH_ENV=()
if (( SHM_FREE_MIB < SHM_WANT_MIB )); then
    BENCH_MIB=64 BIG_MIB=16 SD_MIB=8 BENCH_ENV=(env SHMSTORE_PREFAULT=64MiB)
    notes+=("/dev/shm has ${SHM_FREE_MIB} MiB free, under the ${SHM_WANT_MIB} MiB the full-size benchmarks want:\
 benchmarks sized down (bench_gpu --mib 64, SHMSTORE_PREFAULT=64MiB, sweep --big-mib 16 --sd-mib 8)")
fi

# ---- run --------------------------------------------------------------------------------------------------
echo "gpu-check: mode $MODE ($WHY); budget ${BUDGET} s; summary $SUMMARY, logs $ARCHIVE"
for n in "${notes[@]}"; do echo "gpu-check: $n"; done
if (( PLAN )); then
    if (( INSTALL )) && wanted install; then
        echo "step install (timeout 90 s):"
        install_commands | sed 's/^/    /'
    fi
else
    mkdir -p "$OUTDIR" || exit 1
    rm -f "$SUMMARY" "$ARCHIVE"
    LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")/gpu-check-logs
    mkdir -p "$LOGS" || exit 1
    trap 'rm -rf "$(dirname "$LOGS")"' EXIT
fi
export PYTHONUNBUFFERED=1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}  # shmstore from this checkout even where its install failed

if (( INSTALL )) && (( ! PLAN )) && wanted install; then
    script="set -e"
    while IFS= read -r line; do script+=$'\n'"echo $(printf '%q' "+ $line")"$'\n'"$line"; done < <(install_commands)
    step install 90 bash -c "$script"
fi
if (( INSTALL )) && (( ! PLAN )) && [ -f "$VENV/bin/activate" ]; then
    . "$VENV/bin/activate"
fi
P=python  # the venv's; where there is none and no python either (a bare image has python3 only), $PY
(( PLAN )) || command -v python >/dev/null 2>&1 || P=$PY
PYTEST=("$P" -m pytest -q -p no:cacheprovider -m "gpu or not gpu" -rA)  # -rA: every test by name (items 8-15 are named test_itemNN_...)
step env 45 "$P" -c "$ENV_PY"
step device-tests 180 "${PYTEST[@]}" tests/levels/test_gpu.py
step conformance 100 "${PYTEST[@]}" tests/levels/test_conformance.py -k gpu
step mpi-full-levels 90 "${MPI2[@]}" "$P" -m mpi4py -m pytest -q -p no:cacheprovider -m "gpu or not gpu" -rA \
    tests/mpi/ranks/test_full_levels.py
step cuda-aware 30 "$P" -c "$AWARE_PY"
step bench-gpu 60 "${BENCH_ENV[@]}" "$P" scripts/bench_gpu.py --mib "$BENCH_MIB"
step bench-gpu-mpi 75 "${BENCH_ENV[@]}" "${MPI2[@]}" "$P" -m mpi4py scripts/bench_gpu.py --mpi --mib "$BENCH_MIB"
step sweep 90 "${BENCH_ENV[@]}" "$P" scripts/bench_local.py --repeats 3 --small 4000 --big-mib "$BIG_MIB" \
    --sd-mib "$SD_MIB" --sweep 1,2,4,8,16 --json "${LOGS:-gpu-check-logs}/bench_local.json"
(( PLAN )) && exit 0

# ---- the summary ------------------------------------------------------------------------------------------
(( ${#names[@]} )) || write_outputs
echo "==== gpu-check summary ===="
cat "$SUMMARY"
passed=0
for o in "${outcomes[@]}"; do [ "$o" = PASS ] && passed=$(( passed + 1 )); done
exit $(( passed != ${#outcomes[@]} ))
