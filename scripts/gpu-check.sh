#!/usr/bin/env bash
# The GPU checks, in one go, on a machine with a CUDA device (about 5 minutes; at most 8):
#
#   scripts/gpu-check.sh
#
# Installs nothing beyond `pip install -e '.[gpu,test]'` (CuPy's CUDA 12 wheel), then: the device
# tests (tests marked gpu, and the level conformance suite on Level.GPU), the MPI device test (two
# emulated nodes fetching from each other while both GPU levels are full: tests/mpi/ranks/test_full_levels.py),
# the single-process device benchmark (put against a raw CuPy copy, get, get from a second process
# through CUDA IPC), and the device-to-device fetch between two ranks of two emulated nodes against raw
# mpi4py Send/Recv.
# Prints a summary at the end; exit status 1 if a test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
if [ ! -x .venv-gpu/bin/python ]; then python3 -m venv .venv-gpu; fi
. .venv-gpu/bin/activate
pip install -q -e '.[gpu,test]' || { echo "gpu-check: install failed"; exit 1; }
nvidia-smi -L 2>/dev/null || echo "gpu-check: no nvidia-smi"
python -c "import cupy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"
export PYTHONUNBUFFERED=1
timeout 240 python -m pytest -q -p no:cacheprovider -m 'gpu or not gpu' -rs tests/levels/test_gpu.py \
    tests/levels/test_conformance.py -k 'gpu' 2>&1 | tee /tmp/gpu-check-tests.log
TESTS=${PIPESTATUS[0]}
# Two emulated nodes fetching from each other while both GPU levels are full (the deadlock of Xorbits #488),
# beside its MEMORY twin; a deadlock ends in TransferError after 30 s (the test's peer_timeout).
MPIEXEC_TIMEOUT=150 timeout 180 mpiexec -launcher fork -hosts n0:1,n1:1 -n 2 python -m mpi4py -m pytest -q \
    -p no:cacheprovider -m 'gpu or not gpu' -rs tests/mpi/ranks/test_full_levels.py 2>&1 | tee /tmp/gpu-check-mpi.log
MPI_TESTS=${PIPESTATUS[0]}
timeout 120 python scripts/bench_gpu.py --mib 256 2>&1 | tee /tmp/gpu-check-bench.log
timeout 120 mpiexec -launcher fork -hosts n0:1,n1:1 -n 2 python -m mpi4py scripts/bench_gpu.py --mpi --mib 256 \
    2>&1 | tee -a /tmp/gpu-check-bench.log
echo "==== gpu-check summary ($(( $(date +%s) - START )) s) ===="
grep -E "passed|failed|error" /tmp/gpu-check-tests.log | tail -1
grep -E "passed|failed|error" /tmp/gpu-check-mpi.log | tail -1
grep -E "^device" /tmp/gpu-check-bench.log
python -c "from mpi4py import MPI; from shmstore.mpi.cuda import cuda_aware; print('MPI CUDA-aware:', cuda_aware())"
exit $(( TESTS != 0 || MPI_TESTS != 0 ))
