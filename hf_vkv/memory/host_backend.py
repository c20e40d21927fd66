"""The host (CPU) backend: a memfd plays physical memory, ``mmap`` maps its pages into reservations.

* physical page ``p`` = bytes ``[p * page_bytes, (p + 1) * page_bytes)`` of one ``memfd`` (sparse:
  only touched pages hold memory);
* reserve = ``mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)``; a *readable*
  reservation is the same mapping with ``PROT_READ | PROT_WRITE``: its unbacked pages read as the
  shared zero page and cost nothing until written (a write there lands in a private page of its own);
* map = ``mmap(MAP_SHARED | MAP_FIXED, memfd, p * page_bytes)``, one call per run of consecutive
  ids (so the kernel merges a row's pages into one mapping: Linux allows ``vm.max_map_count``);
* unmap = re-reserve the range as it was reserved (``munmap`` would open a hole that an unrelated
  ``mmap`` could take); a ``MAP_FIXED`` that fails is followed by the same re-reserve, so a failed
  map or unmap never leaves a hole, and :meth:`HostBackend.reset` re-reserves a whole reservation
  in one call (the last resort of a rollback);
* mappings count against ``vm.max_map_count``: buffers check :data:`map_budget` before they change any;
* release = ``fallocate(PUNCH_HOLE)``; resident bytes = the memfd's allocated blocks (RSS counts an
  aliased page once per mapping);
* a page of a mapped file (:meth:`HostBackend.map_file`: an external page of the pool, a saved
  prefix's) is mapped ``MAP_PRIVATE`` and read-only from the file: opening costs no read and no copy,
  processes that map one file share its page cache, and nothing is ever written into the file (the
  pool never lets a table write an external page: a row that writes gets a copy in the memfd).

Reading an unmapped address kills the process with SIGSEGV: callers never build views over it.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import os
import weakref
from collections.abc import Callable, Sequence

import torch

from .errors import ArgumentError, BackendError, CacheClosedError, InvariantError
from .interrupts import register_critical
from .limits import MAX_HOST_PAGE_BYTES, PageSizeError, check_page_bytes
from .map_budget import PROCESS_MAP_BUDGET, process_mappings, read_max_map_count
from .pool import PageId
from .runs import consecutive_runs, is_one_run

__all__ = ["HostBackend"]


_PROT_NONE, _PROT_READ, _PROT_RW = 0x0, 0x1, 0x3
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc: ctypes.CDLL | None = None


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}  # bytes -> a dtype that wide


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        try:  # glibc's soname: no ``find_library``, which runs ``ldconfig -p`` in a subprocess (~2 ms)
            lib = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:  # another C library
            lib = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.fallocate.restype = ctypes.c_int
        lib.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        _libc = lib
    return _libc


def _mmap(address: int | None, nbytes: int, prot: int, flags: int, fd: int, offset: int) -> int:
    out = _lib().mmap(address, nbytes, prot, flags, fd, offset)
    if out is None or out == _MAP_FAILED:
        err = ctypes.get_errno()
        where = "anywhere" if address is None else f"{address:#x}"
        hint = ""
        if err == errno.ENOMEM:  # the usual cause at a fixed address: the mapping limit, not memory
            hint = (f"; the process holds {process_mappings():,} mappings and vm.max_map_count is "
                    f"{read_max_map_count():,}")
        raise BackendError("mmap", f"{os.strerror(err)} (errno {err}; {nbytes:,} bytes at {where}{hint})")
    if address is not None and flags & _MAP_FIXED and out != address:
        raise BackendError("mmap", f"MAP_FIXED returned {out:#x} instead of {address:#x}")
    return int(out)


@register_critical  # a finalizer's
def _munmap(address: int, nbytes: int) -> None:
    if _lib().munmap(address, nbytes) != 0:
        err = ctypes.get_errno()
        raise BackendError("munmap", f"{os.strerror(err)} (errno {err})")


class _Mapping:
    """An address range that is unmapped once nothing (no tensor) refers to it any more."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.address = address
        self.nbytes = nbytes
        self._finalizer = weakref.finalize(self, _munmap, address, nbytes)


