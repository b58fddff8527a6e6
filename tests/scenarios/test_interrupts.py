"""Ctrl-C at every step of an operation, in a process that catches it and goes on using the store.

Like the SIGKILL sweep of ``test_crash.py``, but the process lives on: a
forked child connects, then runs one operation and is interrupted at the
N-th point of shmstore code it executes, N running over the whole
operation. Two kinds of interruption (the ``mode`` fixture):

- ``sigint``: a line tracer sends the child SIGINT at the N-th line; Python
  runs the handler at its next instruction boundary, wherever that falls
  (Ctrl-C, Jupyter's interrupt). The store defers it to the end of the verb
  (``interrupts.py``), so everything must be exact even while the child
  lives: usage, and its private pins and reserved entries against what the
  store records for it.
- ``async``: a profiler raises ``KeyboardInterrupt`` at the N-th point
  where Python itself checks for asynchronous exceptions (a function's
  start, the return of each C call): what ``PyThreadState_SetAsyncExc`` or
  a handler the store does not defer does. Nothing defers it; each lock
  repairs what its section left (``lock.py``) and each put gives up its
  entry whatever step it reached. The guarantee is the SIGKILL one for the
  store (``check()`` clean while the child lives: no lock held, no half
  update) plus that the child goes on; what the cut-short verb had set
  aside for itself (an entry taken from its batch) comes back when it
  closes, which the parent checks after.

The child catches ``KeyboardInterrupt`` and stays attached while the parent
checks the store (``check()`` takes every lock: one left held fails it) and
that the object is all or nothing. Then the child puts, gets and deletes
other objects and closes, and the parent checks again: nothing left behind.
"""
from __future__ import annotations

import gc
import json
import os
import select
import signal
import sys
import time
import traceback

import numpy as np
import pytest

import shmstore
from shmstore import Level
from shmstore.meta import fastpath
from shmstore.meta import layout as L
from shmstore.primitives import interrupts, native

from ._sweeps import PKG, _child_store, assert_consistent, crc_of, kill_points, settle, values
from helpers import wait_for


