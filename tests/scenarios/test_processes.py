"""Several real processes on one store, and processes killed with SIGKILL."""
from __future__ import annotations

import mmap
import os
import random
import signal
import threading
import time

import numpy as np
import pytest

import shmstore
from shmstore import Level
from shmstore.config import Config
from shmstore.meta import layout as L

from helpers import Child, check_arena, shm_segments, spill_processes, spill_running, wait_for

CONNECT = "import shmstore, numpy as np, os, sys\nstore = shmstore.connect(os.environ['N'], capacity='64MiB')\n"


def used(store) -> int:
    return store.get_capacity()[Level.MEMORY].used


def test_processes_share_objects_both_ways(store):
    store.put("from-parent", np.arange(1000))
    child = Child(CONNECT + """
print(int(store.get('from-parent').sum()), flush=True)
store.put('from-child', {'w': np.full(10, 7.0), 'pid': os.getpid()})
print('done', flush=True)
sys.stdin.readline()
""", env={"N": store.name})
    assert child.readline() == str(sum(range(1000)))
    assert child.readline() == "done"
    got = store.get("from-child")
    assert got["pid"] == child.pid and got["w"].sum() == 70
    assert len(store.status()["clients"]) == 2
    child.send("exit")
    child.wait()


def test_killed_writer_leaves_nothing_visible_and_space_comes_back(store):
    child = Child(CONNECT + """
w = store.open_writer('partial', 8 << 20)
w.write(b'x' * (4 << 20))
print('half', flush=True)
sys.stdin.readline()
""", env={"N": store.name})
    assert child.readline() == "half"
    assert "partial" not in store and used(store) >= 8 << 20
    with pytest.raises(shmstore.ObjectLockedError):
        store.put("partial", 1)
    child.kill()
    assert wait_for(lambda: used(store) == 0, timeout=10), "dead writer's space not reclaimed"
    store.put("partial", b"complete")
    assert bytes(store.get("partial")) == b"complete"


def test_killed_reader_releases_its_pins(store):
    store.put("a", np.ones(1 << 20))
    child = Child(CONNECT + """
view = store.get('a')
store.pin('a')
r = store.open_reader('a')
print('pinned', flush=True)
sys.stdin.readline()
""", env={"N": store.name})
    assert child.readline() == "pinned"
    assert store.get_info("a").pins == 1
    store.delete("a")
    assert used(store) > 0  # still mapped by the child
    child.kill()
    assert wait_for(lambda: used(store) == 0, timeout=10), "dead reader's pins not released"


@pytest.mark.parametrize("lock", ["stripe", "alloc", "admin"])
def test_process_killed_holding_a_lock_does_not_block_the_store(store, lock):
    store.put("before", np.arange(10))
    child = Child(CONNECT + f"""
node = store.node_store
if {lock!r} == 'stripe':
    lk = node.stripes[node.table.locate(store.kernel.sid, b'victim')[2]]
elif {lock!r} == 'alloc':
    lk = node.alloc_lock
else:
    lk = node.admin
lk.acquire()
if {lock!r} == 'alloc':  # die in the middle of an update: an extent nobody owns
    node.alloc.alloc(1 << 20, 0)
print('locked', flush=True)
sys.stdin.readline()
""", env={"N": store.name})
    assert child.readline() == "locked"
    child.kill()
    store.put("victim", np.arange(5))  # needs the stripe and alloc locks
    np.testing.assert_array_equal(store.get("victim"), np.arange(5))
    with shmstore.connect(store.name) as other:  # needs the admin lock
        assert other.get("before").sum() == 45
    infos = store.list()
    assert used(store) == sum(i.stored for i in infos)
    check_arena(store.node_store)
    store.clear()
    assert used(store) == 0