class _File:
    """A mapped file's own descriptor, and a read-only view of all of it made on first need
    (the source of copies out of its pages)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._view: torch.Tensor | None = None
        self._finalizer = weakref.finalize(self, os.close, fd)

    def view(self) -> torch.Tensor:
        if self._view is None:
            size = os.fstat(self.fd).st_size
            address = _mmap(None, size, _PROT_READ, _MAP_SHARED, self.fd, 0)
            mapping = _Mapping(address, size)
            memory = (ctypes.c_uint8 * size).from_address(address)
            memory._hf_vkv_owner = mapping  # type: ignore[attr-defined]
            self._view = torch.frombuffer(memory, dtype=torch.uint8)
        return self._view

    def close(self) -> None:
        self._view = None
        self._finalizer()


class HostBackend:
    """Physical pages in a ``memfd``, mapped with ``mmap`` (see the module docstring).

    ``page_bytes`` must be a multiple of the OS page size. The memfd grows (sparsely) with the id
    space; nothing is committed until a page is first written.
    """

    def __init__(self, *, page_bytes: int, name: str = "hf_vkv") -> None:
        if page_bytes <= 0 or page_bytes % mmap.PAGESIZE:
            raise PageSizeError(
                f"page_bytes must be a positive multiple of the OS page size ({mmap.PAGESIZE}), got {page_bytes} "
                f"(cache_config['page_bytes']; leave it unset for the layout's default)"
            )
        check_page_bytes(page_bytes, low=mmap.PAGESIZE, high=MAX_HOST_PAGE_BYTES, where=" of the host (CPU)")
        self.page_bytes = page_bytes
        self.device = torch.device("cpu")
        self.map_budget = PROCESS_MAP_BUDGET  # vm.max_map_count is per process
        self._fd = os.memfd_create(name, os.MFD_CLOEXEC)
        self._id_space = 0
        self._pool_view: tuple[_Mapping, torch.Tensor] | None = None
        self._reservations: dict[int, int] = {}  # address -> bytes
        self._readable: set[int] = set()  # addresses of the reservations made readable
        self._closed = False
        self._fd_finalizer = weakref.finalize(self, os.close, self._fd)
        self._files: list[_File | None] = []  # mapped files (map_file), by index (None: closed, every page retired)
        # each map_file call's pages: (lowest id, highest id, file index, byte offset of the lowest)
        self._file_spans: list[tuple[int, int, int, int]] = []

    def _fd_open(self) -> int:
        if self._closed:
            raise CacheClosedError("this host backend was closed; create a new cache")
        return self._fd

    # ----------------------------------------------------------------------------- physical pages
    def ensure_id_space(self, num_pages: int) -> None:
        if num_pages > self._id_space:
            try:
                os.ftruncate(self._fd_open(), num_pages * self.page_bytes)
            except OSError as exc:
                raise BackendError("ftruncate", str(exc)) from exc
            self._id_space = num_pages
            self._pool_view = None

    def create(self, pages: Sequence[PageId]) -> None:
        # A memfd page becomes resident on first touch; only check the ids are addressable.
        self._fd_open()
        for page in pages:
            if not 0 <= page < self._id_space:
                raise BackendError("create", f"page {page} is outside the id space {self._id_space}")

    def release(self, pages: Sequence[PageId]) -> None:
        fd = self._fd_open()
        for first, count in consecutive_runs(sorted(pages)):
            rc = _lib().fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                                  first * self.page_bytes, count * self.page_bytes)
            if rc != 0:
                err = ctypes.get_errno()
                raise BackendError("fallocate(PUNCH_HOLE)", f"{os.strerror(err)} (errno {err})")

    def resident_bytes(self) -> int:
        return os.fstat(self._fd_open()).st_blocks * 512

    # ----------------------------------------------------------------------------- address space
    def reserve(self, nbytes: int, *, readable: bool = False) -> int:
        if nbytes <= 0 or nbytes % self.page_bytes:
            raise ArgumentError(f"nbytes must be a positive multiple of page_bytes ({self.page_bytes}), got {nbytes}")
        prot = _PROT_RW if readable else _PROT_NONE
        raw = _mmap(None, nbytes + self.page_bytes, prot, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        base = -(-raw // self.page_bytes) * self.page_bytes
        if base > raw:
            _munmap(raw, base - raw)
        tail = raw + nbytes + self.page_bytes - (base + nbytes)
        if tail:
            _munmap(base + nbytes, tail)
        self._reservations[base] = nbytes
        if readable:
            self._readable.add(base)
        return base

    def unreserve(self, address: int, nbytes: int) -> None:
        if self._reservations.get(address) != nbytes:  # a wrong call must not lose the record
            raise BackendError("unreserve", f"no reservation of {nbytes} bytes at {address:#x}")
        del self._reservations[address]
        self._readable.discard(address)
        _munmap(address, nbytes)

    def map(self, address: int, pages: Sequence[PageId]) -> None:
        fd = self._fd_open()
        pos = 0  # where the run starts in ``pages``
        for first, count in consecutive_runs(pages):
            if first + count > self._id_space:
                raise BackendError("mmap", f"pages {first}..{first + count - 1} outside id space {self._id_space}")
            runs = [(first, count, fd, first * self.page_bytes, _PROT_RW, _MAP_SHARED)]
            if self._file_spans and any(lo < first + count and first <= hi for lo, hi, _, _ in self._file_spans):
                runs = self._split_by_source(first, count)
            for start, n, src_fd, offset, prot, share in runs:
                at, nbytes = address + (pos + start - first) * self.page_bytes, n * self.page_bytes
                try:
                    _mmap(at, nbytes, prot, share | _MAP_FIXED, src_fd, offset)
                except BackendError:
                    self._rereserve(at, nbytes)  # a failed MAP_FIXED may have unmapped the range: no hole
                    raise
            pos += count

    def _split_by_source(self, first: int, count: int) -> list[tuple[int, int, int, int, int, int]]:
        """Ids ``first .. first + count - 1`` as runs ``(id, pages, fd, offset, prot, flags)`` that
        one ``mmap`` each maps: memfd pages, or the pages of one :meth:`map_file` call (whose ids
        are consecutive at consecutive offsets of its file)."""
        out: list[tuple[int, int, int, int, int, int]] = []
        page, end = first, first + count
        while page < end:
            span = self._span_of(page)
            if span is not None:
                lo, hi, index, offset = span
                stop = min(end, hi + 1)
                out.append((page, stop - page, self._file(index).fd, offset + (page - lo) * self.page_bytes,
                            _PROT_READ, _MAP_PRIVATE))
            else:
                stop = min([end, *(lo for lo, _, _, _ in self._file_spans if lo > page)])
                out.append((page, stop - page, self._fd, page * self.page_bytes, _PROT_RW, _MAP_SHARED))
            page = stop
        return out

    # ----------------------------------------------------------------------------- mapped files
    def map_file(self, fd: int, offset: int, pages: Sequence[PageId]) -> None:
        """Back the external ``pages`` (new ids, none mapped yet) by the file open as ``fd``: page
        ``pages[i]`` is bytes ``[offset + i * page_bytes, offset + (i + 1) * page_bytes)`` of it.
        The backend keeps its own descriptor (a ``dup``); ``offset`` must be a multiple of the OS
        page size and the file must hold every page (else :class:`BackendError`, nothing kept)."""
        self._fd_open()
        if offset < 0 or offset % mmap.PAGESIZE:
            raise BackendError("map_file", f"offset {offset} is not a multiple of the OS page size {mmap.PAGESIZE}")
        size = os.fstat(fd).st_size
        if offset + len(pages) * self.page_bytes > size:
            raise BackendError("map_file", f"the file holds {size:,} bytes, not {len(pages)} pages of "
                                           f"{self.page_bytes:,} from byte {offset:,}")
        if pages and not is_one_run(pages):
            raise BackendError("map_file", "the pages of one file must be consecutive ids, in order")
        if pages and (not 0 <= pages[0] <= pages[-1] < self._id_space
                      or any(lo <= pages[-1] and pages[0] <= hi for lo, hi, _, _ in self._file_spans)):
            raise BackendError("map_file", f"pages {pages[0]}..{pages[-1]} are already backed by a file or outside "
                                           f"the id space")
        own = os.dup(fd)
        self._files.append(_File(own))
        if pages:
            self._file_spans.append((pages[0], pages[-1], len(self._files) - 1, offset))

    def _file(self, index: int) -> _File:
        file = self._files[index]
        if file is None:  # a span's file is closed with the span
            raise InvariantError(f"mapped file {index} was closed while a span still named it (a bug in hf_vkv)")
        return file

    def close_files(self, retired: Callable[[int, int], bool]) -> int:
        """Close the mapped files whose every page ``retired(lowest id, highest id)`` says is
        retired (no table holds one, and no id of them is handed out again); returns how many.
        Mappings made of them stay valid (a mapping keeps its file)."""
        gone = [span for span in self._file_spans if retired(span[0], span[1])]
        for _, _, index, _ in gone:
            file = self._files[index]
            if file is not None:
                file.close()
                self._files[index] = None
        if gone:
            self._file_spans = [span for span in self._file_spans if span not in gone]
        return len(gone)

    def _span_of(self, page: int) -> tuple[int, int, int, int] | None:
        """The :meth:`map_file` span ``(lowest id, highest id, file index, byte offset)`` holding ``page``."""
        return next((span for span in self._file_spans if span[0] <= page <= span[1]), None)

    def read_pages(self, pages: Sequence[PageId]) -> torch.Tensor:
        """A ``uint8`` copy ``[len(pages), page_bytes]`` of ``pages`` (resident or file pages)."""
        return self._gather(pages, self.page_bytes)

    def _gather(self, pages: Sequence[PageId], nbytes: int) -> torch.Tensor:
        """A ``uint8`` copy ``[len(pages), nbytes]`` of the first ``nbytes`` of each of ``pages``
        (resident pages from the memfd, a mapped file's from its read-only view), read by one
        gather per source, in words as wide as ``nbytes`` allows (a byte gather is ~6x slower)."""
        word = _word(nbytes, self.page_bytes)
        ids = _ids(pages)
        pool = self.pool_tensor().view(_WORDS[word])[:, :nbytes // word]
        if not self._file_spans:
            return pool.index_select(0, ids).view(torch.uint8)
        out = torch.empty(len(pages), nbytes // word, dtype=_WORDS[word])
        left = None  # the rows no file holds (None: every row)
        for lo, hi, index, offset in self._file_spans:
            hit = (ids >= lo) & (ids <= hi)
            if not bool(hit.any()):
                continue
            rows = hit.nonzero().squeeze(1)
            file = self._file(index).view()[offset:offset + (hi - lo + 1) * self.page_bytes]
            source = file.view(hi - lo + 1, self.page_bytes).view(_WORDS[word])[:, :nbytes // word]
            out.index_copy_(0, rows, source.index_select(0, ids.index_select(0, rows) - lo))
            left = ~hit if left is None else left & ~hit
        if left is None:
            out.copy_(pool.index_select(0, ids))
        elif bool(left.any()):
            rows = left.nonzero().squeeze(1)
            out.index_copy_(0, rows, pool.index_select(0, ids.index_select(0, rows)))
        return out.view(torch.uint8)

    def file_pages(self) -> int:
        """Pages backed by mapped files (ever: a retired page keeps its file)."""
        return sum(hi - lo + 1 for lo, hi, _, _ in self._file_spans)

    def unmap(self, address: int, num_pages: int) -> None:
        if num_pages:
            try:
                self._rereserve_or_raise(address, num_pages * self.page_bytes)
            except BackendError:
                self._rereserve(address, num_pages * self.page_bytes)  # one more try: no hole
                raise

    def reset(self, address: int, nbytes: int) -> None:
        """Unmap everything in the reservation at ``address`` with one call: it is reserved (and
        readable if it was reserved so) and holds no page afterwards."""
        if self._reservations.get(address) != nbytes:
            raise BackendError("reset", f"no reservation of {nbytes} bytes at {address:#x}")
        self._rereserve_or_raise(address, nbytes)

    def _rereserve_or_raise(self, address: int, nbytes: int) -> None:
        prot = _PROT_RW if self._in_readable(address) else _PROT_NONE
        _mmap(address, nbytes, prot, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0)

    def _rereserve(self, address: int, nbytes: int) -> None:
        """Best effort after a failure (the caller raises the first error, and its rollback or
        :meth:`reset` restores the range)."""
        with contextlib.suppress(BackendError):
            self._rereserve_or_raise(address, nbytes)

    def _in_readable(self, address: int) -> bool:
        """Whether ``address`` lies in a reservation made with ``readable=True``."""
        return any(base <= address < base + self._reservations[base] for base in self._readable)

    # ----------------------------------------------------------------------------- tensors
    def tensor(self, address: int, nbytes: int, owner: object) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        memory = (ctypes.c_uint8 * nbytes).from_address(address)
        memory._hf_vkv_owner = owner  # type: ignore[attr-defined]  # keeps the address range alive
        return torch.frombuffer(memory, dtype=torch.uint8)

    def pool_tensor(self) -> torch.Tensor:
        """A zero-copy ``uint8`` tensor ``[id_space, page_bytes]``: every physical page by id (only
        resident pages may be read or written). Host only: page copies and tests use it."""
        if self._pool_view is None:
            if self._id_space == 0:
                return torch.empty(0, self.page_bytes, dtype=torch.uint8)
            nbytes = self._id_space * self.page_bytes
            address = _mmap(None, nbytes, _PROT_RW, _MAP_SHARED, self._fd_open(), 0)
            mapping = _Mapping(address, nbytes)
            self._pool_view = (mapping, self.tensor(address, nbytes, mapping).view(self._id_space, self.page_bytes))
        return self._pool_view[1]

    #: :meth:`copy` reads every source page before it writes any destination.
    gathered_copies = True

    def copy(self, pairs: Sequence[tuple[PageId, PageId]], nbytes: Sequence[int] | None = None) -> None:
        if not pairs:
            return
        view = self.pool_tensor()
        sizes = [self.page_bytes] * len(pairs) if nbytes is None else list(nbytes)
        src, dst = zip(*pairs)
        written = _ids(dst)
        for lo, hi, _, _ in self._file_spans:
            hit = ((written >= lo) & (written <= hi)).nonzero()
            if len(hit):
                raise BackendError("copy", f"page {dst[int(hit[0])]} is a page of a mapped file: it is never written")
        if len(pairs) > 1 and len(set(sizes)) == 1:  # one gathered copy (a reorder's tails, a fresh row's)
            data = self._gather(src, sizes[0])  # every source read before any write
            n = sizes[0]
            word = _WORDS[_word(n, self.page_bytes)]
            view.view(word)[:, :n // word.itemsize].index_copy_(0, written, data.view(word))
            return
        # only the written part: the rest of a fresh page is never read before written
        read = [self._gather((s,), n) for s, n in zip(src, sizes)]
        for d, n, data in zip(dst, sizes, read):
            view[d, :n].copy_(data[0])

    def close(self) -> None:
        """Close the memfd: its memory goes once no mapping refers to it. Reservations are given
        back by their owners (see :meth:`tensor`), not here, so no live view loses its range."""
        if not self._closed:
            self._closed = True
            self._pool_view = None
            self._fd_finalizer()
            for f in self._files:  # mappings of them stay valid until their reservations go
                if f is not None:
                    f.close()


def _word(nbytes: int, page_bytes: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides both sizes: what a page copy moves."""
    return next(w for w in (8, 4, 2, 1) if not nbytes % w and not page_bytes % w)


def _ids(pages: Sequence[int]) -> torch.Tensor:
    """An int64 tensor of page ids, through a C array (``torch.tensor`` of a list is ~8x slower
    for the hundreds of ids a beam reorder copies)."""
    return torch.frombuffer(array.array("q", pages), dtype=torch.int64)
