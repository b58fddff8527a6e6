"""Signals that arrive inside the store's code wait until it is consistent again.

Python runs a signal's handler in the main thread at the next instruction
boundary, wherever that is. Ctrl-C (``KeyboardInterrupt`` from the default
SIGINT handler), Jupyter's "interrupt kernel" and any handler that raises
(``SystemExit`` from a SIGTERM handler, a timeout from SIGALRM) would
otherwise raise in the middle of the store's metadata updates: between
taking a lock and the ``try`` that releases it, between a pin and the view
that drops it, between the first and the last store of a chain update. The
process goes on (it caught the exception), so nobody repairs what it left:
a lock held for good by a live thread wedges every process of the node.

So the store's handler (installed over a Python-level handler of SIGINT,
and of SIGTERM, SIGHUP, SIGALRM, SIGUSR1 and SIGUSR2 where the program set
one, by :func:`guard` at the start of each verb in the main thread) looks at
the frame the signal interrupted:

1. outside shmstore code, or where the innermost shmstore function is
   marked :func:`interruptible` (a wait: nothing held, the callers roll
   back), it runs the program's handler at once, as if we were not there;
2. otherwise it finds the outermost shmstore frame of that stretch of the
   stack (the verb the program called, or the wait that called it) and
   runs the program's handler when that frame returns or raises. The verb
   finishes (all or nothing, as ever) and then raises ``KeyboardInterrupt``
   to its caller. A finalizer (a view's unpin, run by the garbage collector
   anywhere) cannot raise to anyone (Python swallows it): the signals wait
   on for the code it interrupted, the end of its store stretch, or else
   the next line of the program's frame.

How the return is seen must not depend on who else traces the program. A
frame's ``f_trace`` runs only under a tracer set from Python: coverage's C
tracer (``coverage run``, ``pytest --cov``) never calls it, and signals
deferred that way were lost (10 of 20 Ctrl-Cs never raised; a SIGTERM
handler calling ``sys.exit`` never ran). So three ways watch for it, and
the first to see it delivers:

- a profile function (``sys.setprofile``, where no profiler holds that
  slot: coverage traces, it does not profile), called at every return in
  the main thread until the target's;
- the target frame's ``f_trace`` (where a profiler such as cProfile holds
  the profile slot: then the trace slot is free, or a debugger's Python
  tracer calls it);
- a watcher thread, while anything is deferred, that looks at the main
  thread's stack every millisecond: once it is outside the store's code
  and the signals still wait (both slots held by C tools, or a finalizer's
  "next line" that no line event reports), it hands them back to the main
  thread by sending it the signal again (``signal.pthread_kill``), and the
  handler runs them there, or defers them anew where the main thread is
  in the store's code again.

A second signal while one is deferred runs the program's handler at once
(a verb stuck for good, a hung file system, can still be interrupted); the
first still waits for the verb, so a handler that counts sees both. That,
and exceptions no handler raises (``PyThreadState_SetAsyncExc``, a handler
installed after the last verb), are asynchronous exceptions inside the
store's code: each lock then repairs what its section left (see
:class:`~shmstore.meta.lock.ShmLock`), as it would after its holder died.

Cost: nothing while no signal comes (one identity check of the SIGINT
handler per verb); the frame walk, the hooks and the watcher only when one
does.
"""
from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (no stubs: signal.getsignal wraps it)
import os
import signal
import sys
import threading
import time
import weakref
from types import CodeType, FrameType
from typing import Any, Callable, TypeVar

__all__ = ["guard", "interruptible", "finalizer", "deferring", "DeferringHandler", "pending"]

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_getsignal = _signal.getsignal  # ~40 ns; signal.getsignal's enum conversion takes ~4 us
_SIGINT = int(signal.SIGINT)
# signals whose Python handler the store defers; SIGINT's default handler is Python-level too
_DEFERRED = tuple(int(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM,
                                   signal.SIGUSR1, signal.SIGUSR2))