@pytest.mark.parametrize("first", ["get", "put"])
def test_first_verb_after_a_stripe_holder_died_repairs_that_stripe(store, first):
    """The C fast paths report a dead holder of the key's stripe lock; the caller repairs that stripe."""
    store.put("victim", np.arange(7))
    child = Child(CONNECT + """
node = store.node_store
node.stripes[node.table.locate(store.kernel.sid, b'victim')[2]].acquire()
print('locked', flush=True)
sys.stdin.readline()
""", env={"N": store.name})
    assert child.readline() == "locked"
    child.kill()
    if first == "get":
        np.testing.assert_array_equal(store.get("victim"), np.arange(7))
    else:
        with pytest.raises(shmstore.ObjectExistsError):
            store.put("victim", np.arange(3))
    stripe = store.node_store.stripes[store.node_store.table.locate(store.kernel.sid, b"victim")[2]]
    assert not stripe.locked()
    np.testing.assert_array_equal(store.get("victim"), np.arange(7))
    store.delete("victim")
    assert used(store) == 0


def test_allocator_rebuilt_after_death_mid_update_covers_arena(store):
    child = Child(CONNECT + """
node = store.node_store
store.put('keep', np.ones(1000))
node.alloc_lock.acquire()
node.alloc.alloc(3 << 20, 0)
print('locked', flush=True)
sys.stdin.readline()
""", env={"N": store.name})
    assert child.readline() == "locked"
    child.kill()
    store.put("after", np.zeros(10))
    store.put("big-after", np.zeros(8 << 20, np.uint8))  # not from a chunk: the global allocator
    check_arena(store.node_store)
    np.testing.assert_array_equal(store.get("keep"), np.ones(1000))
    store.clear()
    assert wait_for(lambda: store.node_store.reclaim_retired() >= 0 and
                    store.node_store.alloc.free_extents()[-1][1] >= store.node_store.capacity - (2 << 20), timeout=10)


def test_job_exit_leaves_nothing_in_dev_shm(name):
    for how in ("exit", "kill"):
        child = Child(CONNECT + """
store.put('x', np.ones(1000))
print(store.spill_pid, flush=True)
sys.stdin.readline()
""", env={"N": name + how})
        spill = int(child.readline())
        assert any(name + how in s for s in shm_segments())
        if how == "exit":
            child.send("bye")
            child.wait()
        else:
            child.kill()
        assert wait_for(lambda how=how: not any(name + how in s for s in shm_segments()), timeout=10)
        assert wait_for(lambda spill=spill: not spill_running(spill), timeout=10)


def test_spill_process_is_restarted_when_killed(store):
    first = store.spill_pid
    os.kill(first, signal.SIGKILL)
    assert wait_for(lambda: not spill_running(first), timeout=10)
    second = store.spill_pid
    assert second != first and spill_running(second)
    # the new janitor still reclaims dead clients
    child = Child(CONNECT + "store.put('c', 1)\nv = store.open_writer('w', 1000)\nprint('ok', flush=True)\n"
                            "sys.stdin.readline()\n",
                  env={"N": store.name})
    assert child.readline() == "ok"
    child.kill()
    assert wait_for(lambda: len(store.status()["clients"]) == 1 and used(store) == store.get_info("c").stored,
                    timeout=10)


def test_concurrent_puts_from_two_processes(store):
    code = CONNECT + """
me = sys.argv[0]
tag = os.environ['TAG']
for i in range(1500):
    store.put(f'{tag}{i}', np.full(4, i))
for i in range(0, 1500, 7):
    store.delete(f'{tag}{i}')
print('done', flush=True)
"""
    kids = [Child(code, env={"N": store.name, "TAG": t}) for t in "ab"]
    for k in kids:
        assert k.readline(timeout=120) == "done"
        k.wait()
    keys = {i.key for i in store.list()}
    expect = {f"{t}{i}" for t in "ab" for i in range(1500) if i % 7}
    assert keys == expect
    assert store.get("b1499")[0] == 1499
    assert used(store) == sum(i.stored for i in store.list())


def test_racing_creators_share_one_store(name):
    code = """
import shmstore, os, sys
s = shmstore.connect(os.environ['N'], capacity='16MiB')
s.put(os.environ['TAG'], os.getpid())
print('put', flush=True)
sys.stdin.readline()
print(sorted(i.key for i in s.list()), flush=True)
s.close()
"""
    kids = [Child(code, env={"N": name, "TAG": f"k{i}"}) for i in range(4)]
    for k in kids:
        assert k.readline() == "put"
    for k in kids:
        k.send("go")
    for k in kids:
        assert k.readline() == str(["k0", "k1", "k2", "k3"])
        k.wait()
    assert wait_for(lambda: not any(name in s for s in shm_segments()), timeout=10)