def _arm(stop_at: int) -> list[int]:
    """Trace this process: send itself SIGINT at the ``stop_at``-th line executed in shmstore."""
    count = [0]

    def local(frame, event, arg):
        if event == "line":
            count[0] += 1
            if count[0] == stop_at:
                sys.settrace(None)
                os.kill(os.getpid(), signal.SIGINT)  # handled at the next instruction boundary
                return None
        return local

    def glob(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(PKG) else None

    sys.settrace(glob)
    return count


def _raise_at(stop_at: int, hit) -> list[int]:
    """Profile this process: raise ``KeyboardInterrupt`` at the ``stop_at``-th profile event for which
    ``hit(frame, event, arg)`` is true. Returns the count of such events so far (one item)."""
    count = [0]

    def prof(frame, event, arg):
        if hit(frame, event, arg):
            count[0] += 1
            if count[0] == stop_at:
                sys.setprofile(None)
                raise KeyboardInterrupt("asynchronous")

    sys.setprofile(prof)
    return count


def _arm_async(stop_at: int) -> list[int]:
    """Raise ``KeyboardInterrupt`` at the ``stop_at``-th point of shmstore code where Python checks for
    asynchronous exceptions (``PyThreadState_SetAsyncExc``, a signal handler the store does not defer): where
    a function of it starts, and right after each C function it calls returns."""
    return _raise_at(stop_at, lambda frame, event, arg: event in ("call", "c_return")
                     and frame.f_code.co_filename.startswith(PKG) and not _in_finalizer(frame))


def _in_finalizer(frame) -> bool:
    """True inside a finalizer (a view's unpin): Python swallows what is raised there, so one cut short at
    its first instruction keeps its pin until the store is closed; the sweep leaves finalizers alone."""
    while frame is not None:
        if frame.f_code.co_name in ("__del__", "_release") and frame.f_code.co_filename.endswith("views.py"):
            return True
        frame = frame.f_back
    return False


_REPAIRS = ("_repair_at", "repair", "repair_stripe")  # what runs the repair of a lock taken from a dead holder


def _arm_dead_holder(stop_at: int) -> list[int]:
    """Raise ``KeyboardInterrupt`` at the ``stop_at``-th of the points that matter where a verb meets a lock whose
    holder died: the return of each call of the C fast path (``_fast``: one took the lock from the dead holder,
    and a lock handed back held leaked when an exception came before the caller's repair, CI's "lock stripe 58
    is held by this very thread"; ShmLock's ``recover``), and the first instruction of the repair (cut short
    there, it repaired nothing, and nobody else would)."""
    def hit(frame, event, arg):
        if not frame.f_code.co_filename.startswith(PKG):  # (at a C return: the caller's frame)
            return False
        if event == "c_return":
            return getattr(arg, "__module__", None) == "shmstore.meta._fast"
        return event == "call" and frame.f_code.co_name in _REPAIRS
    return _raise_at(stop_at, hit)


def private_state_problems(store, mode: str) -> list[str]:
    """Where this process's private bookkeeping disagrees with what the store records for its slot
    (with no verb in flight): pins, reserved entries, writes begun. In ``async`` mode a reserved entry
    the store records and this process lost track of is allowed (given back at close)."""
    k = store.kernel
    node, slot = k.node, k.slot
    buf, lay = node.buf, node.layout
    t = L.entry_table(buf, lay)
    problems = []
    row = L.pin_table(buf, lay)[slot, :len(t)]
    shared = set(np.flatnonzero(row).tolist())
    local = {i for i, n in k.pins.counts.items() if n > 0}
    if shared != local:
        problems.append(f"pin bytes {sorted(shared)} but local pins {sorted(local)}")
    reserved = set(np.flatnonzero((t["state"] == L.RESERVED) & (t["writer"] == slot)).tolist())
    cached = {i for i, g in k._supply.entries if L.ENTRY_HEAD.get(buf, lay.entry(i), "gen") == g}
    if reserved != cached and not (mode != "sigint" and reserved > cached):
        problems.append(f"reserved entries {sorted(reserved)} but cached {sorted(cached)}")
    writing = np.flatnonzero((t["state"] == L.WRITING) & (t["writer"] == slot)).tolist()
    open_writers = len(list(k.writers))
    if len(writing) > open_writers:
        problems.append(f"entries {writing} still being written, {open_writers} writers open")
    return problems


def run_interrupted(prepare, op, verify_alive, stop_at: int, mode: str = "sigint") -> int:
    """Fork: ``ctx = prepare()``, then ``op(ctx)`` with SIGINT at line ``stop_at``; the child catches it.

    While the child is still attached the parent runs ``verify_alive(interrupted)``; then the child
    uses the store again and closes. Returns the lines the op ran when it was not interrupted, or -1.
    """
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r1)
            os.close(w2)
            store = prepare()
            count = {"async": _arm_async, "sigint": _arm, "dead holder": _arm_dead_holder}[mode](stop_at)
            interrupted, where = False, ""
            try:
                try:
                    op(store)
                finally:  # a Ctrl-C deferred in a view's finalizer comes at the program's next line: maybe here
                    sys.settrace(None)
                    sys.setprofile(None)
            except KeyboardInterrupt:
                interrupted, where = True, "".join(traceback.format_exc().splitlines(True)[-14:])
            sys.settrace(None)
            sys.setprofile(None)
            assert not interrupts.pending(), "a signal still waits after the verb returned"
            gc.collect()
            store.keys()  # the next verb: frees what a finalizer could not (documented, see pins.py)
            problems = private_state_problems(store, mode)
            os.write(w1, (json.dumps([count[0], interrupted, problems, where]) + "\n").encode())
            assert os.read(r2, 1) == b"g"
            _go_on(store)
            store.close()
            os.write(w1, b"ok\n")
            code = 0
        except BaseException:
            os.write(w1, ("FAIL " + traceback.format_exc()).encode())
        finally:
            os._exit(code)
    os.close(w1)
    os.close(r2)
    with os.fdopen(r1) as f, os.fdopen(w2, "wb", buffering=0) as go:
        first = f.readline()
        assert not first.startswith("FAIL"), first + f.read()
        lines, interrupted, problems, where = json.loads(first)
        assert not problems, f"interrupted at point {stop_at}: {problems}\n{where}"
        try:
            verify_alive(interrupted)
        except BaseException as exc:
            raise AssertionError(f"interrupted at point {stop_at}, the child still attached: {exc!r}\n{where}") \
                from None
        finally:
            go.write(b"g")
        rest = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and rest.startswith("ok"), \
        f"the child could not go on after an interrupt at line {stop_at} (status {status}):\n{rest}"
    return -1 if interrupted else lines