_HERE = __file__
_INTERRUPTIBLE: set[CodeType] = set()
_FINALIZERS: set[CodeType] = set()
_installed: list[Any] = [None]   # the handler of SIGINT guard() last saw ours (or declined to wrap)
_F = TypeVar("_F", bound=Callable[..., Any])


def interruptible(fn: _F) -> _F:
    """Mark ``fn`` as a place a signal may raise at once: it holds nothing, its callers roll back."""
    _INTERRUPTIBLE.add(fn.__code__)
    return fn


def finalizer(fn: _F) -> _F:
    """Mark ``fn`` as run by the garbage collector: a deferred signal is raised again after it."""
    _FINALIZERS.add(fn.__code__)
    return fn


def _ours(code: CodeType) -> bool:
    return code.co_filename.startswith(_PKG)


def critical_frame(frame: FrameType | None) -> FrameType | None:
    """The outermost frame of the stretch of shmstore code ``frame`` is in, or None if a signal may
    raise at ``frame`` now (outside shmstore, or in a function marked :func:`interruptible`).

    Frames of other code called from shmstore (pickle, a user's ``__reduce__``) count as inside it. Frames
    of this module (the hooks that watch for a verb's return, themselves interrupted) count as nothing: the
    signal lands where the event they were called for happened.
    """
    target = None
    f = frame
    while f is not None:
        code = f.f_code
        if code.co_filename == _HERE:
            f = f.f_back
            continue
        if _ours(code):
            if code in _INTERRUPTIBLE:
                return target
            target = f
        elif target is not None:
            return target
        f = f.f_back
    return target


class DeferringHandler:
    """The store's handler of one signal, in front of the program's ``wrapped`` handler.

    Process-wide (signal handlers are); runs only in the main thread, as all
    Python signal handlers do, so it needs no lock. The signals waiting for a
    verb wait together (:class:`_Deferred`): one trace function on one frame.
    """

    __slots__ = ("signum", "wrapped")

    def __init__(self, signum: int, wrapped: Callable[[int, FrameType | None], Any]) -> None:
        self.signum = signum
        self.wrapped = wrapped

    @property
    def pending(self) -> bool:
        return self in _DEFERRED_NOW.handlers

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        now = _DEFERRED_NOW
        # the verb is over and the ones that waited are being handled: this one joins them
        if now.delivering:
            now.handlers.append(self)
            return None
        # the watcher handed back what waited for a return no hook saw: deliver or defer anew
        if now.handoff:
            return now.take_back(frame)
        # a second one while the first waits: the program's handler now (the first
        if self in now.handlers:
            return self.wrapped(signum, frame)  # still waits for the verb)
        target = now.target or critical_frame(frame)
        if target is None:  # outside the store's code
            return self.wrapped(signum, frame)
        now.handlers.append(self)
        if now.target is None:
            now.arm(target)
        return None