SHORT_SCRIPT = """
import shmstore, os, random, sys, time, numpy as np
rng = random.Random(int(os.environ['SEED']))

def nap():  # half of the steps wait up to 2 ms first: other interleavings each run
    if rng.random() < 0.5:
        time.sleep(rng.random() * 0.002)

for i in range(int(os.environ['ROUNDS'])):
    nap()
    with shmstore.connect(os.environ['N'], capacity='16MiB') as s:
        if rng.random() < 0.5:
            continue  # a script that only looks: in and out as fast as it goes
        nap()
        key = f"{os.environ['TAG']}-{i}"
        value = np.full(1000 + i, i)
        s.put(key, value)
        nap()
        assert (s.get(key) == value).all()
        s.delete(key)
print('ok', flush=True)
"""


class Pauser:
    """Stops the children with SIGSTOP, as a busy node's scheduler does, made to happen on a quiet machine too:
    one at random for 1 to 20 ms, again and again, at whatever line it is; and the creator of each new store of
    ``name`` for 30 ms right as it publishes the store (its header says ``ready``: while the others attach and
    close around it). Signals go through pidfds, opened while the children surely live, so none reaches another
    process once a child is reaped and its pid reused."""

    def __init__(self, kids: list[Child], name: str, seed: int) -> None:
        self.fds = {k.pid: os.pidfd_open(k.pid) for k in kids}
        self.meta = f"/dev/shm/shmstore-{os.getuid()}-{name}-{Config.from_kwargs().node}-meta"
        self.rng, self.stop = random.Random(seed), threading.Event()
        self.threads = [threading.Thread(target=run, name=f"pauser-{i}", daemon=True)
                        for i, run in enumerate((self._at_random, self._at_creation))]
        for t in self.threads:
            t.start()

    def _at_random(self) -> None:
        while not self.stop.wait(self.rng.uniform(0, 0.005)):
            self._pause(self.rng.choice(list(self.fds.values())), self.rng.uniform(0.001, 0.02))

    def _at_creation(self) -> None:
        seen = None
        while not self.stop.wait(0.0002):
            try:
                fd = os.open(self.meta, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if st.st_ino != seen and st.st_size >= L.HEADER_SIZE:
                    seen = st.st_ino
                    with mmap.mmap(fd, L.HEADER_SIZE, prot=mmap.PROT_READ) as mm:
                        self._stop_its_creator(mm)
            finally:
                os.close(fd)

    def _stop_its_creator(self, mm: mmap.mmap) -> None:
        deadline = time.monotonic() + 0.1
        while L.HEAD.get(mm, "state") == L.STATE_INIT and time.monotonic() < deadline:
            time.sleep(0)  # a look every few us; the GIL goes to the others meanwhile
        fd = self.fds.get(L.HEAD.get(mm, "creator_pid"))
        if fd is not None and L.HEAD.get(mm, "state") == L.STATE_READY:
            self._pause(fd, 0.03)

    @staticmethod
    def _pause(fd: int, seconds: float) -> None:
        try:
            signal.pidfd_send_signal(fd, signal.SIGSTOP)
        except ProcessLookupError:  # it has exited
            return
        try:
            time.sleep(seconds)
        finally:
            try:
                signal.pidfd_send_signal(fd, signal.SIGCONT)
            except ProcessLookupError:  # SIGKILLed meanwhile (a failure's cleanup)
                pass

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)
        for fd in self.fds.values():
            os.close(fd)


