#!/usr/bin/env python3
"""A remote get where users meet it: after silence, and while the holder's rank sleeps, computes or waits in MPI.

    mpiexec -launcher fork -hosts n0:1,n1:1 -n 2 python -m mpi4py scripts/bench_latency.py
    ... scripts/bench_latency.py --silence 1,10 --repeats 3 --modes asleep,computing,barrier

Rank 1 (node n1) holds the objects: 64 B ones and 1 MiB ones. Rank 0 (node n0)
gets them, each get a first fetch into its node. For each way the holder's rank
spends its time meanwhile (``asleep``: ``time.sleep``, its core idle;
``computing``: numpy matrix products and a pure-Python loop, in turns;
``barrier``: waiting in ``comm.Barrier()``; ``python``, not by default: pure
Python only, the GIL held but between ~10 ms turns), rank 0 waits each ``--silence``
(seconds; nothing is asked of the holder's node meanwhile) and times the get
that follows, then ``--gets`` distinct 64 B gets back to back (min, median, p90,
p99, max), ``--spaced`` 64 B gets 1 ms apart (median, p99: the holder's service
between its naps), a 1 MiB get (1 ms after the last of those), five more back
to back (their median), and ``locate`` of keys it does not hold. Baselines in the same run,
before the Cluster exists, between the same two ranks: the raw 8 B MPI
round trip (median and p99 of ``--gets``) and a raw 1 MiB ``Send`` answering an
8 B request (the holder in a blocking ``Recv``, medians of 50), from private
memory and from POSIX shared memory into shared memory (where a store's objects
live: on /dev/shm's 4 KiB pages the copy between processes costs more), and from
and into distinct shared memory each time (``distinct``: as the store's gets of
distinct objects, the bytes not in the caches; the 1 MiB rows give both ratios), and
that last one again right after each mode's 1 MiB gets (``1 MiB raw beside``: as many,
the holder's hold over; ``... / raw beside``: the back-to-back gets' median over it, repeat
by repeat, as a link's speed drifts within minutes on a VM); a raw
8 B round trip after each silence with the other rank probing every 50 us,
followed by ``--gets`` more back to back (their p99: the raw counterpart of the
gets' p99), and with it spinning in a blocking ``Recv`` (what this machine adds
after a pause: the second is the floor of any program, the asking rank's own
wake from its sleep included). Every figure is the median over ``--repeats``;
ratios are against those baselines.

``--thread`` also times raw 8 B pings answered by a thread of the holder's rank that waits as an idle node
service does (the C prober, the GIL released, naps of 50 us up to 1 ms), beside the holder's work in each mode,
before the Cluster exists: what this machine gives a program that answers from a thread without spending a core.
Its ``paced`` rows: the same pings with rank 0 busy ``--pace-us`` after each (about what a store get costs the
asking side itself), so that they span as many of the holder's compute turns as the store's back-to-back gets.

``--rma`` also times what a one-sided read of a sealed object would cost with this MPI, before the Cluster
exists: passive-target ``Get`` (``Lock(SHARED)``/``Get``/``Unlock``) of 64 B and 1 MiB from a window the holder
allocated, with the holder in the same modes, after the same silences and back to back. Where the MPI needs the
target's progress to answer (no RDMA, no progress thread), those gets wait for the holder's next MPI call.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import uuid
from multiprocessing import shared_memory

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_neighbour import round_trips  # noqa: E402  (scripts/, this script's folder)
from mpi4py import MPI  # noqa: E402

from shmstore.mpi import Cluster  # noqa: E402
from shmstore.mpi.poll import quiet_barrier  # noqa: E402

MiB = 1 << 20
BIGS = 6  # 1 MiB objects per mode and repeat: one get after the spaced ones, then the others back to back
STOP = 77  # the tag that tells the holder a mode's measurements are over


def raw_round_trips(comm: MPI.Comm, n: int, reply_bytes: int, shm: bool = False, distinct: bool = False
                    ) -> list[float]:
    """8 B to rank 1 and ``reply_bytes`` back, ``n`` times back to back after two unmeasured; seconds, on rank 0.
    ``shm``: the reply goes from and into POSIX shared memory (pages touched before), as a store's objects do.
    ``distinct``: each reply from and into buffers of its own (``n + 2`` of them on each side, every page
    written before), as a store's gets of distinct objects are: the bytes not in the caches (with one buffer,
    as without it, a 1 MiB reply is read from and written into the caches every time)."""
    count = n + 2 if distinct else 1
    seg = None
    if shm or distinct:  # a segment of this run's own, unlinked at once (nothing left behind, even if the run dies)
        seg = shared_memory.SharedMemory(create=True, size=reply_bytes * count)
        seg.unlink()
    try:
        reps = None
        if seg is not None:
            reps = np.ndarray((count, reply_bytes), np.uint8, seg.buf)
            reps[:] = 1
        quiet_barrier(comm)
        if not distinct:
            times = round_trips(comm, n + 2, reply_bytes, None if reps is None else reps[0])
        else:
            times = [t for i in range(count) for t in round_trips(comm, 1, reply_bytes, reps[i])]
        quiet_barrier(comm)
        del reps
        return times[2:]
    finally:
        if seg is not None:
            seg.close()


def paired_raw(comm: MPI.Comm) -> list[float]:
    """:func:`raw_round_trips` of 1 MiB from and into distinct shared memory, as many as a mode's back-to-back
    1 MiB gets, right after them (both ranks, the holder's hold over): the baseline beside them, not minutes
    before. Both are left 0.3 s first: the services to go idle (over TCP a thread probing every 200 us made a raw
    1 MiB 20-50% slower), a computing holder's BLAS threads to stop spinning (OpenBLAS's wait for its next
    product, ~0.1 s: 50 ms after the compute, a raw 1 MiB took 1.1-2.3 ms where it took 0.6-0.7 ms otherwise)."""
    time.sleep(0.3)
    return raw_round_trips(comm, BIGS - 1, MiB, distinct=True)


def raw_after_silence(comm: MPI.Comm, silence: float, nap: float, then: int = 0) -> list[float]:
    """One 8 B round trip after ``silence`` seconds, the other rank probing every ``nap`` seconds (as an idle
    node service does; 0: a blocking Recv, which busy-polls), then ``then`` more back to back, the other rank
    probing the same way before each; seconds, on rank 0 (the first, then the others)."""
    buf = np.zeros(8, np.uint8)
    quiet_barrier(comm)
    took = []
    if comm.rank == 0:
        time.sleep(silence)
        for _ in range(1 + then):
            t = time.perf_counter()
            comm.Send(buf, dest=1)
            comm.Recv(buf, source=1)
            took.append(time.perf_counter() - t)
    else:
        for _ in range(1 + then):
            while nap and not comm.Iprobe(source=0):
                time.sleep(nap)
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)
    quiet_barrier(comm)
    return took


def hold(comm: MPI.Comm, mode: str) -> None:
    """What the holder's rank does until rank 0 says it is done (rank 1)."""
    if mode == "barrier":
        comm.Barrier()
        return
    stop = comm.irecv(source=0, tag=STOP)
    a = np.random.default_rng(1).random((200, 200))
    turn = 0
    while not stop.Test():
        if mode == "asleep":
            time.sleep(0.01)
        elif mode == "python":
            sum(i * i for i in range(200000))  # pure Python only, ~10 ms turns: the GIL held all along
        elif turn % 2:
            for _ in range(10):
                a = a @ a
                a /= np.abs(a).max()
        else:
            sum(i * i for i in range(20000))  # pure Python: holds the GIL
        turn += 1


