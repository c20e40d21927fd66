"""The pages of a mapped prefix file and their checks: each page's checksum, and which pages of an
opened file were checked (:class:`MappedPages`), each once, in a thread from the open on or at the
first use of an entry that holds them (the integrity design: :mod:`hf_vkv.prefix.mapped`)."""

from __future__ import annotations

import functools
import mmap
import os
import threading
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..memory import PageId
from ..memory.held_pages import HeldPages
from ..memory.errors import ArgumentError
from .errors import PrefixFileCorruptError

__all__ = ["CHECKSUM_KINDS", "MappedPages", "SUM64", "WEIGHTED64", "page_checksums"]

# torch.frombuffer warns (once a process) that the file's read-only pages are not writable: they are only
# read here. A filter for this module's calls alone, set once: a warnings.catch_warnings() around the call
# swapped the process's filter list, and two threads checking pages at once could leave every UserWarning
# of the process ignored for good (catch_warnings is not thread-safe).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=__name__)


def _file_state(st: os.stat_result) -> tuple[int, ...]:
    return st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns


#: How a page file's checksums are computed, as its index names them (``"checksum"``; an index
#: that names none is of versions 2-3, whose checksums are :data:`SUM64`).
SUM64 = "sum64"  # the wrapping int64 sum of a page's 64-bit words: blind to words that trade places
WEIGHTED64 = "weighted64"  # the wrapping int64 sum of word i times 2i + 1: what saves write now
CHECKSUM_KINDS = (SUM64, WEIGHTED64)


@functools.lru_cache(maxsize=8)
def _weights(words: int) -> torch.Tensor:
    return torch.arange(words, dtype=torch.int64) * 2 + 1


def page_checksums(pages: torch.Tensor, *, kind: str) -> np.ndarray:
    """Each page's checksum (``pages``: uint8 ``[n, page_bytes]``), as int64 of wrapping integer
    arithmetic (exact in any order: the same at any thread count).

    :data:`WEIGHTED64` sums word ``i`` of a page (its 64-bit little-endian words) times ``2i + 1``,
    modulo 2**64. Any change within one word changes it (an odd factor is invertible modulo
    2**64); a change of several words is missed with probability about 2**-64 for random damage;
    two words that trade places are missed only where they agree in their low 52 bits (the factors
    of words ``i`` and ``j`` differ by ``2(i - j)``, at most ``2**12`` for a 16 KiB page), and two
    blocks of words that trade places (sectors, cache lines) only where their sums agree modulo
    ``2**(63 - log2(distance))``. :data:`SUM64`, the plain sum that saves of versions 2-3 wrote,
    catches a change within one word but none of words or blocks that trade places. It costs
    about a third of the weighted sum (one thread, 94 MB: 3 ms and 9 ms here)."""
    if pages.shape[1] % 8:
        raise ArgumentError(f"page size {pages.shape[1]} is not a multiple of 8 bytes: pass pages as uint8 [n, page_bytes] "
                            f"with page_bytes a multiple of 8")
    words = pages.view(torch.int64)
    if kind == WEIGHTED64:
        return torch.mv(words, _weights(words.shape[1])).numpy()
    if kind == SUM64:
        return words.sum(dim=1).numpy()
    raise ArgumentError(f"unknown checksum kind {kind!r}: one of {CHECKSUM_KINDS}")