def _go_on(store) -> None:
    """The interrupted process keeps using the store: small, pickled and large objects, a writer."""
    for i, v in enumerate((b"after" * 100, {"a": np.arange(10), "n": 1}, np.arange(200_000))):
        store.put(f"after{i}", v)
        assert crc_of(store.get(f"after{i}")) == crc_of(v)
        store.delete(f"after{i}")
    with store.open_writer("after-w", 1000) as w:
        w.write(b"w" * 1000)
    assert bytes(store.get("after-w")) == b"w" * 1000
    store.delete("after-w")


POINTS = int(os.environ.get("SHMSTORE_INTERRUPT_POINTS", "10"))  # per operation and mode (0: every one;
# each run strides from a random start, so successive runs try other points)


def sweep(store, prepare, op, verify, mode: str) -> int:
    """Interrupt ``op`` at every point (or a stride of them); verify after each. Returns points tried."""
    total = run_interrupted(prepare, op, lambda interrupted: None, 1 << 60, mode)
    assert total > 0
    settle(store)
    verify(finished=True)
    tried = interrupted_runs = 0
    for stop in kill_points(total, POINTS):
        def alive(interrupted):
            if mode == "sigint":
                assert_consistent(store)  # check() takes every lock: one the child still held fails here
            else:  # usage may count what the cut-short verb set aside (given back at close)
                problems = store.check()
                assert not problems, "\n".join(problems)

        finished = run_interrupted(prepare, op, alive, stop, mode) >= 0
        interrupted_runs += not finished
        settle(store)
        try:
            assert_consistent(store)
            verify(finished=finished)
        except AssertionError as exc:
            raise AssertionError(f"interrupted ({mode}) at point {stop} of {total}: {exc}") from None
        tried += 1
    assert interrupted_runs, "no run was interrupted: the sweep tested nothing"
    return tried


@pytest.fixture(params=["sigint", "async"])
def mode(request) -> str:
    if request.param == "async" and fastpath.load() is None:
        pytest.skip("asynchronous exceptions at any point need the C helper (its unlocking __exit__ and "
                    "insert): pure Python defers signals only")
    return request.param


@pytest.mark.parametrize("kind", ["small", "dict", "large", "disk"])
@pytest.mark.slow
def test_put_interrupted_at_every_step_is_all_or_nothing(crash_store, kind, mode):
    store, value = crash_store, values()[kind]
    levels = [Level.DISK] if kind == "disk" else None
    want = crc_of(value)

    def op(s):
        s.put("victim", value, levels=levels)

    def verify(finished):
        if finished:
            assert "victim" in store
        if "victim" in store:
            assert crc_of(store.get("victim")) == want
            store.delete("victim")
        assert_consistent(store)

    assert sweep(store, _child_store(store), op, verify, mode) > 5