def release(comm: MPI.Comm, mode: str) -> None:
    """Rank 0: the measurements of ``mode`` are over."""
    if mode == "barrier":
        comm.Barrier()
    else:
        comm.send(None, dest=1, tag=STOP)


def rma_rows(comm: MPI.Comm, modes: list[str], silences: list[float], args: argparse.Namespace
             ) -> dict[str, dict[str, list[float]]]:
    """Passive-target Gets from rank 1's window, as ``main`` times the store's gets (``--rma``); rows on rank 0."""
    win = MPI.Win.Allocate(MiB, 1, comm=comm)
    np.frombuffer(win.tomemory(), np.uint8)[:] = 7
    small, big = np.empty(64, np.uint8), np.empty(MiB, np.uint8)

    def get(dst: np.ndarray) -> float:
        t = time.perf_counter()
        win.Lock(1, MPI.LOCK_SHARED)
        win.Get(dst, 1)
        win.Unlock(1)
        return time.perf_counter() - t

    rows: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    quiet_barrier(comm)
    if comm.rank == 0:
        get(small)  # the first of all is not measured
    quiet_barrier(comm)
    for _ in range(args.repeats):
        for m in modes:
            if comm.rank == 1:
                hold(comm, m)
                continue
            got = rows[m]
            for s in silences:
                time.sleep(s)
                got.setdefault(f"RMA first after {s:g} s", []).append(get(small))
            tight = [get(small) for _ in range(args.gets)]
            for label, q in (("median", 0.5), ("p99", 0.99)):
                got.setdefault(f"RMA {args.gets} gets {label}", []).append(pct(tight, q))
            got.setdefault("RMA 1 MiB get", []).append(statistics.median(get(big) for _ in range(5)))
            assert small[0] == big[-1] == 7
            release(comm, m)
    quiet_barrier(comm)
    win.Free()
    return rows


