"""Chaos run: worker processes hammer one spilling store while processes are killed at random.

    python scripts/chaos.py [--seed N] [--rounds 20] [--seconds 10] [--workers 4] [--capacity 16MiB]
                            [--unlink-every 3] [--no-spill-kills]
    python scripts/chaos.py --hours 4          # rounds until the time is up

Each worker puts, gets (whole and sliced), deletes, writes through writers,
reads through readers, pins, holds views and moves objects between levels,
with checksummed values: every value carries a header with its own length
and CRC, so any reader can verify any object. Workers journal what they do
(intent before, completion after) in append-only files that survive SIGKILL.

Meanwhile the run SIGKILLs and SIGTERMs random workers (respawning them),
half of the time while a move is in flight, and the spill process, and
sends SIGINT (Ctrl-C) to random workers, which catch ``KeyboardInterrupt``
and go on, as a notebook or a ``try/except KeyboardInterrupt`` loop does:
each first finds out what its interrupted operation did (a put, delete or
overwrite is all or nothing) and journals it. Every
``--unlink-every`` rounds, at a random moment, it also unlinks the store's
names in /dev/shm behind its back (what an ``rm`` or a cleaner does) and
makes a new store under the name at once: the old store's clients (workers
alive then, and this run) go on using it, workers started later use the
new one, and both share the spill directory. After each round it kills
every worker, lets the janitor reclaim them, and checks, in each store the
run holds (every worker journals which store it uses):

- every object whose put returned and that was not deleted reads back
  byte-identical; every object whose delete returned is gone; objects of
  interrupted puts or deletes are either absent or intact; nothing else is
  visible;
- ``store.check()`` finds no inconsistency, and each level's ``used`` in
  ``get_capacity()`` equals what the listed objects hold;

then lets the old store go (it removes its own files, and no name: the new
store keeps working), and at the end checks that nothing of either store is
left in /dev/shm or the spill directory. The seed is printed first: a
failure reproduces (up to timing) with ``--seed``. With
``SHMSTORE_CHAOS_KEEP=1`` a failed run keeps the workers' journals and
stderr (the path is printed).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import zlib
from typing import Any, Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import shmstore  # noqa: E402
from shmstore import Level  # noqa: E402
from shmstore.meta import layout as L  # noqa: E402
from shmstore.meta.lock import _held_here  # noqa: E402

MAGIC = 0x5EEDC0DE
_HEADER = np.dtype([("magic", "<u4"), ("crc", "<u4"), ("length", "<u8")])
EXPECTED = (shmstore.ObjectNotFoundError, shmstore.ObjectLockedError, shmstore.StorageFullError)


# ---- self-verifying values ---------------------------------------------------

def make_value(rng: random.Random, key: str, version: int = 0) -> tuple[Any, int]:
    """A random value (raw bytes, an array or a dict of parts) and the CRC of its payload."""
    size = rng.choice([0, 1, 63, 100, 4000, 60_000, 300_000, 1 << 20, 3 << 20])
    seed = zlib.crc32(f"{key}/{version}".encode())
    payload = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    crc = zlib.crc32(payload)
    head = np.array([(MAGIC, crc, size)], _HEADER).view(np.uint8)
    kind = rng.choice(["raw", "array", "dict"])
    if kind == "raw":
        return bytes(head) + payload.tobytes(), crc
    if kind == "array":
        return np.concatenate([head, payload]), crc
    return {"head": bytes(head), "payload": payload, "n": size}, crc


def verify(obj: Any) -> int:
    """The payload CRC of a value made by :func:`make_value`; raises AssertionError if it is damaged."""
    if isinstance(obj, dict):
        head, payload = np.frombuffer(obj["head"], np.uint8), np.asarray(obj["payload"])
        assert obj["n"] == len(payload), "dict value: length field and payload disagree"
    else:
        data = np.frombuffer(memoryview(obj).cast("B"), np.uint8) if not isinstance(obj, np.ndarray) else obj
        head, payload = data[:_HEADER.itemsize], data[_HEADER.itemsize:]
    h = head.view(_HEADER)[0]
    assert h["magic"] == MAGIC, "bad magic: not a value of this run, or overwritten"
    assert h["length"] == len(payload), f"length {h['length']} but {len(payload)} bytes"
    crc = zlib.crc32(np.ascontiguousarray(payload))
    assert crc == h["crc"], "payload does not match its CRC"
    return crc


def store_id(store: shmstore.Store) -> str:
    """Which store, of those that had the name, ``store`` is: its creator and creation time."""
    h = L.unpack_header(store.node_store.buf)
    return f"{h.creator_pid}-{h.created!r}"


def value_bytes(obj: Any) -> bytes:
    """The bytes a writer stores for a value (raw form)."""
    if isinstance(obj, dict):
        return obj["head"] + obj["payload"].tobytes()
    return bytes(memoryview(obj).cast("B")) if not isinstance(obj, np.ndarray) else obj.tobytes()


# ---- the worker --------------------------------------------------------------

class Worker:
    """One worker process: random operations on its own keys and others', journalled."""

    def __init__(self, store: shmstore.Store, journal: str, rng: random.Random, tag: str) -> None:
        self.store, self.rng, self.tag = store, rng, tag
        self.fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.mine: list[str] = []       # put returned, not deleted
        self.held: list[Any] = []       # views, readers, open writers kept alive
        self.pinned: list[str] = []
        self.n = 0
        self.current: tuple[Any, ...] | None = None  # the operation under way: what an interrupt must resolve
        self.in_op = False
        self.pause_asked = False
        self.ready = journal[:-len(".log")] + ".ready"
        self.note("S", store_id(store))  # the store its keys live in

    def note(self, *fields: Any) -> None:
        os.write(self.fd, (" ".join(map(str, fields)) + "\n").encode())

    def run(self) -> None:
        ops: list[tuple[Callable[[], None], int]] = [
            (self.put, 6), (self.get, 6), (self.get_other, 3), (self.delete, 3), (self.write, 2), (self.overwrite, 2),
            (self.read, 2), (self.pin, 1), (self.hold, 2), (self.drop, 2), (self.move, 1), (self.look, 1)]
        funcs, weights = zip(*ops)
        while True:
            try:
                self._loop(funcs, weights)
            except KeyboardInterrupt as exc:  # Ctrl-C: find out what the operation did, journal it, go on
                self._no_lock_left(exc)
                self._resolve_interrupted()

    def _loop(self, funcs: Any, weights: Any) -> None:
        while True:
            if self.pause_asked:
                self._pause()
            op = self.rng.choices(funcs, weights)[0]
            self.current = None
            self.in_op = True  # Ctrl-C raises from here (a deferred one maybe at a line of this loop)
            try:
                op()
            except EXPECTED:
                pass
            self.in_op = False

    def on_pause(self, signum: int, frame: Any) -> None:
        """SIGUSR2: stop between two operations, attached and holding what it holds (the run checks the
        store beside live workers that were interrupted, then kills them)."""
        self.pause_asked = True

    def _pause(self) -> None:
        open(self.ready[:-len(".ready")] + ".paused", "w").close()
        while True:
            time.sleep(1)

    def on_sigint(self, signum: int, frame: Any) -> None:
        """The worker's SIGINT handler (the store puts its own in front): Ctrl-C interrupts an operation;
        between two it is noted and dropped (there is nothing to interrupt, and this loop has no ``try``
        around its own bookkeeping)."""
        if self.in_op:
            self.in_op = False  # a second Ctrl-C before _resolve_interrupted runs is noted, not raised there
            raise KeyboardInterrupt
        self.note("i", "-")

    def _no_lock_left(self, exc: KeyboardInterrupt) -> None:
        """A Ctrl-C caught must leave no store lock held by this thread (one left held wedges the node: found
        later, by a steal taking every stripe, the cause is gone): where the interrupt landed, if one is."""
        node = self.store.node_store
        held = [lock.name for lock in (*node.stripes, node.alloc_lock, node.admin) if _held_here(lock.address)]
        if held:
            where = "".join(traceback.format_exception(exc))
            raise AssertionError(f"a Ctrl-C caught left {', '.join(held)} held by this thread; it landed at:\n{where}")

    def _resolve_interrupted(self) -> None:
        self.in_op = False  # another Ctrl-C now is noted, not raised
        self.note("I", "-")
        self._resolve(self.current)
        self.current = None

    def _resolve(self, current: tuple[Any, ...] | None) -> None:
        """Journal the outcome of an operation an interrupt cut short: each is all or nothing."""
        if current is None:
            return
        what, key = current[0], current[1]
        present = key in self.store
        if what == "put":
            if present:
                self._check(key, self.store.get(key), current[2])
                self.mine.append(key)
            self.note("p" if present else "F", key)
        elif what == "delete":
            if present:  # it did not happen: the key stays this worker's
                self.note("p", key)
                self.mine.append(key)
            else:
                self.note("d", key)
        elif what == "overwrite":
            assert present, f"{key!r} went missing in an interrupted overwrite"
            crc = verify(self.store.get(key))
            assert crc in (current[2], current[3]), f"{key!r} is neither its old nor its new value"
            self.note("o" if crc == current[2] else "f", key)

    def _key(self) -> str:
        self.n += 1
        return f"{self.tag}-{self.n}"

    def put(self) -> None:
        key = self._key()
        value, crc = make_value(self.rng, key)
        levels = self.rng.choice([None, None, None, [Level.DISK], [Level.MEMORY]])
        self.note("P", key, crc)
        self.current = ("put", key, crc)
        try:
            self.store.put(key, value, levels=levels)
        except shmstore.StorageFullError:
            self.note("F", key)
            return
        self.note("p", key)
        self.mine.append(key)

    def overwrite(self) -> None:
        """Replace one of its objects: readers anywhere must find the old or the new value, never none."""
        if not self.mine:
            return
        key = self.rng.choice(self.mine)
        self.n += 1
        value, crc = make_value(self.rng, key, self.n)
        levels = self.rng.choice([None, None, [Level.DISK], [Level.MEMORY]])
        self.current = ("overwrite", key, crc, verify(self.store.get(key)))
        self.note("O", key, crc)
        try:
            self.store.put(key, value, levels=levels, overwrite=True)
        except shmstore.StorageFullError:
            self.note("f", key)
            return
        self.note("o", key)

    def write(self) -> None:
        key = self._key()
        value, crc = make_value(self.rng, key)
        data = value_bytes(value)
        self.note("P", key, crc)
        self.current = ("put", key, crc)
        try:
            w = self.store.open_writer(key, len(data), levels=self.rng.choice([None, [Level.DISK]]))
        except shmstore.StorageFullError:
            self.note("F", key)
            return
        step = max(1, len(data) // self.rng.randint(1, 4))
        for pos in range(0, len(data), step):
            w.write(data[pos: pos + step])
        if self.rng.random() < 0.1:  # keep it open a while: a kill may catch it half written
            self.held.append(w)
            self.note("F", key)  # never closed here: never visible
            return
        w.close()
        self.note("p", key)
        self.mine.append(key)

    def _check(self, key: str, obj: Any, expect: int | None = None) -> None:
        try:
            crc = verify(obj)
            if expect is not None:
                assert crc == expect, "CRC differs from the one journalled at put"
        except AssertionError as exc:
            self.note("CORRUPT", key, str(exc).replace(" ", "_"))
            raise

    def get(self) -> None:
        if not self.mine:
            return
        key = self.rng.choice(self.mine)
        self._check(key, self.store.get(key))

    def get_other(self) -> None:
        keys = self.store.keys()
        if keys:
            key = self.rng.choice(keys)
            self._check(key, self.store.get(key))

    def delete(self) -> None:
        if not self.mine:
            return
        key = self.mine.pop(self.rng.randrange(len(self.mine)))
        while key in self.pinned:
            self.pinned.remove(key)
            self.store.unpin(key)
        self.note("D", key)
        self.current = ("delete", key)
        self.store.delete(key)
        self.note("d", key)

    def read(self) -> None:
        if not self.mine:
            return
        key = self.rng.choice(self.mine)
        with self.store.open_reader(key) as r:
            parts = []
            while True:
                b = r.read(self.rng.choice([1000, 100_000, 1 << 20]))
                if not b:
                    break
                parts.append(b)
        data = b"".join(parts)
        info = self.store.get_info(key)
        if info.kind == "bytes":
            self._check(key, data)

    def pin(self) -> None:
        if self.pinned and self.rng.random() < 0.5:
            self.store.unpin(self.pinned.pop())
        elif self.mine:
            key = self.rng.choice(self.mine)
            self.store.pin(key)
            self.pinned.append(key)

    def hold(self) -> None:
        if self.mine and len(self.held) < 8:
            key = self.rng.choice(self.mine)
            obj = self.store.get(key)
            self._check(key, obj)
            if isinstance(obj, np.ndarray) and len(obj) > 40:
                obj = self.store.get(key, conditions=(slice(16, 40),))
            self.held.append(obj)

    def drop(self) -> None:
        if self.held:
            h = self.held.pop(self.rng.randrange(len(self.held)))
            if isinstance(h, shmstore.Writer):
                h.abort()

    def move(self) -> None:
        if self.mine:
            key = self.rng.choice(self.mine)
            if self.rng.random() < 0.5:
                self._check(key, self.store.get(key, levels=[Level.MEMORY]))
            else:
                self.store.move(key, Level.DISK)

    def look(self) -> None:
        self.store.get_capacity()
        self.store.list()


def worker_main(args: argparse.Namespace) -> int:
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the run asks for the stack of a stuck worker
    rng = random.Random(f"{args.seed}-{args.tag}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is caught from the first operation on
    with shmstore.connect(args.name, capacity=args.capacity, spill_dir=args.spill_dir, lock_timeout=30,
                          spill_timeout=30, prefault=0, max_objects=args.max_objects) as store:
        worker = Worker(store, args.journal, rng, args.tag)
        signal.signal(signal.SIGINT, worker.on_sigint)  # a program's own handler (the store wraps it)
        signal.signal(signal.SIGUSR2, worker.on_pause)
        open(worker.ready, "w").close()  # Ctrl-C and pauses from now on
        print("ready", flush=True)
        worker.run()
    return 0


# ---- the run -----------------------------------------------------------------

def _explain(store: shmstore.Store, problems: list[str]) -> list[str]:
    """What the entries named by check()'s problems hold now (the owner of a leaked extent, the entry of a spill
    file no object explains), and the spill process's state: what a failure left behind, for its report."""
    import re

    from shmstore.node.repair import valid_extents
    node = store.node_store
    buf, lay = node.buf, node.layout
    n, _ = L.extent_cursor(buf)
    ext = L.extent_table(buf, lay)[:n]
    keep, _ = valid_extents(buf, lay)
    entries = {int(ext["owner"][rec - 1]) - 1
               for rec in set((1 + np.flatnonzero(ext["flags"] == L.EXT_USED)).tolist()) - set(keep.tolist())}
    entries |= {int(m.group(1)) for p in problems for m in [re.match(r"spill file (\d+)\.\d+(\.tmp)? ", p)] if m}
    out = [f"entry {i} is now {L.entry(buf, lay.entry(i))}" for i in sorted(entries) if 0 <= i < lay.max_objects]
    return out + [f"spill state: {L.unpack_spill_state(buf)}"]

class Journal:
    """What the workers' journals say about every key."""

    def __init__(self) -> None:
        self.crc: dict[str, int] = {}
        self.state: dict[str, str] = {}   # P put begun, p put returned, F put failed, D delete begun, d deleted,
        #                                   O overwrite begun (o returned, f failed: back to p)
        self.old: dict[str, int] = {}     # the CRC an overwrite begun replaces
        self.where: dict[str, str] = {}   # the store (incarnation) of each key
        self.interrupts = 0               # Ctrl-Cs the workers caught

    def read(self, path: str) -> None:
        where = ""
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 2 or not line.endswith("\n"):
                    continue  # a line cut by the kill
                op, key = parts[0], parts[1]
                if op == "S":
                    where = key
                    continue
                if op in ("I", "i"):  # a Ctrl-C caught (the outcome of what it cut short follows), or one between
                    self.interrupts += op == "I"  # two operations
                    continue
                self.where[key] = where
                if op == "CORRUPT":
                    raise AssertionError(f"worker read corrupt {key!r}: {' '.join(parts[2:])}")
                if op == "P":
                    self.crc[key] = int(parts[2])
                elif op == "O":
                    self.old[key], self.crc[key] = self.crc[key], int(parts[2])
                elif op in ("o", "f"):
                    if key in self.old:  # (an interrupt may come before the "O" line)
                        old = self.old.pop(key)
                        self.crc[key] = old if op == "f" else self.crc[key]
                    op = "p"
                self.state[key] = op


class Chaos:
    """One chaos run over one store name (see the module docstring)."""

    def __init__(self, seed: int, workers: int = 4, capacity: str = "16MiB", kill_spill: bool = True,
                 max_objects: int = 65536, log: Callable[[str], None] = print, unlink_every: int = 0,
                 interrupts: bool = True) -> None:
        self.seed, self.nworkers, self.capacity, self.kill_spill = seed, workers, capacity, kill_spill
        self.interrupts = interrupts  # Ctrl-C to workers, which catch it and go on
        self.max_objects = max_objects  # small: the table runs out and clients take entries from each other
        self.unlink_every = unlink_every  # rounds between two unlinks of the store's names (0: never)
        self.rng = random.Random(seed)
        self.log = log
        self.name = f"chaos{uuid.uuid4().hex[:8]}"
        self.dir = tempfile.mkdtemp(prefix="shmstore-chaos-")
        self.spill_dir = os.path.join(self.dir, "spill")
        os.mkdir(self.spill_dir)
        self.procs: dict[int, subprocess.Popen] = {}
        self.incarnation = 0
        self.kills = {"worker SIGKILL": 0, "worker SIGTERM": 0, "worker SIGINT": 0, "spill SIGKILL": 0,
                      "spill SIGTERM": 0, "names unlinked": 0}
        self.caught = 0  # Ctrl-Cs the workers caught and went on after (their journals)
        self.store: shmstore.Store | None = None  # the store that has the name
        self.old: list[shmstore.Store] = []       # stores whose names were unlinked this round, still in use
        self.journal = Journal()
        self.checked = 0

    def _connect(self) -> shmstore.Store:
        return shmstore.connect(self.name, capacity=self.capacity, spill_dir=self.spill_dir, lock_timeout=30,
                                spill_timeout=30, prefault=0, max_objects=self.max_objects)

    # ---- processes ------------------------------------------------------------
    def _spawn(self, wid: int) -> None:
        self.incarnation += 1
        tag = f"w{wid}i{self.incarnation}"
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--name", self.name, "--tag", tag,
               "--seed", str(self.seed), "--capacity", self.capacity, "--spill-dir", self.spill_dir,
               "--max-objects", str(self.max_objects), "--journal", os.path.join(self.dir, tag + ".log")]
        env = dict(os.environ, PYTHONPATH=ROOT)
        # files, not pipes: a spill process the worker starts inherits its stderr and outlives it
        with open(os.path.join(self.dir, tag + ".err"), "wb") as err:
            self.procs[wid] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                               stderr=err, env=env)
        self.procs[wid].tag = tag  # type: ignore[attr-defined]

    def _reap(self, p: subprocess.Popen, expect_killed: bool) -> None:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.returncode not in (-signal.SIGKILL, -signal.SIGTERM) or not expect_killed:
            with open(os.path.join(self.dir, p.tag + ".err"), "rb") as f:  # type: ignore[attr-defined]
                err = f.read().decode(errors="replace")
            raise AssertionError(f"worker {p.tag} exited with {p.returncode} (seed {self.seed}):\n"  # type: ignore
                                 f"{err[-4000:]}")

    def _kill_worker(self, sig: int) -> None:
        wid = self.rng.randrange(self.nworkers)
        p = self.procs[wid]
        if p.poll() is not None:
            self._reap(p, expect_killed=False)
        if self.rng.random() < 0.5:
            self._wait_for_a_move(0.3)
        p.send_signal(sig)
        self._reap(p, expect_killed=True)
        self.kills["worker " + signal.Signals(sig).name] += 1
        self._spawn(wid)

    def _check_beside_live_workers(self) -> None:
        """Pause the workers (between two operations, still attached: whatever a Ctrl-C they caught left,
        nobody has cleaned up), then check every store: no lock held, no half update (``check()`` takes
        every lock, and counts the live workers' pins)."""
        ready = [p for p in self.procs.values()
                 if p.poll() is None and os.path.exists(os.path.join(self.dir, p.tag + ".ready"))]  # type: ignore
        for p in ready:
            p.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 30
        for p in ready:
            paused = os.path.join(self.dir, p.tag + ".paused")  # type: ignore[attr-defined]
            while not os.path.exists(paused) and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if p.poll() is not None:
                self._reap(p, expect_killed=False)
            if not os.path.exists(paused):
                p.send_signal(signal.SIGUSR1)  # its stack, in its .err (faulthandler)
                time.sleep(0.5)
                with open(os.path.join(self.dir, p.tag + ".err"), "rb") as f:  # type: ignore[attr-defined]
                    stack = f.read().decode(errors="replace")[-3000:]
                raise AssertionError(f"worker {p.tag} did not get to its next operation within 30 s: stuck "  # type: ignore
                                     f"(a lock it holds?) (seed {self.seed}):\n{stack}")
        for store in [*self.old, self.store]:
            assert store is not None
            problems = store.check()
            if problems:
                raise AssertionError(f"store.check() beside live workers that caught Ctrl-Cs (seed {self.seed}):"
                                     f"\n  " + "\n  ".join(problems[:30] + _explain(store, problems)))

    def _interrupt_workers(self) -> None:
        """Ctrl-C a few times to random workers (half of the time while a move is in flight), at random
        moments: they catch it and go on; each one SIGKILLed later is reclaimed as ever."""
        if self.rng.random() < 0.5:
            self._wait_for_a_move(0.2)
        for _ in range(self.rng.randint(1, 6)):
            p = self.procs[self.rng.randrange(self.nworkers)]
            if p.poll() is None and os.path.exists(os.path.join(self.dir, p.tag + ".ready")):  # type: ignore
                p.send_signal(signal.SIGINT)
                self.kills["worker SIGINT"] += 1
            time.sleep(self.rng.uniform(0, 0.02))

    def _wait_for_a_move(self, seconds: float) -> None:
        """Wait (a while at most) for the spill process to be moving an object: the worker killed then may be
        reading, pinning, overwriting or deleting that very object."""
        buf = self.store.node_store.buf
        deadline = time.monotonic() + seconds
        while not L.unpack_spill_state(buf).moving and time.monotonic() < deadline:
            time.sleep(0.001)

    def _kill_spill(self, sig: int) -> None:
        pid = self.store.status()["spill"]["pid"] if self.store is not None else 0
        if pid > 0:
            try:
                os.kill(pid, sig)
                self.kills["spill " + signal.Signals(sig).name] += 1
            except ProcessLookupError:
                pass

    def _unlink_names(self) -> None:
        """Unlink the store's names in /dev/shm behind its back, as ``rm`` or a cleaner would, and make a new
        store under the name at once.

        The old store goes on serving its clients (the workers alive now, this
        run); workers started from now on use the new one, and both spill into
        the same directory. The old store keeps a live spill process (started
        again if it was killed, then never killed): a spill process started
        later would open the new store by name, so the old store could not
        have one again.
        """
        old = self.store
        assert old is not None
        self._serving(old)
        prefix = old.node_store.prefix.lstrip("/")
        for path in (f"/dev/shm/{prefix}-meta", f"/dev/shm/{prefix}-arena", f"/dev/shm/sem.{prefix}-wake"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.kills["names unlinked"] += 1
        self.old.append(old)
        self.store = self._connect()

    # ---- rounds ----------------------------------------------------------------
    def round(self, seconds: float, unlink: bool = False) -> None:
        for wid in range(self.nworkers):
            if wid not in self.procs or self.procs[wid].poll() is not None:
                if wid in self.procs:
                    self._reap(self.procs[wid], expect_killed=False)
                self._spawn(wid)
        start = time.monotonic()
        end, unlink_at = start + seconds, start + self.rng.uniform(0.2, 0.8) * seconds if unlink else None
        while time.monotonic() < end:
            time.sleep(self.rng.uniform(0.05, 0.5))
            for p in self.procs.values():
                if p.poll() is not None:
                    self._reap(p, expect_killed=False)
            if unlink_at is not None and time.monotonic() > unlink_at:
                unlink_at = None
                self._unlink_names()
                continue
            if self.interrupts:
                self._interrupt_workers()
            r = self.rng.random()
            if r < 0.55:
                self._kill_worker(signal.SIGKILL)
            elif r < 0.65:
                self._kill_worker(signal.SIGTERM)
            elif self.kill_spill and r < 0.8:
                self._kill_spill(signal.SIGKILL)
            elif self.kill_spill and r < 0.85:
                self._kill_spill(signal.SIGTERM)
        if self.interrupts:
            self._check_beside_live_workers()
        for p in self.procs.values():  # the round ends as hostile as it ran
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs.values():
            self._reap(p, expect_killed=True)
        self.procs.clear()
        self.verify()

    def _settle_spill(self, store: shmstore.Store) -> dict[str, Any]:
        """Wait for a live spill process (started again if it was killed) past its recovery: a fresh heartbeat."""
        deadline = time.monotonic() + 60
        while True:
            _ = store.spill_pid  # restarts it if it was killed
            st = store.status()
            if st["spill"]["alive"] and st["spill"]["pid"] > 0 and time.time() - st["spill"]["heartbeat"] < 0.5:
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"no spill process serves the store within 60 s (seed {self.seed}): {st}")
            time.sleep(0.05)

    def _serving(self, store: shmstore.Store) -> None:
        """Wait for the store's spill process to go round its loop twice from now: one that a SIGTERM
        stopped drains and exits at the end of the round it is in, and once the store's names are gone no
        other can be started for it."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pid = self._settle_spill(store)["spill"]["pid"]
            if self._beats(store, pid, 2, deadline):
                return
        raise AssertionError(f"no spill process goes round its loop within 60 s (seed {self.seed})")

    @staticmethod
    def _beats(store: shmstore.Store, pid: int, n: int, deadline: float) -> bool:
        """Whether spill process ``pid`` beats ``n`` times from now (False if it goes, or at the deadline)."""
        last = time.time()
        while n:
            st = store.status()["spill"]
            if st["pid"] != pid or not st["alive"] or time.monotonic() > deadline:
                return False
            if st["heartbeat"] > last:
                last, n = st["heartbeat"], n - 1
            else:
                time.sleep(0.02)
        return True

    def _settle(self, store: shmstore.Store) -> None:
        """Wait for a live spill process to reclaim every dead worker and finish recovery."""
        deadline = time.monotonic() + 60
        while True:
            st = self._settle_spill(store)
            if not [c for c in st["clients"] if c["pid"] != os.getpid()]:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"dead workers not reclaimed within 60 s (seed {self.seed}): {st}")
            time.sleep(0.05)

    def verify(self) -> None:
        journal = Journal()
        for name in sorted(os.listdir(self.dir)):
            if name.endswith(".log"):
                journal.read(os.path.join(self.dir, name))
        for key, state in self.journal.state.items():  # the run's own deletes
            journal.state[key] = state
        self.journal = journal
        self.caught = journal.interrupts
        assert self.store is not None
        for store in [*self.old, self.store]:  # every store of the name this run holds
            self._settle(store)
            self._verify_store(store)
        while self.old:  # stores whose names went: they go now, with their own files only
            self._retire(self.old.pop())

    def _verify_store(self, store: shmstore.Store) -> None:
        journal, here = self.journal, store_id(store)
        listed = {i.key: i for i in store.list()}
        for key in listed:
            if key not in journal.state or journal.where.get(key) != here:
                raise AssertionError(f"{key!r} is visible but no worker of this store put it (seed {self.seed})")
        for key, state in journal.state.items():
            if journal.where.get(key) != here:
                continue  # another store's: gone with it, or checked there
            present = key in listed
            if state in ("p", "O") and not present:
                what = "overwritten" if state == "O" else "put"
                raise AssertionError(f"{key!r} was {what} and never deleted, but is gone (seed {self.seed})")
            if state in ("d", "F") and present:
                after = "delete returned" if state == "d" else "put failed"
                raise AssertionError(f"{key!r} is visible after its {after}"
                                     f" (seed {self.seed})")
            if present:
                self._read_back(store, key, state)
        problems = store.check()
        if problems:
            raise AssertionError(f"store.check() after round (seed {self.seed}):\n  "
                                 + "\n  ".join(problems[:30] + _explain(store, problems)))
        self._check_capacity(store)
        self._trim(store, listed)

    def _read_back(self, store: shmstore.Store, key: str, state: str) -> None:
        journal = self.journal
        try:
            obj = store.get(key)
        except shmstore.ObjectNotFoundError:
            raise AssertionError(f"{key!r} is listed but get() does not find it: a ghost "
                                 f"(seed {self.seed})") from None
        try:
            crc = verify(obj)
        except AssertionError as exc:
            raise AssertionError(f"{key!r} reads back damaged: {exc} (seed {self.seed})") from None
        if crc != journal.crc[key] and not (state == "O" and crc == journal.old[key]):
            raise AssertionError(f"{key!r} reads back another value than was put (seed {self.seed})")
        del obj
        self.checked += 1

    def _retire(self, store: shmstore.Store) -> None:
        """Let a store whose names went go: its spill process removes it, its own files and nothing else."""
        pid = store.spill_pid
        store.close()
        deadline = time.monotonic() + 20
        while pid_running(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if pid_running(pid):
            raise AssertionError(f"the spill process of a store whose names went stays (seed {self.seed})")

    def _check_capacity(self, store: shmstore.Store) -> None:
        """Each level's used bytes equal its objects', read while the spill process is idle."""
        for _ in range(200):  # a background spill may run between the two looks: look again
            cap = store.get_capacity()
            infos = store.list()
            want = {lv: sum(i.stored for i in infos if i.level == lv) for lv in (Level.MEMORY, Level.DISK)}
            if all(cap[lv].used == want[lv] and cap[lv].objects == sum(i.level == lv for i in infos)
                   for lv in want):
                return
            time.sleep(0.02)
        raise AssertionError(f"get_capacity() {cap} does not match the objects {want} (seed {self.seed})")

    def _trim(self, store: shmstore.Store, listed: dict) -> None:
        """Delete some objects so that the store keeps spilling rather than filling up."""
        for key in list(listed):
            if self.rng.random() < 0.5:
                self.journal.state[key] = "D"
                try:
                    store.delete(key)
                except shmstore.ObjectNotFoundError:
                    pass
                self.journal.state[key] = "d"

    # ---- the whole run ----------------------------------------------------------
    def run(self, rounds: int | None = None, seconds: float = 10.0, hours: float | None = None,
            until: Callable[[dict[str, Any]], bool] | None = None, max_rounds: int | None = None) -> dict:
        """Run ``rounds`` rounds (for ``hours`` where None); with ``until``, then more, one at a time, until
        ``until`` holds for the result so far, ``max_rounds`` at most: what a test needs to have happened
        (kills, reads verified) bounded by counts, not by how much a round of ``seconds`` fits on this
        machine."""
        self.log(f"chaos: seed {self.seed}, {self.nworkers} workers, capacity {self.capacity}, "
                 f"max_objects {self.max_objects}, names unlinked every {self.unlink_every or 'no'} round(s), "
                 f"store {self.name}")
        stop = time.monotonic() + hours * 3600 if hours else None
        n = 0
        prefix = f"shmstore-{os.getuid()}-{self.name}-"
        try:
            self.store = self._connect()
            while (rounds is None or n < rounds or (until is not None and not until(self._result(n))
                                                   and (max_rounds is None or n < max_rounds))) \
                    and (stop is None or time.monotonic() < stop):
                self.round(seconds, unlink=bool(self.unlink_every) and (n + 1) % self.unlink_every == 0)
                n += 1
                self.log(f"chaos: round {n} ok: {self.checked} reads verified, kills {self.kills}, "
                         f"{self.caught} Ctrl-Cs caught")
            self.store.close()
            self.store = None
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and (_leftovers(prefix) or _files(self.spill_dir)):
                time.sleep(0.05)
            left = _leftovers(prefix) + _files(self.spill_dir)
            if left:
                raise AssertionError(f"left behind after every process exited (seed {self.seed}): {left}")
        finally:
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for store in [*self.old, self.store]:
                if store is not None:
                    store.close()
            shmstore.destroy(self.name, force=True)
            if os.environ.get("SHMSTORE_CHAOS_KEEP") and sys.exc_info()[0] is not None:
                self.log(f"chaos: the workers' journals and stderr are kept in {self.dir}")
                shutil.rmtree(self.spill_dir, ignore_errors=True)
            else:
                shutil.rmtree(self.dir, ignore_errors=True)
        return self._result(n)

    def _result(self, rounds: int) -> dict[str, Any]:
        return {"seed": self.seed, "rounds": rounds, "verified": self.checked, "kills": dict(self.kills),
                "interrupts caught": self.caught}


def _files(spill_dir: str) -> list[str]:
    """What is left in the spill directory, but the spill processes' logs (which outlive their stores)."""
    return [f for f in os.listdir(spill_dir) if not f.endswith(".log")]


def pid_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def _leftovers(prefix: str) -> list[str]:
    return [e for e in os.listdir("/dev/shm") if e.startswith(prefix) or e.startswith("sem." + prefix)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None, help="default 20, or unlimited with --hours")
    p.add_argument("--seconds", type=float, default=10.0, help="length of a round")
    p.add_argument("--hours", type=float, default=None)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--capacity", default="16MiB")
    p.add_argument("--max-objects", type=int, default=65536, help="small values make clients steal table entries")
    p.add_argument("--no-spill-kills", action="store_true", help="never kill the spill process")
    p.add_argument("--no-interrupts", action="store_true", help="never send workers SIGINT")
    p.add_argument("--unlink-every", type=int, default=3, metavar="N",
                   help="unlink the store's names behind its back once every N rounds (0: never)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--name", "--tag", "--spill-dir", "--journal"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    rounds = args.rounds if args.rounds is not None or args.hours else 20
    result = Chaos(seed, args.workers, args.capacity, not args.no_spill_kills, args.max_objects,
                   unlink_every=args.unlink_every, interrupts=not args.no_interrupts).run(rounds, args.seconds,
                                                                                          args.hours)
    print(json.dumps(result) if args.json else f"chaos: passed: {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
