"""Ctrl-C held while hf_vkv's bookkeeping is half done.

Python raises ``KeyboardInterrupt`` in the main thread at whatever bytecode it is running when a
SIGINT arrives (a notebook's interrupt, Ctrl-C in a terminal). hf_vkv changes its page tables,
pools and prefix stores in several steps; an interrupt between two of them leaves a transaction
open (every later call of the cache or store then fails), references that no table holds (pages
that never go back), or a finalizer cut short (its pages, mapping and memfd kept until the
process ends). So while the main thread is inside a *section* (:func:`section`: a page store's or
a prefix store's lock is held, a finalizer gives pages back) a SIGINT is held, and raised as
``KeyboardInterrupt`` once the outermost section has ended: right after the bookkeeping, before
the next layer's or step's compute, so an interrupt still stops ``generate`` within one layer.

A section installs the holding handler when none is installed and puts the replaced one back as
it ends (~12 us a section, two ``signal.signal`` calls among it); a :func:`guarded` scope (a
``generate`` call) keeps it installed for its whole length, so that its sections cost ~1 us each
(a decode step opens two), and so that the first bytecodes of a finalizer (``weakref.finalize``'s
own, before the finalizer's section begins) are covered too: an interrupt whose stack holds a
frame of a function :func:`register_critical` named is raised again :data:`_RETRY_S` later, from a
timer thread, once the finalizer has run (raised inside it, it would be printed and lost).

Only the main thread of the main interpreter receives SIGINT; in other threads sections count
nothing. A SIGINT handler that is not a Python callable (``SIG_IGN``, ``SIG_DFL``: Ctrl-C ends the
process) is left as it is, and so is a handler another library installs while a scope is open.

Process state, not call state: signal handlers belong to the process, and so does the one
:data:`_HOLD` that counts the main thread's open sections.
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

__all__ = ["SectionLock", "guarded", "held_now", "register_critical", "section"]

_RETRY_S = 0.002  # an interrupt that came in a finalizer's first bytecodes is raised again this much later


class _Hold:
    """The main thread's open sections and scopes, the handler they installed, and whether a
    SIGINT came while they held it.

    Invariants: ``installed`` while the holding handler is in place for an open section or scope
    (it is taken back as the last one ends); ``original`` is the handler it passes SIGINTs on to
    outside sections (the one it replaced; kept after); ``pending`` only until the outermost
    section that held the SIGINT ends."""

    def __init__(self) -> None:
        self.depth = 0  # open sections
        self.scopes = 0  # open guarded() scopes
        self.pending = False  # a SIGINT came while held: raised when the outermost section ends
        self.installed = False
        self.original: Callable[[int, FrameType | None], Any] | None = None
        self.critical: set[CodeType] = {weakref.finalize.__call__.__code__}
        self.handler = self._handler  # one bound method: ``signal.getsignal`` is compared by identity

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.depth:
            self.pending = True  # raised as the outermost section ends
            return
        if self._in_critical(frame):  # a finalizer's first bytecodes: raised once it has run
            _later()
            return
        original = self.original
        if original is not None:
            original(signum, frame)

    def _in_critical(self, frame: FrameType | None) -> bool:
        while frame is not None:
            if frame.f_code in self.critical:
                return True
            frame = frame.f_back
        return False

    def ready(self) -> bool:
        """In the main thread: the holding handler in place; whether this is the main thread. The
        caller counts its section or scope next, with no call in between (Python raises a pending
        interrupt only at a call's end, a jump back or a function's start), then enters ``try``."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if not self.installed:
            self._install()
        return True

    def close(self, *, scope: bool) -> None:
        """A section or scope of the main thread ends: the last one takes the handler back, and a
        SIGINT held meanwhile is raised."""
        if scope:
            self.scopes -= 1
        else:
            self.depth -= 1
        if self.depth:
            return
        deliver, self.pending = self.pending, False
        if not self.scopes:
            self._uninstall()
        if deliver:
            if self._in_critical(sys._getframe(1)):
                _later()  # raised in a finalizer, it would be printed and lost: after it, then
            else:
                _thread.interrupt_main(signal.SIGINT)  # the handler in place now runs at the next bytecode

    def _install(self) -> None:
        try:
            current = signal.getsignal(signal.SIGINT)
            if current is self.handler:  # left in place by an interrupt inside _uninstall: ours again
                self.installed = True
                return
            if not callable(current):
                return
            signal.signal(signal.SIGINT, self.handler)
        except ValueError:  # not the main interpreter
            return
        self.original, self.installed = current, True

    def _uninstall(self) -> None:
        # ``original`` is kept: should an interrupt stop this before the handler goes back, the one left
        # in place still passes every SIGINT on to it
        if not self.installed:
            return
        self.installed = False
        try:
            if signal.getsignal(signal.SIGINT) is self.handler:  # else another library's handler came since: kept
                signal.signal(signal.SIGINT, self.original)
        except ValueError:
            pass


def _later() -> None:
    """Raise the SIGINT again in :data:`_RETRY_S` (from a timer thread: the main thread is in a finalizer)."""
    try:
        timer = threading.Timer(_RETRY_S, _thread.interrupt_main, (signal.SIGINT,))
        timer.daemon = True
        timer.start()
    except RuntimeError:  # no new thread at the interpreter's shutdown: nothing is left to interrupt
        pass


_HOLD = _Hold()


@contextmanager
def section() -> Iterator[None]:
    """Hold SIGINT (in the main thread) until the outermost section ends, then raise it."""
    if not _HOLD.ready():
        yield
        return
    _HOLD.depth += 1  # (no call before the try: see _Hold.ready)
    try:
        yield
    finally:
        _HOLD.close(scope=False)


@contextmanager
def guarded() -> Iterator[None]:
    """Keep the holding handler installed for the scope (a ``generate`` call): its sections cost a
    counter, and finalizers that start in it (:func:`register_critical`) are covered from their
    first bytecode. Holds nothing by itself."""
    if not _HOLD.ready():
        yield
        return
    _HOLD.scopes += 1
    try:
        yield
    finally:
        _HOLD.close(scope=True)


def register_critical(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: an interrupt whose stack holds a frame of ``func`` (a finalizer, whose first
    bytecodes run before the section it opens) is raised again once it has run."""
    _HOLD.critical.add(func.__code__)
    return func


def held_now() -> bool:
    """Whether a SIGINT arriving now in the main thread would be held (tests)."""
    return _HOLD.installed and _HOLD.depth > 0


class SectionLock:
    """A reentrant lock whose holding is a :func:`section`: while the main thread holds it, Ctrl-C
    waits. ``with lock:`` only."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> SectionLock:
        main = _HOLD.ready()
        if main:
            _HOLD.depth += 1
        try:
            self._lock.acquire()
        except BaseException:
            if main:
                _HOLD.close(scope=False)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        if threading.current_thread() is threading.main_thread():
            _HOLD.close(scope=False)