@pytest.mark.parametrize("kind", ["small", "dict", "large", "disk"])
@pytest.mark.slow
def test_overwrite_interrupted_at_every_step_leaves_the_old_or_the_new(crash_store, kind, mode):
    store, new = crash_store, values()[kind]
    old = np.arange(50_000)
    levels = [Level.DISK] if kind == "disk" else None
    want_new, want_old = crc_of(new), crc_of(old)
    store.put("victim", old)

    def op(s):
        view = s.get("victim")
        s.put("victim", new, levels=levels, overwrite=True)
        assert crc_of(view) == want_old

    def verify(finished):
        got = crc_of(store.get("victim"))
        assert got in (want_new, want_old), "neither the old nor the new value"
        assert got == want_new or not finished
        assert [i.key for i in store.list()] == ["victim"]
        if got == want_new:
            store.put("victim", old, overwrite=True)
        assert_consistent(store)

    assert sweep(store, _child_store(store), op, verify, mode) > 5


@pytest.mark.parametrize("kind", ["small", "dict", "disk"])
@pytest.mark.slow
def test_delete_interrupted_at_every_step_leaves_no_ghost(crash_store, kind, mode):
    store, value = crash_store, values()[kind]
    levels = [Level.DISK] if kind == "disk" else None
    store.put("victim", value, levels=levels)

    def op(s):
        s.delete("victim")

    def verify(finished):
        if finished:
            assert "victim" not in store
        if "victim" not in store:
            store.put("victim", value, levels=levels)
        assert crc_of(store.get("victim")) == crc_of(value)
        assert_consistent(store)

    assert sweep(store, _child_store(store), op, verify, mode) > 5


@pytest.mark.parametrize("level", [Level.MEMORY, Level.DISK])
@pytest.mark.slow
def test_writer_interrupted_at_every_step_leaves_nothing_half_visible(crash_store, level, mode):
    store = crash_store
    data = bytes(range(256)) * 2000

    def op(s):
        with s.open_writer("victim", len(data), levels=[level]) as w:
            w.write(data[:100_000])
            w.write(data[100_000:])

    def verify(finished):
        if finished:
            assert "victim" in store
        if "victim" in store:
            assert bytes(store.get("victim")) == data
            store.delete("victim")
        assert_consistent(store)

    assert sweep(store, _child_store(store), op, verify, mode) > 5


@pytest.mark.slow
def test_reader_and_pins_interrupted_at_every_step(crash_store, mode):
    store = crash_store
    store.put("victim", np.arange(100_000))

    def op(s):
        view = s.get("victim")
        s.pin("victim")
        with s.open_reader("victim") as r:
            r.read(1000)
            r.seek(0)
            r.readinto(bytearray(100))
        assert view[5] == 5
        s.unpin("victim")

    def verify(finished):
        np.testing.assert_array_equal(store.get("victim"), np.arange(100_000))
        assert store.get_info("victim").pins == 0
        assert_consistent(store)

    assert sweep(store, _child_store(store), op, verify, mode) > 5


@pytest.mark.parametrize("direction", ["spill", "restore"])
@pytest.mark.slow
def test_move_and_spilled_get_interrupted_at_every_step(crash_store, direction, mode):
    store = crash_store
    value = values()["large"]
    want = crc_of(value)
    start = Level.DISK if direction == "restore" else Level.MEMORY
    store.put("victim", value, levels=[start])

    def op(s):
        s.move("victim", Level.MEMORY if direction == "restore" else Level.DISK)
        assert crc_of(s.get("victim")) == want  # a get of the object where it is now (spilled: from its file)

    def verify(finished):
        assert crc_of(store.get("victim")) == want
        if store.get_info("victim").level != start:
            store.move("victim", start)
        assert_consistent(store)

    assert sweep(store, _child_store(store), op, verify, mode) > 5