class _Deferred:
    """The signals waiting for the store's code to return, and the frame they wait for (main thread only).

    ``arm`` sets the hooks on one frame (see the module's notes: a profile
    function where the slot is free, the frame's trace function, and the
    watcher thread), the frame's return (or, after a finalizer, the next
    line of the program's frame it interrupted) delivers every signal that
    waited, in order, and ``disarm`` puts things back. A signal that comes
    during the delivery joins it; none is ever left waiting with nothing
    armed. Everything but the watcher runs in the main thread; the watcher
    only reads, and sets :attr:`handoff` before it signals the main thread.
    """

    def __init__(self) -> None:
        self.handlers: list[DeferringHandler] = []
        self.target: FrameType | None = None
        # the program's handlers of the signals that waited are running the watcher saw the main thread leave the
        # store's code with signals waiting
        self.delivering = False
        self.handoff = False
        # deliver at the target's next line too (a program frame, after a finalizer)
        self._at_line = False
        self._old_trace: Any = None
        self._old_local: Any = None
        # our profile function is set (the main thread's profile slot was free)
        self._profiling = False

    def arm(self, target: FrameType, at_line: bool = False) -> None:
        self.target, self._at_line = target, at_line
        self._old_trace = sys.gettrace()
        if self._old_trace is None:
            sys.settrace(_no_local_trace)  # a frame's f_trace runs only while a trace function is set
        self._old_local = target.f_trace
        target.f_trace_lines = at_line
        target.f_trace = self._on_event
        if sys.getprofile() is None:  # no profiler: ours sees the target's return whoever traces
            sys.setprofile(self._on_profile)
            self._profiling = True
        _watcher.start()

    def disarm(self) -> None:
        target, self.target = self.target, None
        if target is not None:
            target.f_trace = self._old_local
            target.f_trace_lines = True
            if self._old_trace is None and sys.gettrace() is _no_local_trace:
                sys.settrace(None)
        if self._profiling:
            self._profiling = False
            if sys.getprofile() == self._on_profile:  # (a bound method: equal, not identical, each time)
                sys.setprofile(None)
        self._old_trace = self._old_local = None

    def take_back(self, frame: FrameType | None) -> Any:
        """The signals the watcher handed back (the main thread left the store's code with them still waiting):
        their handlers now where ``frame`` is outside the store's code, else deferred anew to its end."""
        self.handoff = False
        if not self.handlers or self.delivering:
            return None
        target = critical_frame(frame)
        if target is None:
            self._deliver(frame)
            return None
        if target is not self.target:
            self.disarm()
            self.arm(target)
        return None

    def _on_profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.target is None:  # disarmed by now
            return
        if event == "return" and frame is self.target:
            self._on_event(frame, event, arg, traced=False)

    def _on_event(self, frame: FrameType, event: str, arg: Any, traced: bool = True) -> Any:
        if frame is not self.target:  # a stale frame trace (delivered another way meanwhile): trace no more
            return None
        local = self._old_local
        if local is not None and traced:  # a debugger's or coverage's tracer of this frame goes on seeing it
            local(frame, event, arg)
        if not (event == "return" or (event == "line" and self._at_line)):
            return self._on_event
        code = frame.f_code
        if event == "return" and (code in _FINALIZERS or code.co_name == "__del__"):
            self._after_finalizer(frame.f_back)  # nobody to raise to here (Python swallows it)
            return None
        self._deliver(frame if event == "line" else frame.f_back)
        return None

    def _after_finalizer(self, caller: FrameType | None) -> None:
        """Wait on for the code the garbage collector interrupted to run the finalizer: the end of its
        store stretch if it is store code, else its next line."""
        self.disarm()
        while caller is not None and caller.f_code.co_filename == weakref.__file__:
            # weakref.finalize's own frame: the callback's exceptions are swallowed there too
            caller = caller.f_back
        inner = critical_frame(caller)
        if inner is not None:
            self.arm(inner)
        elif caller is not None:
            self.arm(caller, at_line=True)
        else:
            for h in self.handlers:
                signal.raise_signal(h.signum)
            self.handlers.clear()

    def _deliver(self, frame: FrameType | None) -> None:
        """Run every waiting signal's program handler; raise the first exception one raised."""
        first: BaseException | None = None
        self.delivering = True
        try:
            self.disarm()
            while self.handlers:
                h = self.handlers.pop(0)
                try:
                    h.wrapped(h.signum, frame)
                except BaseException as exc:
                    first = first or exc
        finally:
            self.delivering = False
        if first is not None:
            try:
                raise first  # from the verb's return (KeyboardInterrupt), to its caller
            finally:
                # no cycle (the exception, its traceback, this frame, ``first``): it would keep every frame
                # it unwound alive, with their locals (an open Writer), until the garbage collector ran,
                # wherever that is; their finalizers would run there instead of where the program drops them
                first = None


_DEFERRED_NOW = _Deferred()


def _no_local_trace(frame: FrameType, event: str, arg: Any) -> None:
    return None