@pytest.mark.slow
def test_short_scripts_coming_and_going_on_one_name_never_fail_or_leave_anything(name):
    """Six processes each connect and close one name 30 times, as short job steps do, half of the times putting,
    reading back and deleting a value in between, with random naps between the steps, while each process is
    stopped for a few ms at random moments: a close that finds the spill process still starting removes the
    store and stops that process while another process may be connecting or mid-put; every connect, put and get
    succeeds (a store removed under a connect is made anew), and nothing of the name or its spill processes is
    left at the end.

    Regression (issue 30, item 10): a creator published its store before it registered as its client; another
    process attached, did its work and closed as the store's only client, removing the store under its creator
    (``FileNotFoundError: no semaphore '/shmstore-...-wake'`` out of ``connect()``). And a connect that opened the
    arena of a store removed and made again meanwhile raised ``PermissionDeniedError: ... changed while it was
    opened``. Four processes, no naps, no stops (this test before): found in one whole-suite run of two, in 0 of 10
    runs alone under load; this test fails 10 runs of 10 on that code (the creator stopped as it publishes)."""
    seed = random.randrange(1 << 30)
    kids: list[Child] = []
    pauser = None
    try:
        for i in range(6):
            kids.append(Child(SHORT_SCRIPT, env={"N": name, "TAG": f"k{i}", "SEED": str(seed + i), "ROUNDS": "30"}))
        pauser = Pauser(kids, name, seed)
        for k in kids:
            try:
                assert k.readline(timeout=120) == "ok"
            except RuntimeError as exc:  # it failed: its traceback, and the seed of its naps
                raise AssertionError(f"seed {seed}: {exc}") from None
            k.wait()
    finally:
        if pauser is not None:
            pauser.close()
        for k in kids:
            k.kill()  # the others too, when one failed (reaped, their pipes closed: no descriptor left)
    assert wait_for(lambda: not any(name in s for s in shm_segments()), timeout=10)
    assert wait_for(lambda: not spill_processes(name), timeout=10), spill_processes(name)


def test_segments_are_owner_only_and_named_for_user_store_node(store):
    segs = [s for s in shm_segments() if store.name in s]
    assert len(segs) == 3  # metadata, arena, wake-up semaphore
    for seg in segs:
        assert f"-{os.getuid()}-{store.name}-{store.node}-" in seg
        assert os.stat("/dev/shm/" + seg).st_mode & 0o777 == 0o600


def test_emulated_nodes_never_share_memory(name):
    with shmstore.connect(name, capacity="8MiB", node="n0") as a, \
            shmstore.connect(name, capacity="8MiB", node="n1") as b:
        a.put("k", 0)
        b.put("k", 1)
        assert a.get("k") == 0 and b.get("k") == 1


def test_header_records_layout(store):
    h = L.unpack_header(store.node_store.meta.mm)
    assert h.magic == L.MAGIC and h.version == L.LAYOUT_VERSION and h.uid == os.getuid()
    assert h.name == store.name and h.node == store.node


def test_gc_removes_stores_whose_processes_all_died(name, tmp_path):
    child = Child(CONNECT.replace("capacity='64MiB'", f"capacity='16MiB', spill_dir={str(tmp_path)!r}") + """
store.put('x', b'y' * 100, levels=[shmstore.Level.DISK])
print(store.spill_pid, flush=True)
sys.stdin.readline()
""", env={"N": name})
    spill = int(child.readline())
    os.kill(spill, signal.SIGKILL)  # the whole job goes down, its spill process too
    child.kill()
    assert wait_for(lambda: not spill_running(spill), timeout=10)
    assert any(name in s for s in shm_segments())
    with shmstore.connect(name + "live", capacity="8MiB") as live:
        removed = shmstore.collect_stale()
        assert any(r.startswith(name + "@") for r in removed)
        assert not any(r.startswith(name + "live@") for r in removed)
        assert live.get_capacity()  # untouched
    assert not any(name + "-" in s for s in shm_segments())
    assert not os.listdir(tmp_path)  # its spill files went too


def test_threads_share_one_connection(store):
    import threading
    errors = []

    def work(t: int) -> None:
        try:
            for i in range(300):
                store.put(f"t{t}-{i}", np.full(16, t * 1000 + i))
                v = store.get(f"t{(t + 1) % 4}-{i}") if f"t{(t + 1) % 4}-{i}" in store else None
                assert v is None or v[0] == ((t + 1) % 4) * 1000 + i
                if i % 3 == 0:
                    store.delete(f"t{t}-{i}")
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors
    infos = store.list()
    assert len(infos) == 4 * 200
    assert used(store) == sum(i.stored for i in infos)