@pytest.mark.slow
def test_get_of_a_spilled_object_interrupted_at_every_step(crash_store, mode):
    store = crash_store
    value = values()["disk"]
    store.put("victim", value, levels=[Level.DISK])

    def op(s):
        assert crc_of(s.get("victim")) == crc_of(value)
        assert crc_of(s.get("victim", conditions=(slice(10, 1000),))) == crc_of(value[10:1000])
        s.get("victim", levels=[Level.MEMORY])  # brings it back

    def verify(finished):
        assert crc_of(store.get("victim")) == crc_of(value)
        if store.get_info("victim").level != Level.DISK:
            store.move("victim", Level.DISK)
        assert_consistent(store)

    assert sweep(store, _child_store(store), op, verify, mode) > 5


def _die_holding(store, key: str) -> None:
    """A process takes the stripe lock of ``key``, leaves half an update under it (the stripe's object counter
    7 too high, which the stripe's repair counts again), and is SIGKILLed holding it."""
    node = store.node_store
    stripe = node.table.locate(store.kernel.sid, key.encode())[2]
    lock, soff = node.stripes[stripe], node.layout.stripe_stats(stripe)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            if native.mutex_trylock(lock.address) == 0:
                L.STRIPE_STATS.set(node.buf, soff, "objects", L.STRIPE_STATS.get(node.buf, soff, "objects") + 7)
                os.write(w, b"x")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        taken = f.read(1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert taken == b"x", "the stripe lock was not free"


@pytest.mark.parametrize("verb", ["get", "contains", "delete", "put", "put large"])
@pytest.mark.slow
def test_a_verb_meeting_a_dead_holders_lock_interrupted_anywhere_leaves_it_repaired_and_free(crash_store, verb):
    """The verb's key's stripe lock was held by a process that died half way through an update; the verb takes it
    (in a C fast path or in Python), repairs the stripe and goes on. An asynchronous exception at every point
    that matters there (the return of each C call, the repair's first instruction) leaves the lock free and the
    stripe repaired: before, the C fast paths handed the lock back held for the caller to repair, and an
    exception before the caller's next line left it held for good (CI: a Ctrl-C'd chaos worker, "lock stripe
    58 is held by this very thread")."""
    if fastpath.load() is None:
        pytest.skip("the C fast path is not built: no C call takes the lock")
    store = crash_store
    small, large = np.arange(1000), np.arange(300_000)
    value = large if verb == "put large" else small
    if not verb.startswith("put"):
        store.put("victim", value)
    connect = _child_store(store)

    def prepare():
        s = connect()
        _die_holding(s, "victim")
        return s

    op = {"get": lambda s: s.get("victim"), "contains": lambda s: "victim" in s, "delete": lambda s: s.delete("victim"),
          "put": lambda s: s.put("victim", value), "put large": lambda s: s.put("victim", value)}[verb]

    def verify(finished):
        if verb.startswith("put"):
            assert "victim" in store or not finished
            if "victim" in store:
                assert crc_of(store.get("victim")) == crc_of(value)
                store.delete("victim")
        else:
            assert "victim" not in store if verb == "delete" and finished else True
            if "victim" not in store:
                store.put("victim", value)
            assert crc_of(store.get("victim")) == crc_of(value)
        assert_consistent(store)

    assert sweep(store, prepare, op, verify, "dead holder") >= 1


# ---- the store's signal handler ------------------------------------------------------------------------

@pytest.fixture
def sigint_restored():
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


class _Reduced:
    """A value whose pickling runs ``hook`` inside the store's put (deep in shmstore frames)."""

    def __init__(self, hook):
        self.hook = hook

    def __reduce__(self):
        self.hook(sys._getframe())
        return (dict, ())


def test_a_handler_reset_by_the_program_is_wrapped_again_at_the_next_verb(store, sigint_restored):
    calls = []
    store.put("a", 1)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # what ipykernel does around every cell
    store.put("b", 2)
    h = interrupts.deferring(signal.SIGINT)
    assert h is not None and h.wrapped is signal.default_int_handler

    signal.signal(signal.SIGINT, lambda s, f: calls.append("mine"))  # a program's own handler, later
    assert "b" in store and store.get("b") == 2  # get is a verb too
    h = interrupts.deferring(signal.SIGINT)
    assert h is not None
    h(signal.SIGINT, sys._getframe())  # outside shmstore: the program's handler at once
    assert calls == ["mine"]


def test_a_signal_inside_a_verb_is_handled_when_the_verb_returns_and_a_second_one_at_once(store, sigint_restored):
    calls = []
    handler = interrupts.DeferringHandler(signal.SIGINT, lambda s, f: calls.append(f.f_code.co_name))

    def once(frame):
        handler(signal.SIGINT, frame)
        assert calls == [] and interrupts.pending()  # deferred

    store.put("one", _Reduced(once))
    me = sys._getframe().f_code.co_name
    assert calls == [me] and not interrupts.pending()  # when Store.put returned, in its caller's frame
    assert "one" in store

    def twice(frame):
        handler(signal.SIGINT, frame)
        handler(signal.SIGINT, frame)  # a second Ctrl-C: the program's handler now
        assert len(calls) == 2 and interrupts.pending()  # the first still waits for the verb

    store.put("two", _Reduced(twice))
    assert len(calls) == 3 and not interrupts.pending()  # a handler that counts sees both

    other = interrupts.DeferringHandler(signal.SIGUSR2, lambda s, f: calls.append("usr2"))
    raising = interrupts.DeferringHandler(signal.SIGINT, signal.default_int_handler)

    def two_signals(frame):  # a pause request and a Ctrl-C while one verb runs: both wait, both are handled
        other(signal.SIGUSR2, frame)
        raising(signal.SIGINT, frame)

    with pytest.raises(KeyboardInterrupt):
        store.put("three", _Reduced(two_signals))
    assert calls[-1] == "usr2" and not interrupts.pending() and sys.gettrace() is None
    assert "three" in store and store.check() == []


def test_a_signal_watcher_that_had_nobody_to_hand_back_to_lets_a_later_deferral_start_another():
    """The watcher thread ends where the program replaced every handler of the signals that waited (nobody to
    hand them to). It must let go of its claim: a signal deferred later, whose return no hook sees (both slots
    held by C tools, or a finalizer's next line), is handed back to the main thread by the watcher alone, and a
    claim kept by the ended thread left it waiting for good."""
    from helpers import wait_for

    now, watcher = interrupts._DEFERRED_NOW, interrupts._watcher
    assert wait_for(lambda: watcher._thread is None, 30), "a watcher of an earlier test did not end"
    interval = interrupts.watcher_interval(0.001)
    calls: list[str] = []
    before = signal.signal(signal.SIGUSR2, lambda s, f: calls.append("the program's"))  # it replaced ours
    try:
        now.handlers.append(interrupts.DeferringHandler(signal.SIGUSR2, lambda s, f: calls.append("ours")))
        watcher.start()
        first = watcher._thread
        assert first is not None and wait_for(lambda: not first.is_alive(), 30)
        assert now.handlers == [] and calls == []  # nobody to hand them to: dropped
        assert watcher._thread is None, "the ended watcher still claims its place: no later one can start"

        later = interrupts.DeferringHandler(signal.SIGUSR2, lambda s, f: calls.append("later"))
        signal.signal(signal.SIGUSR2, later)
        now.handlers.append(later)  # deferred where no hook will see the return: the watcher's to hand back
        watcher.start()
        assert wait_for(lambda: calls == ["later"], 30), f"the signal deferred later never ran: {calls}"
        assert now.handlers == [] and not now.handoff
    finally:
        now.handlers.clear()
        now.handoff = False
        signal.signal(signal.SIGUSR2, before)
        interrupts.watcher_interval(interval)


def test_ctrl_c_in_a_wait_for_the_spill_process_raises_at_once_and_withdraws_the_request(tmp_path, sigint_restored):
    import threading
    import time

    from shmstore.spill import requests
    with shmstore.connect("t" + os.urandom(6).hex(), capacity="16MiB", spill_dir=str(tmp_path)) as s:
        s.put("big", np.zeros(1 << 20, np.uint8))
        pid = s.spill_pid
        os.kill(pid, signal.SIGSTOP)  # it will not answer
        try:
            timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            t0 = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                s.move("big", Level.DISK)  # waits up to spill_timeout for the stopped spill process
            waited = time.monotonic() - t0
            timer.join()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert waited < 5, f"Ctrl-C took {waited:.1f} s to interrupt the wait"
        node, slot = s.node_store, s.kernel.slot
        status = L.REQUEST.get(node.buf, node.layout.client(slot) + L.REQUEST_OFFSET, "status")
        assert status == L.RS_IDLE, "the request the interrupted wait made is still pending"
        assert s.check() == []
        assert requests.pending(node) == []


def test_a_signal_deferred_in_a_finalizer_is_raised_in_the_code_it_interrupted_not_swallowed(sigint_restored,
                                                                                             monkeypatch):
    # the hooks alone, without the watcher thread (for returns no hook sees, a millisecond later): this test's
    # __del__ stands in for the store's finalizers but is not shmstore code, so a watcher that looked while this
    # thread had lost its CPU between the finalizer and the next line took the signal for the program's and
    # dropped it (two suites at once on 2 cores: "DID NOT RAISE"; 2 in 20,000 under load)
    assert wait_for(lambda: interrupts._watcher._thread is None, timeout=10), "an earlier test's watcher lingers"
    monkeypatch.setattr(interrupts._watcher, "start", lambda: None)
    handler = interrupts.DeferringHandler(signal.SIGINT, signal.default_int_handler)
    reached = []

    class Dying:
        def __del__(self):  # as a view's unpin: a signal lands inside it and waits for its return
            interrupts._DEFERRED_NOW.handlers.append(handler)
            interrupts._DEFERRED_NOW.arm(sys._getframe())

    def program():
        x = Dying()
        del x  # the finalizer runs here; what it deferred must not vanish with it
        reached.append("the next line")  # KeyboardInterrupt at this line

    with pytest.raises(KeyboardInterrupt):
        program()
    assert reached == [] and not interrupts.pending() and sys.gettrace() is None


# ---- writers dropped where the garbage collector runs -----------------------------------------------------

def _writing(store) -> list[int]:
    t = L.entry_table(store.node_store.buf, store.node_store.layout)
    return np.flatnonzero(t["state"] == L.WRITING).tolist()


def _say(fd: int, *what) -> None:
    os.write(fd, (json.dumps(what) + "\n").encode())


def _hear(fd: int, timeout: float = 60.0) -> list:
    """The child's next message (one JSON line), waiting ``timeout`` seconds at most."""
    buf, deadline = b"", time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 1 << 16) if ready else b""
        if not chunk:
            raise AssertionError(f"the child said nothing more within {timeout:g} s (or exited): {buf!r}")
        buf += chunk
    said = json.loads(buf)
    assert said[0] != "FAIL", said[1]
    return said