class _Watcher:
    """The thread that hands deferred signals back to the main thread where no hook saw the verb's return
    (see the module's notes). Started when a signal is deferred; it looks every millisecond while signals
    wait, every 50 ms otherwise, and ends after a second with none. No lock and no event: the main thread
    starts it from signal handlers, which may interrupt each other (and a start racing the end is settled
    by who holds :attr:`_thread`, see :meth:`_ending`)."""

    interval = 0.001
    idle = 0.05
    linger = 1.0

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            t = threading.Thread(target=self._run, name="shmstore-signals", daemon=True)
            self._thread = t
            t.start()

    def forget(self) -> None:
        """In a forked child: the parent's thread is not there."""
        self._thread = None

    def _ending(self) -> bool:
        """Whether this thread may end (nothing waits): it lets go of :attr:`_thread` first, so a start from
        then on makes a new one, then looks again; a signal deferred in between keeps it (or the new one)."""
        me = threading.current_thread()
        if self._thread is me:
            self._thread = None
        if _DEFERRED_NOW.handlers and self._thread is None:
            self._thread = me
            return False
        return True

    def _run(self) -> None:
        try:
            self._watch()
        finally:  # however it ended, a later deferral starts another (a claim kept by this thread blocked it)
            if self._thread is threading.current_thread():
                self._thread = None

    def _watch(self) -> None:
        now, main = _DEFERRED_NOW, threading.main_thread()
        quiet = 0.0
        while main.is_alive():
            time.sleep(self.interval if now.handlers else self.idle)
            if not now.handlers:
                quiet += self.idle
                if quiet >= self.linger and self._ending():
                    return
                continue
            quiet = 0.0
            if now.handoff or now.delivering:
                continue
            if not _outside_store(main.ident or 0):
                continue  # still in the store's code (the hooks deliver at its end), or gone
            signum = next((h.signum for h in now.handlers if _getsignal(h.signum) is h), None)
            if signum is None:  # the program replaced every such handler: nobody to hand them to
                now.handlers.clear()
                if self._ending():  # (unless one was deferred meanwhile: then this thread watches on)
                    return
                continue
            now.handoff = True
            try:
                signal.pthread_kill(main.ident or 0, signum)
            except (OSError, ValueError):  # the main thread is going: the hooks deliver what waits, if anyone
                now.handoff = False
                return


def _outside_store(ident: int) -> bool:
    """Whether thread ``ident`` runs outside the store's code now (or in an interruptible wait). Keeps no
    reference to its frames: a frame held here would keep its locals (a view, and its pin) alive."""
    top = sys._current_frames().get(ident)
    try:
        return top is not None and critical_frame(top) is None
    finally:
        del top


_watcher = _Watcher()
os.register_at_fork(after_in_child=_watcher.forget)


def deferring(signum: int) -> DeferringHandler | None:
    """The store's handler of ``signum`` if it is installed."""
    h = _getsignal(signum)
    return h if isinstance(h, DeferringHandler) else None


def pending() -> bool:
    """True while a signal waits for a verb to finish (tests)."""
    return bool(_DEFERRED_NOW.handlers)


def watcher_interval(seconds: float) -> float:
    """Set how often the watcher looks at the main thread while signals wait (tests); returns the old one."""
    old, _Watcher.interval = _Watcher.interval, seconds
    return old


def guard() -> None:
    """Put the store's handler in front of the program's (main thread only; cheap when it is there).

    Called at the start of the verbs: a program (Jupyter does, around every
    cell) may have installed a handler of its own since the last one.
    """
    if _getsignal(_SIGINT) is not _installed[0]:
        _install()


def _install() -> None:
    if threading.current_thread() is not threading.main_thread():
        # only the main thread may set handlers; the main thread's next verb does it
        return
    for signum in _DEFERRED:
        h = _getsignal(signum)
        if callable(h) and not isinstance(h, DeferringHandler):
            try:
                signal.signal(signum, DeferringHandler(signum, h))
            except (ValueError, OSError):  # not the main interpreter
                continue
    _installed[0] = _getsignal(_SIGINT)