class MappedPages:
    """A mapped ``prefix_store.kv``: the page id of each file page in the store's arena, and which
    pages were verified against their checksums (each is, once, before it is first handed out).

    Checking may start at open, in a thread (:meth:`check_in_background`); :meth:`verify` checks
    whatever that thread has not reached. A page is checked by one of them, under the lock."""

    #: Pages one step of the background check reads under the lock (16 MiB of 16 KiB pages): what a
    #: first use that finds the thread busy waits for at most, besides its own pages.
    CHUNK = 1024

    def __init__(self, path: Path, fd: int, page_ids: Sequence[PageId], checksums: np.ndarray, *, page_bytes: int,
                 data_offset: int, kind: str, arena: object = None) -> None:
        self.path = path
        self.page_ids = page_ids
        self.arena = arena  # the page store whose ids page_ids are (what a cache's held pages name)
        self._fd = os.dup(fd)  # the mapped file itself (the folder's name may come to name another)
        weakref.finalize(self, os.close, self._fd)
        opened = os.fstat(self._fd)
        self._seen, self._links = _file_state(opened), opened.st_nlink
        self._first = int(page_ids[0]) if page_ids else 0  # the file's pages have consecutive ids
        self._checksums = checksums
        self._kind = kind  # how they were computed (page_checksums)
        self._verified = np.zeros(len(page_ids), dtype=bool)
        self._page_bytes = page_bytes
        self._offset = data_offset
        self._map = mmap.mmap(fd, 0, prot=mmap.PROT_READ) if page_ids else None  # read-only, the file's pages
        self._lock = threading.Lock()
        self._pid = os.getpid()  # a forked child makes its own lock (the thread may have held this one)
        self._thread: threading.Thread | None = None
        self.verified_bytes = 0  # bytes checked so far (what verification cost: see docs)

    def changed(self) -> bool:
        """Whether the mapped file was written since it was opened (its size, modification or
        change time differ: ``cp`` or ``rsync --inplace`` over it, a truncation): its pages, which
        the file's page cache backs, may no longer hold what was checked, or exist (a read past a
        truncated end is a SIGBUS). A save into the folder writes a new file and leaves this one as
        it was: renamed over this one, it unlinks it, which changes its change time (not its bytes), so
        a file that lost a link since it was opened is compared by its size and modification time."""
        st = os.fstat(self._fd)
        if st.st_nlink < self._links:
            return _file_state(st)[:-1] != self._seen[:-1]
        return _file_state(st) != self._seen

    def holds_from(self, arena: object, first: int) -> bool:
        """Whether pages whose ids start at ``first`` in ``arena`` are this file's (a mapped entry's,
        whose pages all come from the one file it was opened with: no id is looked at)."""
        return bool(self.page_ids) and arena is self.arena and first == self._first

    def holds(self, pages: HeldPages) -> bool:
        """Whether ``pages`` (a holder's) include a page of this file."""
        ids = pages.pages.get(self.arena)
        if ids is None or not self.page_ids:
            return False
        ids = ids[1]
        return bool(np.any((ids >= self._first) & (ids < self._first + len(self.page_ids))))

    def verify(self, pages: Sequence[PageId]) -> None:
        """Check every file page among ``pages`` not yet checked (their checksums,
        read straight from the file's pages, run by run); raise :class:`PrefixFileCorruptError`
        naming the first page whose bytes differ from its checksum."""
        n = len(self.page_ids)
        if self.verified_bytes == n * self._page_bytes:  # every page checked (the background check's end)
            return
        index = np.asarray(pages, dtype=np.int64) - self._first
        index = np.unique(index[(index >= 0) & (index < n)])
        if self._pid != os.getpid():  # a child forked while the check ran: no thread here, and the lock
            self._lock, self._pid = threading.Lock(), os.getpid()  # may have been held at the fork
        with self._lock:
            self._check(index)

    def check_in_background(self) -> None:
        """Start checking every page in a thread, :attr:`CHUNK` pages at a time, so that a
        file opened ahead of its first use (a server's start, a chat resumed while its user types)
        is checked by then and the first use reads no page twice; what the thread has not reached
        when an entry is first handed out, :meth:`verify` checks then. The thread stops at the
        first chunk that differs from its checksums: those pages stay unchecked, and the first
        use of an entry holding them raises as it would have without the thread. A process that
        exits meanwhile waits for the thread (a whole check: ~6 ms for 90 MiB)."""
        if self._thread is None and self.page_ids:
            # not a daemon: the interpreter waits for it before it finalizes (a daemon thread inside a
            # torch call when the process exits aborts it)
            self._thread = threading.Thread(target=self._check_all, name="hf_vkv prefix check")
            self._thread.start()

    def wait(self) -> None:
        """Return once the background check (if started) has stopped (tests, benchmarks)."""
        if self._thread is not None:
            self._thread.join()

    def _check_all(self) -> None:
        for lo in range(0, len(self.page_ids), self.CHUNK):
            try:
                with self._lock:
                    self._check(np.arange(lo, min(lo + self.CHUNK, len(self.page_ids))))
            except PrefixFileCorruptError:
                return

    def _check(self, index: np.ndarray) -> None:
        """Check the file pages ``index`` (sorted, distinct; under the lock) not checked yet, run by run."""
        todo = index[~self._verified[index]]
        if not len(todo):
            return
        breaks = np.flatnonzero(np.diff(todo) != 1) + 1
        for run in np.split(todo, breaks):
            lo, count = int(run[0]), len(run)
            data = torch.frombuffer(self._map, dtype=torch.uint8, count=count * self._page_bytes,
                                    offset=self._offset + lo * self._page_bytes)  # read-only pages, only read
            sums = page_checksums(data.view(count, self._page_bytes), kind=self._kind)
            bad = np.flatnonzero(sums != self._checksums[lo:lo + count])
            if len(bad):
                raise PrefixFileCorruptError(f"{self.path} is not whole: page {lo + int(bad[0])} differs from its "
                                             f"checksum (the file changed or was damaged after it was saved)")
            self._verified[lo:lo + count] = True
            self.verified_bytes += count * self._page_bytes