def _reap(pid: int, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


@pytest.mark.parametrize("held", ["alloc", "stripe"])
@pytest.mark.parametrize("kind", ["small", "large", "disk"])
def test_a_writer_finalized_inside_a_locked_section_of_its_own_thread_waits_for_no_lock(crash_store, kind, held):
    """An unsealed writer in a reference cycle (a frame kept by an exception's traceback) is finalized wherever
    the garbage collector runs: here inside a section of the same thread holding the ALLOC lock or the
    writer's stripe lock. Its finalizer used to wait for that lock, held by itself, for the whole lock
    timeout (every process of the node waiting behind it), and then, on the ALLOC lock, left the entry
    ``writing`` and out of its chain for good (the timeout is an error raised on purpose, which runs no
    repair): what the chaos run's ``check()`` beside live workers found after Ctrl-Cs. It must give up
    at once and leave the entry to the process's next verb."""
    # the failure waits the whole lock timeout: a long one tells it apart from a slow gc.collect() (a child of a
    # large pytest process on a loaded machine: 1.06 s once, which a 3 s timeout took for the failure)
    store, timeout = crash_store, 30.0
    size, levels = {"small": (1000, None), "large": (1 << 20, None), "disk": (100_000, [Level.DISK])}[kind]
    r, w = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            os.close(w2)
            gc.disable()  # the test says where the garbage collector runs
            s = shmstore.connect(store.name, spill_dir=store.config.spill_dir, prefault=0, lock_timeout=timeout)
            writer = s.open_writer("dropped", size, levels=levels)
            writer.write(b"x" * (size // 2))
            idx, node = writer._in.reservation.idx, s.node_store
            cycle: list = [writer]
            cycle.append(cycle)
            del writer, cycle
            lock = node.alloc_lock if held == "alloc" else node.stripe_of(idx)
            t0 = time.monotonic()
            with lock:
                gc.collect()  # as at any allocation inside such a section
            _say(w, "collected", time.monotonic() - t0)
            assert os.read(r2, 1) == b"g"
            s.keys()  # the next verb does what the finalizer left
            _say(w, "next")
            assert os.read(r2, 1) == b"g"
            s.close()
            _say(w, "ok")
            code = 0
        except BaseException:
            _say(w, "FAIL", traceback.format_exc())
        finally:
            os._exit(code)
    os.close(w)
    os.close(r2)
    try:
        took = _hear(r)[1]
        problems = store.check()  # beside the live child: its writer's entry whole (or given up)
        assert not problems, "\n".join(problems)
        assert took < timeout / 2, f"the finalizer waited {took:.1f} s for a lock its own thread held"
        assert "dropped" not in store
        os.write(w2, b"g")
        _hear(r)
        assert _writing(store) == [], "the next verb did not give back the dropped writer's entry"
        assert_consistent(store)
        os.write(w2, b"g")
        _hear(r)
    finally:
        os.close(w2)  # a child still waiting for the go reads the end and exits
        status = _reap(pid)
        os.close(r)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert_consistent(store)
    assert store.keys() == []


def test_a_deferred_ctrl_c_keeps_nothing_it_unwound_alive(store, sigint_restored):
    """A Ctrl-C deferred to a verb's return is raised from the store's delivery without a reference cycle:
    the frames it unwound go when the program's ``except`` ends, and an open writer among their locals is
    given back there and then, not whenever (and wherever) the garbage collector runs next."""
    raising = interrupts.DeferringHandler(signal.SIGINT, signal.default_int_handler)

    def program():
        w = store.open_writer("dropped", 100)
        w.write(b"x" * 10)
        store.put("after", _Reduced(lambda frame: raising(signal.SIGINT, frame)))  # raises when put returns

    gc.disable()
    try:
        try:
            program()
        except KeyboardInterrupt:
            pass
        else:
            pytest.fail("the deferred Ctrl-C was not raised")
        assert _writing(store) == [], "the writer the Ctrl-C unwound is still alive, its entry still writing"
    finally:
        gc.enable()
    assert "after" in store and "dropped" not in store
    assert store.check() == []


def test_ctrl_c_inside_a_views_finalizer_reaches_the_program_not_swallowed(store, sigint_restored):
    """A view's unpin runs wherever the garbage collector frees it: Ctrl-C landing inside it waits for
    the program's next line (raised inside the finalizer, Python would print 'Exception ignored' and drop
    it)."""
    from shmstore.node import views
    store.put("v", np.arange(1000))
    reached = []

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code is views._release.__code__:
            sys.settrace(None)
            os.kill(os.getpid(), signal.SIGINT)  # handled inside the finalizer
        return None

    def program():
        view = store.get("v")
        sys.settrace(tracer)
        del view  # the finalizer runs here
        reached.append("the next line")

    with pytest.raises(KeyboardInterrupt):
        program()
    sys.settrace(None)
    assert reached == [] and not interrupts.pending()
    assert store.get_info("v").pins == 0 and store.check() == []
