#!/usr/bin/env python3
"""A training-like MPI job that checkpoints through the store and restarts from it (mpi/slurm/checkpoint.sbatch).

Each rank keeps a state of ``--mib`` MiB (split over 16 arrays) whose every value is ``rank * 1000 + step``:
a restored state is checked value by value. On start it restores the newest complete checkpoint in
``persist_dir`` (if any) and goes on from its step; it checkpoints every ``--every`` steps, and at once on
SIGUSR1 (Slurm's warning before the time limit: ``#SBATCH --signal=B:USR1@60``, forwarded by the batch
script), then waits for that checkpoint to complete and exits 0, so that a job submitted with
``--dependency=afterany`` goes on from it. ``--fail-at STEP``: rank 0 raises once the checkpoint of STEP is
complete (a failed job step); ``--expect memory``: the restore must read no object from the folder.

Usage: python -m mpi4py scripts/checkpoint_job.py [--steps 40] [--every 10] [--mib 8] [--fail-at S]
[--expect any|memory|folder] [--step-seconds 0.02]
"""
from __future__ import annotations

import argparse
import collections
import signal
import sys
import time

import mpi4py

mpi4py.rc.thread_level = "multiple"
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from shmstore.errors import CheckpointError  # noqa: E402
from shmstore.mpi import Cluster  # noqa: E402

ARRAYS = 16
_warned = [False]


def _on_usr1(signum: int, frame: object) -> None:
    _warned[0] = True


def _fresh(rank: int, mib: int) -> dict[str, np.ndarray]:
    n = mib * (1 << 20) // ARRAYS // 8
    return {f"r{rank}.a{i}": np.full(n, rank * 1000.0) for i in range(ARRAYS)}


def _restore(c: Cluster, mib: int, expect: str) -> tuple[int, dict[str, np.ndarray]]:
    rank = c.comm.rank
    try:
        got = c.restore()
    except CheckpointError as exc:
        if rank == 0:
            print(f"no checkpoint to restore ({exc}); starting at step 0", flush=True)
        return 0, _fresh(rank, mib)
    step = int(got["step"])
    state = {}
    for i in range(ARRAYS):
        v = got[f"r{rank}.a{i}"]
        if not (v[0] == v[-1] == rank * 1000.0 + step and np.all(v == v[0])):
            raise RuntimeError(f"rank {rank}: restored r{rank}.a{i} holds {v[0]}..{v[-1]}, not {rank * 1000 + step}")
        state[f"r{rank}.a{i}"] = np.array(v)  # our own copy to train on
    origins = collections.Counter(got.origins[k] for k in got.origins)
    counts = c.comm.allreduce(origins, op=MPI.SUM)
    if rank == 0:
        print(f"restored {got.name!r} at step {step}: {len(got)} keys; read from {dict(counts)}", flush=True)
    if expect == "memory" and origins.get("folder"):
        raise RuntimeError(f"rank {rank} read {origins['folder']} object(s) from the folder; expected node memory")
    if expect == "folder" and set(origins) != {"folder"}:
        raise RuntimeError(f"rank {rank} read objects from {dict(origins)}; expected only the folder")
    return step, state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="steps to run in this job (after a restore: more)")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--fail-at", type=int, default=-1)
    ap.add_argument("--expect", choices=["any", "memory", "folder"], default="any")
    ap.add_argument("--step-seconds", type=float, default=0.02)
    args = ap.parse_args()
    signal.signal(signal.SIGUSR1, _on_usr1)
    with Cluster() as c:
        comm, rank = c.comm, c.comm.rank
        step, state = _restore(c, args.mib, args.expect)
        last = step + args.steps
        while step < last:
            step += 1
            for v in state.values():
                v += 1.0  # the "training": every value is rank * 1000 + step
            time.sleep(args.step_seconds)
            warned = comm.allreduce(_warned[0], op=MPI.LOR)
            if step % args.every == 0 or warned or step == last:
                t = time.perf_counter()
                ck = c.checkpoint(f"step{step}", dict(state, step=step) if rank == 0 else state)
                blocked = time.perf_counter() - t
                if rank == 0:
                    print(f"step {step}: checkpoint {ck.name!r} (blocked {blocked * 1e3:.1f} ms)", flush=True)
                if warned or step == last or step == args.fail_at:
                    ck.wait()
                    if rank == 0:
                        print(f"step {step}: checkpoint {ck.name!r} complete in {ck.path}", flush=True)
                if step == args.fail_at and rank == 0:
                    raise RuntimeError(f"failing on purpose after the checkpoint of step {step}")
                if warned:
                    if rank == 0:
                        print(f"step {step}: SIGUSR1 (time limit near): checkpointed, exiting", flush=True)
                    break
        if rank == 0:
            print(f"done at step {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