def thread_rows(comm: MPI.Comm, modes: list[str], silences: list[float], args: argparse.Namespace
                ) -> dict[str, dict[str, list[float]]]:
    """A raw responder beside the holder's work (``--thread``): a thread of rank 1 answers rank 0's 8 B pings,
    waiting as an idle node service does (the C prober with the GIL released, naps of 50 us doubling up to 1 ms),
    while rank 1's main thread sleeps, computes or waits in a barrier; timed as ``main`` times the store's gets
    (rows on rank 0). What this machine gives a program that answers from a thread without spending a core:
    the store's gets beside it are the store's own cost."""
    from shmstore.mpi.poll import prober
    side = comm.Dup()
    buf = np.zeros(8, np.uint8)
    rows: dict[str, dict[str, list[float]]] = {m: {} for m in modes}

    def answer() -> None:  # rank 1's responder, until a ping says stop
        probe, mine = prober(side), np.zeros(8, np.uint8)
        while True:
            if not probe(0, 9, 200e-6, 50e-6, 1.0, 1e-3):
                continue
            side.Recv(mine, source=0, tag=9)
            if mine[0]:
                return
            side.Send(mine, dest=0, tag=9)

    def ping() -> float:
        t = time.perf_counter()
        side.Send(buf, dest=1, tag=9)
        side.Recv(buf, source=1, tag=9)
        return time.perf_counter() - t

    quiet_barrier(comm)
    for _ in range(args.repeats):
        for m in modes:
            if comm.rank == 1:
                t = threading.Thread(target=answer, daemon=True)
                t.start()
                hold(comm, m)
                t.join()
                continue
            got = rows[m]
            ping()  # the thread is up
            for s in silences:
                time.sleep(s)
                got.setdefault(f"raw thread 1st {s:g} s, no bell", []).append(ping())
            tight = [ping() for _ in range(args.gets)]
            for label, q in (("median", 0.5), ("p99", 0.99)):
                got.setdefault(f"raw thread {args.gets} {label}", []).append(pct(tight, q))
            # paced: rank 0 busy for --pace-us after each ping (a get's own work on the asking side), so the pings
            # span as many of the holder's compute turns as the store's back-to-back gets do, not one turn
            paced = []
            for _ in range(args.gets):
                paced.append(ping())
                until = time.perf_counter() + args.pace_us * 1e-6
                while time.perf_counter() < until:
                    pass
            for label, q in (("median", 0.5), ("p99", 0.99)):
                got.setdefault(f"raw thread paced {label}", []).append(pct(paced, q))
            side.Send(np.ones(8, np.uint8), dest=1, tag=9)
            release(comm, m)
    quiet_barrier(comm)
    side.Free()
    return rows


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--silence", default="1,10", help="seconds of silence before a first get (comma list)")
    ap.add_argument("--gets", type=int, default=300, help="distinct 64 B gets back to back")
    ap.add_argument("--spaced", type=int, default=50, help="distinct 64 B gets 1 ms apart")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="asleep,computing,barrier")
    ap.add_argument("--rma", action="store_true", help="also time raw passive-target MPI Gets (see above)")
    ap.add_argument("--thread", action="store_true", help="also time raw pings answered by a thread of the holder "
                    "that waits as a node service does, beside the holder's work (see above)")
    ap.add_argument("--pace-us", type=float, default=60.0, help="with --thread: also pings with rank 0 busy this many "
                    "us after each (about a store get's own work on the asking side; see above)")
    ap.add_argument("--name", default="", help="the Cluster's name (default: 'lat' and a random suffix)")
    ap.add_argument("--switch-us", type=float, help="sys.setswitchinterval on every rank, in us (Python's default "
                    "5000: how long the holder's computing main thread keeps the GIL from its node service)")
    args = ap.parse_args()
    if args.switch_us:
        sys.setswitchinterval(args.switch_us * 1e-6)
    world = MPI.COMM_WORLD
    if world.size != 2:
        raise SystemExit("bench_latency runs on exactly 2 ranks (see the usage line)")
    silences = [float(s) for s in args.silence.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    rtts, mibs = raw_round_trips(world, args.gets, 8), raw_round_trips(world, 50, MiB)
    shm_mibs = raw_round_trips(world, 50, MiB, shm=True)
    cold_mibs = raw_round_trips(world, 50, MiB, distinct=True)
    rtt, raw_mib, shm_mib, cold_mib = ((statistics.median(rtts), statistics.median(mibs), statistics.median(shm_mibs),
                                        statistics.median(cold_mibs)) if world.rank == 0 else (0.0, 0.0, 0.0, 0.0))
    after, spun, runs = {}, {}, []  # runs: p99 of the back-to-back round trips after each silence and repeat
    for s in silences:
        firsts = []
        for _ in range(args.repeats):
            took = raw_after_silence(world, s, 50e-6, then=args.gets)
            if took:
                firsts.append(took[0])
                runs.append(pct(took[1:], 0.99))
        after[s] = statistics.median(firsts) if firsts else 0.0
        spun[s] = statistics.median([(raw_after_silence(world, s, 0.0) or [0.0])[0] for _ in range(args.repeats)])
    rma = rma_rows(world, modes, silences, args) if args.rma else {}
    if args.thread:
        for m, got in thread_rows(world, modes, silences, args).items():
            rma.setdefault(m, {}).update(got)
    name = world.bcast(args.name or "lat" + uuid.uuid4().hex[:8])
    per_round = len(silences) + args.gets + args.spaced
    rows: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    # the default prefault (every page of this store mapped ahead by its prefault thread, done before the first
    # get): a fetch lands in warm memory, as the raw baseline's Recv does
    with Cluster(name=name, capacity="256MiB") as cluster:
        cluster.store.wait_prefaulted(256 * MiB, 120)
        if world.rank == 1:
            for r in range(args.repeats):
                for m in modes:
                    for i in range(per_round):
                        cluster.put(f"{m}{r}s{i}", np.full(8, i, np.int64))  # 64 B
                    for i in range(BIGS):
                        cluster.put(f"{m}{r}big{i}", np.full(MiB // 8, r + i, np.int64))
                    for i in range(20):
                        cluster.put(f"{m}{r}loc{i}", np.zeros(8, np.int64))
            cluster.put("warm", np.zeros(8, np.int64))
        quiet_barrier(world)
        if world.rank == 0:
            cluster.get("warm")  # the first request of all is not what is measured
        quiet_barrier(world)
        for r in range(args.repeats):
            for m in modes:
                if world.rank == 1:
                    hold(world, m)
                    paired_raw(world)
                    continue
                got = rows[m]
                keys = iter(f"{m}{r}s{i}" for i in range(per_round))
                for s in silences:
                    time.sleep(s)
                    t = time.perf_counter()
                    cluster.get(next(keys))
                    got.setdefault(f"first after {s:g} s", []).append(time.perf_counter() - t)
                tight = []
                for _ in range(args.gets):
                    k = next(keys)
                    t = time.perf_counter()
                    cluster.get(k)
                    tight.append(time.perf_counter() - t)
                for label, q in (("min", 0.0), ("median", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0)):
                    got.setdefault(f"{args.gets} gets {label}", []).append(pct(tight, q))
                spaced = []
                for k in keys:
                    time.sleep(0.001)
                    t = time.perf_counter()
                    cluster.get(k)
                    spaced.append(time.perf_counter() - t)
                if spaced:
                    for label, q in (("median", 0.5), ("p99", 0.99)):
                        got.setdefault(f"1 ms apart {label}", []).append(pct(spaced, q))
                bigs = []
                for i in range(BIGS):  # the first 1 ms after the last spaced get, then back to back
                    t = time.perf_counter()
                    cluster.get(f"{m}{r}big{i}")
                    bigs.append(time.perf_counter() - t)
                got.setdefault("1 MiB get", []).append(bigs[0])
                back_to_back = statistics.median(bigs[1:])
                got.setdefault(f"{BIGS - 1} 1 MiB gets median", []).append(back_to_back)
                locs = []
                for i in range(20):
                    t = time.perf_counter()
                    cluster.locate(f"{m}{r}loc{i}")
                    locs.append(time.perf_counter() - t)
                got.setdefault("locate", []).append(statistics.median(locs))
                release(world, m)
                # the raw baseline again, seconds after the store's 1 MiB gets rather than minutes: on a VM a link's
                # speed drifts 2x within minutes (nodes apart, this VM: 0.35 ms, then 0.75 ms, minutes later)
                beside = statistics.median(paired_raw(world))
                got.setdefault("1 MiB raw beside", []).append(beside)
                got.setdefault(f"{BIGS - 1} 1 MiB gets / raw beside", []).append(back_to_back / beside)
        quiet_barrier(world)
    if world.rank == 0:
        print(f"bench_latency: 2 ranks on 2 nodes, {os.cpu_count()} cpus, GIL switch interval "
              f"{sys.getswitchinterval() * 1e6:.0f} us, medians of {args.repeats} repeat(s); raw "
              f"8 B MPI round trip {rtt * 1e6:.1f} us (p99 of {args.gets} back to back "
              f"{pct(rtts, 0.99) * 1e6:.1f} us), raw 1 MiB answer {raw_mib * 1e3:.3f} ms "
              f"(shared memory to shared memory: {shm_mib * 1e3:.3f} ms, {shm_mib / raw_mib:.2f}x; from and into "
              f"distinct shared memory each time, as distinct objects: {cold_mib * 1e3:.3f} ms, "
              f"{cold_mib / raw_mib:.2f}x)")
        print(f"  raw: p99 of {args.gets} 8 B round trips back to back right after a first one after silence, the "
              f"other rank probing every 50 us before each: {statistics.median(runs) * 1e6:.1f} us "
              f"({statistics.median(runs) / rtt:.1f}x RTT; runs: {', '.join(f'{x * 1e6:.0f}' for x in runs)})")
        for s, v in after.items():
            print(f"  raw 8 B round trip after {s:g} s of silence, the other rank probing every 50 us: "
                  f"{v * 1e6:.1f} us ({v / rtt:.1f}x RTT); spinning in Recv: {spun[s] * 1e6:.1f} us "
                  f"({spun[s] / rtt:.1f}x RTT)")
        for m in modes:
            print(f"  holder {m}:")
            for label, xs in (rows[m] | rma.get(m, {})).items():
                v = statistics.median(xs)
                if label.endswith("/ raw beside"):  # a ratio, repeat by repeat
                    print(f"    {label:22} {v:10.2f}x  (runs: {', '.join(f'{x:.2f}' for x in xs)})")
                    continue
                base, unit = (raw_mib, "raw 1 MiB") if "1 MiB" in label else (rtt, "RTT")
                cold = f", {v / cold_mib:.2f}x distinct" if "1 MiB" in label else ""
                print(f"    {label:22} {v * 1e6:10.1f} us  {v / base:7.1f}x {unit}{cold}  (runs: "
                      f"{', '.join(f'{x * 1e6:.0f}' for x in xs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