def test_threads_putting_small_values_across_chunks_lose_nothing(name):
    """Small puts cut their bytes from the client's current chunk (the C put_small, under the client's chunk
    lock): four threads of one connection putting values of every small size, through many chunk changes,
    each deleting some and reading its neighbour's, leave every value whole and the accounting exact."""
    import threading
    import traceback
    import zlib
    errors: list[str] = []
    with shmstore.connect(name, capacity="64MiB") as store:
        small = min(store.kernel.node.small_max, 8192)  # ~13 MB in all: a dozen chunks, nothing spilled
        sizes = np.random.default_rng(7).integers(1, small + 1, 4 * 800)

        def value(t: int, i: int) -> bytes:
            n = int(sizes[t * 800 + i])
            return (bytes([t, i % 251]) * (n // 2 + 1))[:n]

        def work(t: int) -> None:
            try:
                for i in range(800):
                    store.put(f"t{t}-{i}", value(t, i))
                    if i % 4 == 0:
                        store.delete(f"t{t}-{i}")
                    other = f"t{(t + 1) % 4}-{i}"
                    got = store.get(other, None)
                    assert got is None or zlib.crc32(got) == zlib.crc32(value((t + 1) % 4, i))
                    del got
            except BaseException:  # surfaced below (as text: a traceback would keep views, and the store, alive)
                errors.append(traceback.format_exc())

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not errors and not any(th.is_alive() for th in threads)
        assert store.check() == []
        infos = store.list()
        assert len(infos) == 4 * 600
        for info in infos:
            t, i = map(int, info.key[1:].split("-"))
            assert bytes(store.get(info.key)) == value(t, i)
        assert used(store) == sum(i.stored for i in infos)


def _in_child(body) -> int:
    """Run ``body()`` in a forked child; its exit code (1 where it raised, with the error on stderr)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if body() is not False else 1
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_store_opened_before_fork_just_works_in_the_child(store):
    """A Store opened before fork() (a torch Dataset that keeps its store, a multiprocessing fork pool): the
    child becomes a client of its own on first use; the parent's connection is unharmed (issue 35 item 2)."""
    store.put("a", np.arange(100))
    clients = len(store.node_store.clients())

    def child():
        assert int(store.get("a")[7]) == 7
        store.put("from-child", np.ones(10))
        assert store.node_store.clients() and len(store.node_store.clients()) == clients + 1
        store.delete("from-child")
        store.close()

    assert _in_child(child) == 0
    assert int(store.get("a")[7]) == 7 and "from-child" not in store  # the parent's connection is unharmed
    assert wait_for(lambda: len(store.node_store.clients()) == clients, timeout=30)  # the child's slot went
    assert store.check() == []


def test_a_child_dropping_its_copy_of_a_view_leaves_the_parents_pin(store):
    """The child's copy of a view the parent holds: dropping it cleared the parent's pin byte, and the parent's
    view could then be deleted or moved under it (fails on 87ee323: pinned False after the child)."""
    import gc
    store.put("a", np.arange(100))
    view = store.get("a")
    assert store.get_info("a").pinned

    def child():
        nonlocal view
        del view
        gc.collect()

    assert _in_child(child) == 0
    assert store.get_info("a").pinned
    store.delete("a")  # hidden; its space waits for the parent's view
    assert int(view[99]) == 99 and store.check() == []
    del view


def test_a_child_dropping_its_copy_of_a_writer_leaves_the_parents_write(store, tmp_path):
    """An unsealed writer (on disk: a spill file being written) copied into a child that drops it: the
    parent's entry and file are untouched, and its writer seals."""
    import gc
    with shmstore.connect(store.name + "w", capacity="16MiB", spill_dir=str(tmp_path)) as s:
        for level in (shmstore.Level.MEMORY, shmstore.Level.DISK):
            w = s.open_writer(f"w{level.name}", 8, levels=[level])
            w.write(b"abcd")

            def child():
                nonlocal w
                del w
                gc.collect()

            assert _in_child(child) == 0
            w.write(b"efgh")
            w.close()
            assert bytes(s.get(f"w{level.name}")) == b"abcdefgh"
        assert s.check() == []


def _pool_task(i: int) -> int:
    return int(_POOL_STORE[0].get("data")[i]) + len(_POOL_STORE[0].list())


_POOL_STORE: list = []


def _pool_init(s) -> None:
    _POOL_STORE[:] = [s]  # spawn, forkserver: the Store comes pickled (its settings) and connects


def _pool_map(store, method: str, task, items, workers: int) -> list:
    """``task`` over ``items`` in a multiprocessing pool of start method ``method`` whose workers use ``store``
    (inherited under fork, pickled under forkserver and spawn); multiprocessing's own helpers are stopped after
    (they would outlive the test: the leak check counts them)."""
    import multiprocessing
    _POOL_STORE[:] = [store]
    try:
        init = (None, ()) if method == "fork" else (_pool_init, (store,))
        with multiprocessing.get_context(method).Pool(workers, *init) as pool:
            return pool.map(task, items, chunksize=5)
    finally:
        _POOL_STORE.clear()
        if method != "fork":
            from multiprocessing import forkserver, resource_tracker
            forkserver._forkserver._stop()
            resource_tracker._resource_tracker._stop()


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_a_pool_uses_the_store_its_parent_opened(store, method):
    """multiprocessing's pools (a DataLoader's workers are fork ones), each worker using the parent's Store:
    inherited under fork, pickled under forkserver and spawn."""
    store.put("data", np.arange(1000))
    view = store.get("data")
    got = _pool_map(store, method, _pool_task, range(0, 1000, 7), 3)
    assert got == [i + 1 for i in range(0, 1000, 7)]
    assert store.get_info("data").pinned and int(view[-1]) == 999
    clients = 1
    assert wait_for(lambda: len(store.node_store.clients()) == clients, timeout=30)  # the workers' slots went
    assert store.check() == []
    del view


def _pool_restore(i: int) -> int:
    got = _POOL_STORE[0].restore("ck")
    a = got["a"]
    assert not a.flags.writeable and got.origins["a"] == "store"  # a view of the node's copy
    return int(a[i])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_checkpoints_through_a_store_opened_before_fork_and_in_pool_workers(name, tmp_path, method):
    """Issue 34 under fork-based loaders: a process checkpoints, its pool's workers (fork, forkserver, spawn;
    a DataLoader's are fork ones) restore it from the node's store as views; a forked child checkpoints with
    the Store it inherited and the parent restores that one, from the store and from the folder after."""
    pdir = str(tmp_path / "ck")
    a = np.arange(100_000)
    with shmstore.connect(name, capacity="64MiB", persist_dir=pdir) as store:
        assert store.checkpoint("ck", {"a": a, "meta": {"step": 1}}).wait(60)
        got = _pool_map(store, method, _pool_restore, range(0, 100_000, 997), 2)
        assert got == list(range(0, 100_000, 997))
        if method == "fork":
            def child():
                r = store.restore("ck")
                assert int(r["a"][99_999]) == 99_999 and r["meta"] == {"step": 1}
                del r
                assert store.checkpoint("ck2", {"a": a * 2, "meta": {"step": 2}}).wait(60)
                store.close()

            assert _in_child(child) == 0
            r = store.restore()
            assert r.name == "ck2" and r["meta"] == {"step": 2} and bool((r["a"] == a * 2).all())
            assert r.origins["a"] == "store"  # (origins: of the keys read)
            del r
        assert wait_for(lambda: len(store.node_store.clients()) == 1, timeout=30)  # the children's slots went
        assert store.check() == []
    shmstore.destroy(name)
    with shmstore.connect(name, capacity="16MiB", persist_dir=pdir) as store:
        r = store.restore()
        assert r.name == ("ck2" if method == "fork" else "ck")
        assert bool((r["a"] == (a * 2 if method == "fork" else a)).all()) and r.origins["a"] == "folder"
        del r


def test_lock_held_by_a_stopped_process_times_out_clearly(name):
    with shmstore.connect(name, capacity="8MiB", lock_timeout=0.5) as s:
        child = Child(CONNECT.replace("capacity='64MiB'", "capacity='8MiB'") + """
node = store.node_store
node.stripes[node.table.locate(store.kernel.sid, b'k')[2]].acquire()
print('holding', flush=True)
sys.stdin.readline()
""", env={"N": name})
        assert child.readline() == "holding"
        os.kill(child.pid, signal.SIGSTOP)
        try:
            with pytest.raises(shmstore.LockTimeoutError, match="lock_timeout"):
                s.put("k", 1)
            assert "k" not in [i.key for i in s.list()] and used(s) == 0
        finally:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
        s.put("k", 1)  # recovered once the holder is gone
