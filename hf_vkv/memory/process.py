"""Which process made a piece of memory, and the refusal to use it in another one.

``os.fork()`` (and multiprocessing's ``fork`` start method) copies a process's mappings into the
child, but a memfd's pages are *shared*, not copied: a child writing into a cache or prefix store
made before the fork writes into its parent's K/V, and a child that frees one (at its exit, its
finalizers) punches holes in the parent's pages, which then read as zeros. So memory made in one
process is never written, grown nor freed in another: stores of pages (:class:`~hf_vkv.memory.
page_store.OpenTables`) remember the process that made them (:func:`made_here`) and refuse every
change elsewhere with :class:`ForkedMemoryError`; what a child's finalizers give back is left to
the process that made it. Processes share K/V through files instead (``PrefixStore.save`` /
``PrefixStore.load``: mapped read-only, copied on write).

The process is told by a count of forks (:func:`os.register_at_fork` bumps it in every child),
compared as an int on every buffer operation, rather than by ``os.getpid()``, a system call.

A fork also copies every lock as it was: one a thread of the parent held stays held in the child,
where no thread lets it go. A :class:`ProcessLock` is unheld in every child.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from types import TracebackType

from .errors import VKVError

__all__ = ["ForkedMemoryError", "MadeIn", "ProcessLock", "made_here"]

_forks = 0  # forks between the first process and this one (the child's count moves at each fork)


def _forked() -> None:
    global _forks
    _forks += 1
    for lock in tuple(_PROCESS_LOCKS):  # the child's one thread, before it runs anything else
        lock.renew()


os.register_at_fork(after_in_child=_forked)


class ProcessLock:
    """A ``threading.Lock`` (``with lock:``) that a forked child gets unheld: a thread of the
    parent that held it at the fork (a ``PrefixStore.save`` in another thread) does not exist in
    the child, which would wait for it forever."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _PROCESS_LOCKS.add(self)

    def renew(self) -> None:
        """A fresh, unheld lock (in a forked child, at the fork)."""
        self._lock = threading.Lock()

    def __enter__(self) -> ProcessLock:
        self._lock.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._lock.release()


_PROCESS_LOCKS: weakref.WeakSet[ProcessLock] = weakref.WeakSet()


class ForkedMemoryError(VKVError, RuntimeError):
    """A cache or prefix store used in a process forked after it was made: its memory is shared
    with the process that made it, so vkv does not write or free it here (the message says what to
    do instead)."""


@dataclass(frozen=True, slots=True)
class MadeIn:
    """The process a piece of memory was made in."""

    pid: int
    forks: int

    @property
    def here(self) -> bool:
        """Whether this is that process (no fork since)."""
        return self.forks == _forks

    def check(self, what: str) -> None:
        """Raise :class:`ForkedMemoryError` naming ``what`` unless this is the process that made it."""
        if self.forks != _forks:
            raise ForkedMemoryError(
                f"{what} was made in process {self.pid}, and this is process {os.getpid()}, forked from it "
                f"afterwards: its memory is the other process's (shared pages), so vkv neither writes nor frees it "
                f"here. Make caches and prefix stores in the process that uses them (a worker's initializer, or "
                f"multiprocessing's 'spawn' start method); to share a prefix between processes, save it once "
                f"(store.save(folder, model=model)) and open it in each (PrefixStore(model.config).load(folder, "
                f"model=model)): mapped read-only, shared, copied on write")


def made_here() -> MadeIn:
    """This process, as memory made now remembers it."""
    return MadeIn(os.getpid(), _forks)
