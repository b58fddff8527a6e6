#!/usr/bin/env bash
# Rehearse scripts/gpu-check.sh here, without a device, as the GPU test machine will run it (issue 31):
#
#   scripts/gpu-check-rehearse.sh [PYTHON3.12]       # default: python3.12 on PATH (GPU_REHEARSE_PYTHON)
#
# 1. An "image" venv standing in for the GPU machine's (there python3 is itself a venv), GPU_REHEARSE_IMAGE
#    (default /tmp/gpuimage), made from PYTHON3.12, with what that image holds but CuPy and torch (numpy, mpi4py,
#    pytest, pytest-timeout, setuptools, wheel, cloudpickle), installed from the package index;
# 2. the wheels the check carries in .whl/ (scripts/gpu-wheels.sh), unless they are there;
# 3. the check, offline (PIP_NO_INDEX=1: nothing from an index inside it), from a fresh .venv-gpu, with the image
#    venv first on PATH (python3 is it, as on the GPU machine) and the CuPy stand-in of tests/fakecuda for the
#    device (SHMSTORE_FAKE_CUPY), its outputs in OUT (default /tmp/gpucheck-out). Its exit status is the check's.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:-${GPU_REHEARSE_PYTHON:-python3.12}}
IMAGE=${GPU_REHEARSE_IMAGE:-/tmp/gpuimage}
OUTDIR=${OUT:-/tmp/gpucheck-out}

[ -x "$IMAGE/bin/python" ] || "$BASE" -m venv "$IMAGE"
"$IMAGE/bin/python" -m pip install -q numpy mpi4py pytest pytest-timeout setuptools wheel cloudpickle
if ! { compgen -G ".whl/posix_ipc-*.whl" && compgen -G ".whl/mpich-*.whl"; } >/dev/null; then
    PYTHON="$IMAGE/bin/python" bash scripts/gpu-wheels.sh
fi
rm -rf .venv-gpu "$OUTDIR"  # a fresh venv, as on the device machine
t0=$(date +%s)
rc=0
env -u VIRTUAL_ENV -u PYTHONPATH -u GPU_CHECK_PYTHON -u GPU_CHECK_VENV -u GPU_CHECK_WHEELS \
    PATH="$IMAGE/bin:$PATH" OUT="$OUTDIR" SHMSTORE_FAKE_CUPY="$PWD/tests/fakecuda" PIP_NO_INDEX=1 \
    bash scripts/gpu-check.sh --offline || rc=$?
echo "gpu-check-rehearse: the check took $(( $(date +%s) - t0 )) s and exited $rc; outputs: $(ls "$OUTDIR" | tr '\n' ' ')"
exit $rc
