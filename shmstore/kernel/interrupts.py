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
   runs the program's handler when that frame returns or raises, through a
   trace function set on that frame only. The verb finishes (all or
   nothing, as ever) and then raises ``KeyboardInterrupt`` to its caller.
   A finalizer (a view's unpin, run by the garbage collector anywhere)
   cannot raise to anyone (Python swallows it): the signals wait on for the
   code it interrupted, the end of its store stretch, or else the next line
   of the program's frame.

A second signal while one is deferred runs the handler at once: a verb
stuck for good (a hung file system) can still be interrupted. That, and
exceptions no handler raises (``PyThreadState_SetAsyncExc``, a handler
installed after the last verb), are asynchronous exceptions inside the
store's code: each lock then repairs what its section left (see
:class:`~shmstore.kernel.lock.ShmLock`), as it would after its holder died.

Cost: nothing while no signal comes (one identity check of the SIGINT
handler per verb); the frame walk and one trace function only when one does.
"""
from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (no stubs: signal.getsignal wraps it)
import os
import signal
import sys
import threading
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

    Frames of other code called from shmstore (pickle, a user's ``__reduce__``) count as inside it.
    """
    target = None
    f = frame
    while f is not None:
        code = f.f_code
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
        if now.delivering:  # the verb is over and the ones that waited are being handled: this one joins them
            now.handlers.append(self)
            return None
        if self in now.handlers:  # a second one while the first waits: the program's handler now
            now.handlers.remove(self)
            if not now.handlers:
                now.disarm()
            return self.wrapped(signum, frame)
        target = now.target or critical_frame(frame)
        if target is None:  # outside the store's code
            return self.wrapped(signum, frame)
        now.handlers.append(self)
        if now.target is None:
            now.arm(target)
        return None


class _Deferred:
    """The signals waiting for the store's code to return, and the frame they wait for (main thread only).

    One trace function on one frame: ``arm`` sets it (turning tracing on
    with a trace function that traces nothing else, if none was on), the
    frame's return (or, after a finalizer, the next line of the program's
    frame it interrupted) delivers every signal that waited, in order, and
    ``disarm`` puts things back. A signal that comes during the delivery
    joins it; none is ever left waiting with nothing armed.
    """

    def __init__(self) -> None:
        self.handlers: list[DeferringHandler] = []
        self.target: FrameType | None = None
        self.delivering = False  # the program's handlers of the signals that waited are running
        self._at_line = False   # deliver at the target's next line too (a program frame, after a finalizer)
        self._old_trace: Any = None
        self._old_local: Any = None

    def arm(self, target: FrameType, at_line: bool = False) -> None:
        self.target, self._at_line = target, at_line
        self._old_trace = sys.gettrace()
        if self._old_trace is None:
            sys.settrace(_no_local_trace)  # a frame's f_trace runs only while a trace function is set
        self._old_local = target.f_trace
        target.f_trace_lines = at_line
        target.f_trace = self._on_event

    def disarm(self) -> None:
        target, self.target = self.target, None
        if target is not None:
            target.f_trace = self._old_local
            target.f_trace_lines = True
            if self._old_trace is None and sys.gettrace() is _no_local_trace:
                sys.settrace(None)
        self._old_trace = self._old_local = None

    def _on_event(self, frame: FrameType, event: str, arg: Any) -> Any:
        local = self._old_local
        if local is not None:  # a debugger's or coverage's tracer of this frame goes on seeing it
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
            caller = caller.f_back  # weakref.finalize's own frame: the callback's exceptions are swallowed there too
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


def deferring(signum: int) -> DeferringHandler | None:
    """The store's handler of ``signum`` if it is installed."""
    h = _getsignal(signum)
    return h if isinstance(h, DeferringHandler) else None


def pending() -> bool:
    """True while a signal waits for a verb to finish (tests)."""
    return bool(_DEFERRED_NOW.handlers)


def guard() -> None:
    """Put the store's handler in front of the program's (main thread only; cheap when it is there).

    Called at the start of the verbs: a program (Jupyter does, around every
    cell) may have installed a handler of its own since the last one.
    """
    if _getsignal(_SIGINT) is not _installed[0]:
        _install()


def _install() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers; the main thread's next verb does it
    for signum in _DEFERRED:
        h = _getsignal(signum)
        if callable(h) and not isinstance(h, DeferringHandler):
            try:
                signal.signal(signum, DeferringHandler(signum, h))
            except (ValueError, OSError):  # not the main interpreter
                continue
    _installed[0] = _getsignal(_SIGINT)
