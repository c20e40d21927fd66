"""The virtual buffer: a reservation, a page table and a backend, kept in step.

A :class:`VirtualBuffer` holds ``rows`` rows of up to ``capacity`` items of ``item_bytes`` bytes
(for the cache, an item is one token of a layer group). Row ``r``'s item ``t`` lives at byte
``r * row_stride + t * item_bytes`` of one reserved address range, and the row's physical pages are
mapped there in order, so a row is an ordinary strided tensor while its pages may be shared with
other rows or other buffers of the same :class:`Arena` (forks).

Every operation is a transaction: the page table changes first (pure bookkeeping, which checks
the budget before changing anything), then the backend creates, copies and maps; if any backend
call fails, the mappings done so far are undone, the table and the pool are restored exactly and
the error propagates. The buffer is then as it was before the call.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .backend import Backend
from .errors import BackendError, CacheClosedError, CapacityError
from .page_table import PageTable, Row
from .pool import PageId, PagePool

__all__ = ["Arena", "VirtualBuffer", "BufferStats"]


class Arena:
    """Physical memory for one cache on one device: a backend and the pool that tracks its pages.

    Buffers (and their forks) of one arena can share pages. Freed pages stay resident and are
    recycled; :meth:`trim` gives them back. When the last buffer closes, every page is released
    and the backend closed.
    """

    def __init__(self, backend: Backend, *, budget_bytes: int | None = None) -> None:
        if budget_bytes is not None and budget_bytes < backend.page_bytes:
            raise ValueError(
                f"budget_bytes={budget_bytes:,} is smaller than one page ({backend.page_bytes:,} bytes)"
            )
        budget_pages = sys.maxsize if budget_bytes is None else budget_bytes // backend.page_bytes
        self.backend = backend
        self.pool = PagePool(page_bytes=backend.page_bytes, budget_pages=budget_pages)
        self._open_buffers = 0
        self.closed = False

    @property
    def page_bytes(self) -> int:
        return self.backend.page_bytes

    def trim(self, *, keep_bytes: int = 0) -> int:
        """Release resident free pages beyond ``keep_bytes``; return the bytes released."""
        pages = self.pool.take_releasable(keep_bytes // self.page_bytes)
        self.backend.release(pages)
        return len(pages) * self.page_bytes

    def _buffer_opened(self) -> None:
        if self.closed:
            raise CacheClosedError("this arena was closed: its last buffer was freed; create a new cache")
        self._open_buffers += 1

    def _buffer_closed(self) -> None:
        self._open_buffers -= 1
        if self._open_buffers == 0 and not self.closed:
            self.trim()
            self.closed = True
            self.backend.close()


@dataclass(frozen=True, slots=True)
class BufferStats:
    """Memory accounting of one buffer (bytes; shared pages counted once)."""

    page_bytes: int
    mapped_slots: int  # page slots mapped over all rows (a shared page counts once per slot)
    distinct_pages: int  # physical pages these rows hold
    shared_pages: int  # of those, pages held by more than one slot anywhere in the arena
    resident_bytes: int  # distinct_pages * page_bytes
    live_bytes: int  # bytes of live items in those pages, each shared page counted once
    cow_copies: int  # pages copied on write over the buffer's life

    @property
    def utilization(self) -> float:
        """live_bytes / resident_bytes (1.0 when empty)."""
        return self.live_bytes / self.resident_bytes if self.resident_bytes else 1.0


class _Reservation:
    """A reserved address range, given back once the buffer and every view of it are gone.

    Views hold the reservation (not the buffer, which would make a cycle through its storage), so
    a buffer dropped while views of it live keeps its pages mapped until the last view goes: the
    ``closer`` (returning the pages) runs then, before the range is unreserved. An explicit
    ``close()`` runs the closer at once."""

    def __init__(self, backend: Backend, nbytes: int) -> None:
        self.address = backend.reserve(nbytes)
        self.nbytes = nbytes
        self.closer: _Closer | None = None
        # The finalizer reads the closer from the instance dict (not the instance: that would keep it alive).
        weakref.finalize(self, _release, self.__dict__, backend, self.address, nbytes)


class _Closer:
    """Returns a buffer's pages and unmaps its rows, once."""

    def __init__(self, table: PageTable, arena: Arena, address: int, row_stride: int) -> None:
        self._args: tuple[PageTable, Arena, int, int] | None = (table, arena, address, row_stride)

    def __call__(self) -> None:
        args, self._args = self._args, None
        if args is not None:
            _close(*args)


def _release(state: dict, backend: Backend, address: int, nbytes: int) -> None:
    """A reservation's end: return the pages still mapped in it, then give the range back."""
    try:
        if state.get("closer") is not None:
            state["closer"]()
    finally:
        backend.unreserve(address, nbytes)


class VirtualBuffer:
    """``rows`` rows of up to ``capacity`` items of ``item_bytes`` bytes each, mapped on demand.

    All lengths and positions are in items. A row's items ``[0, length)`` are readable through
    :meth:`view` (minus those dropped behind a window by :meth:`drop_before`); nothing else is
    mapped, and no view ever covers an unmapped byte.

    Invariant (besides the page table's): what is mapped at row ``r``'s page slot ``i`` is exactly
    ``table.row(r).page_at(i)`` for every live slot, and nothing at the other slots.
    """

    def __init__(self, arena: Arena, *, rows: int, capacity: int, item_bytes: int) -> None:
        if rows <= 0 or capacity <= 0 or item_bytes <= 0:
            raise ValueError(f"rows, capacity and item_bytes must be positive, got {rows}, {capacity}, {item_bytes}")
        page = arena.page_bytes
        self.arena = arena
        self.rows = rows
        self.capacity = capacity
        self.item_bytes = item_bytes
        self.row_stride = -(-capacity * item_bytes // page) * page
        arena._buffer_opened()
        try:
            self._table = PageTable(arena.pool, rows=rows, pages_per_row=self.row_stride // page, page_size=page)
            arena.backend.ensure_id_space(arena.pool.id_space)
            self._reservation = _Reservation(arena.backend, rows * self.row_stride)
            self._storage = arena.backend.tensor(self._reservation.address, rows * self.row_stride, self._reservation)
        except BaseException:
            arena._buffer_closed()
            raise
        self._closed = False
        self._reservation.closer = self._finalizer = _Closer(self._table, arena, self._reservation.address,
                                                             self.row_stride)

    # ----------------------------------------------------------------------------- queries
    @property
    def address(self) -> int:
        """Virtual address of row 0, item 0."""
        return self._reservation.address

    @property
    def table(self) -> PageTable:
        """The page table (read it; change it only through this buffer)."""
        return self._table

    def length(self, row: int) -> int:
        """Items row ``row`` holds."""
        return self._open().row(row).length // self.item_bytes

    def first_live(self, row: int) -> int:
        """The first item of ``row`` still mapped (> 0 once pages were dropped behind a window;
        ``length(row)`` when none is)."""
        r = self._open().row(row)
        return min(-(-r.start * self.arena.page_bytes // self.item_bytes), r.length // self.item_bytes)

    def view(self, rows: range, start: int, end: int) -> torch.Tensor:
        """A zero-copy ``uint8`` view ``[len(rows), (end - start) * item_bytes]`` of items
        ``[start, end)`` of each row (row stride ``row_stride``); valid until the next operation
        that changes those rows' pages (a write after copy-on-write goes to the new page only)."""
        table = self._open()
        if not isinstance(rows, range) or rows.step != 1 or not 0 <= rows.start <= rows.stop <= self.rows:
            raise ValueError(f"rows must be a range with step 1 inside 0..{self.rows}, got {rows!r}")
        for r in rows:
            row = table.row(r)
            if not 0 <= start <= end <= row.length // self.item_bytes or (
                end > start and start * self.item_bytes < row.start * self.arena.page_bytes
            ):
                raise ValueError(
                    f"items [{start}, {end}) of row {r} are not mapped (it holds "
                    f"[{self.first_live(r)}, {row.length // self.item_bytes}))"
                )
        offset = rows.start * self.row_stride + start * self.item_bytes
        return self._storage.as_strided((len(rows), (end - start) * self.item_bytes), (self.row_stride, 1), offset)

    def stats(self) -> BufferStats:
        """Memory accounting (see :class:`BufferStats`)."""
        table = self._open()
        page = self.arena.page_bytes
        used: dict[PageId, int] = {}
        slots = 0
        for row in table:
            slots += len(row.pages)
            for k, p in enumerate(row.pages):
                fill = min(page, row.length - (row.start + k) * page)
                if fill > used.get(p, 0):
                    used[p] = fill
        pool = self.arena.pool
        return BufferStats(
            page_bytes=page,
            mapped_slots=slots,
            distinct_pages=len(used),
            shared_pages=sum(1 for p in used if pool.is_shared(p)),
            resident_bytes=len(used) * page,
            live_bytes=sum(used.values()),
            cow_copies=table.cow_copies,
        )

    def check_invariants(self) -> None:
        """Check the page table's and the pool's invariants (mappings follow the table by
        construction; the state-machine tests check them through the views)."""
        self._open().check_invariants()

    # ----------------------------------------------------------------------------- operations
    def grow(self, rows: Iterable[int], length: int) -> None:
        """Make each row hold at least ``length`` items (new items are uninitialized)."""
        self._check_capacity(length)
        with self._transaction() as table:
            self._create([p for r in rows for p in table.grow(r, length * self.item_bytes)])

    def prepare_write(self, rows: Iterable[int], start: int, end: int) -> None:
        """Get items ``[start, end)`` of each row ready to be written through a view: grow the
        rows to ``end`` and give them private copies of shared pages in the range (copy-on-write)."""
        self._check_capacity(end)
        if start < 0 or start > end:
            raise ValueError(f"invalid write range [{start}, {end})")
        with self._transaction() as table:
            ib = self.item_bytes
            for r in rows:
                self._create(table.grow(r, end * ib))
                copies, created = table.cow(r, start * ib, end * ib)
                self._create(created)
                self.arena.backend.copy([(c.src, c.dst) for c in copies])

    def share(self, src: int, dsts: Iterable[int], *, length: int | None = None) -> None:
        """Make each row of ``dsts`` hold the first ``length`` items of ``src`` (all by default)
        on the same physical pages: no bytes move."""
        with self._transaction() as table:
            units = None if length is None else length * self.item_bytes
            for d in dsts:
                if d != src:
                    table.share(src, d, length=units)

    def reorder(self, index: Sequence[int]) -> None:
        """Row ``i`` takes row ``index[i]``'s pages (duplicates allowed); later rows are emptied."""
        with self._transaction() as table:
            table.reorder(index)

    def truncate(self, rows: Iterable[int], length: int) -> None:
        """Shrink each row to ``length`` items (rows already shorter are left alone)."""
        with self._transaction() as table:
            for r in rows:
                table.truncate(r, min(length * self.item_bytes, table.row(r).length))

    def drop_before(self, rows: Iterable[int], item: int) -> None:
        """Unmap and drop the pages of each row that lie wholly before ``item``."""
        with self._transaction() as table:
            for r in rows:
                table.drop_before(r, min(item * self.item_bytes, table.row(r).length))

    def clear(self, rows: Iterable[int]) -> None:
        """Empty the rows, returning their pages."""
        with self._transaction() as table:
            for r in rows:
                table.clear(r)

    def fork(self, *, rows: int | None = None) -> VirtualBuffer:
        """A new buffer of the same arena whose rows share this buffer's pages (zero copy).

        ``rows`` (default: the same) sizes the new reservation; rows past it must be empty."""
        table = self._open()
        rows = self.rows if rows is None else rows
        extra = [r for r in range(rows, self.rows) if table.row(r).length]
        if extra:
            raise ValueError(f"cannot fork into {rows} rows: rows {extra[:4]} hold items")
        other = VirtualBuffer(self.arena, rows=rows, capacity=self.capacity, item_bytes=self.item_bytes)
        try:
            with other._transaction() as new:
                for r in range(min(rows, self.rows)):
                    new.assign(r, table.row(r))
        except BaseException:
            other.close()  # now, not when a traceback that holds it goes: it counts as an open buffer
            raise
        return other

    def close(self) -> None:
        """Return every page and unmap the rows. Views taken earlier must not be used again."""
        if not self._closed:
            self._closed = True
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    # ----------------------------------------------------------------------------- internals
    def _open(self) -> PageTable:
        if self._closed:
            raise CacheClosedError("this buffer was closed and its pages returned; create a new cache")
        return self._table

    def _check_capacity(self, length: int) -> None:
        if length > self.capacity:
            raise CapacityError(
                f"{length} items do not fit: rows were reserved for {self.capacity}; create the cache "
                f"with a larger max length (max_cache_len / max_new_tokens)"
            )

    def _create(self, pages: list[PageId]) -> None:
        if pages:
            self.arena.backend.ensure_id_space(self.arena.pool.id_space)
            self.arena.backend.create(pages)
            self._created.extend(pages)

    @contextmanager
    def _transaction(self) -> Iterator[PageTable]:
        table = self._open()
        pool = self.arena.pool
        pool.begin()
        table.begin()
        self._created: list[PageId] = []
        try:
            yield table
            self._sync(table.changed_rows())
        except BaseException:
            table.rollback()
            pool.rollback()
            if self._created:
                self.arena.backend.release(self._created)
            raise
        else:
            table.commit()
            pool.commit()
        finally:
            self._created = []

    def _slot_address(self, row: int, index: int) -> int:
        return self._reservation.address + row * self.row_stride + index * self.arena.page_bytes

    def _sync(self, changed: dict[int, Row]) -> None:
        """Make the mappings of the changed rows follow the table; undo all of it on failure."""
        done: list[tuple[int, int, list[PageId | None], list[PageId | None]]] = []
        try:
            for r, old in changed.items():
                for first, before, after in _slot_changes(old, self._table.row(r)):
                    self._apply(r, first, after, before)
                    done.append((r, first, before, after))
        except BaseException:
            for r, first, before, after in reversed(done):
                self._apply(r, first, before, after)
            raise

    def _apply(self, row: int, first: int, pages: list[PageId | None], before: list[PageId | None]) -> None:
        """Set slots ``first ..`` of ``row`` to ``pages`` (None = unmapped), atomically."""
        backend = self.arena.backend
        k = j = 0
        try:
            while k < len(pages):
                j = k + 1
                while j < len(pages) and (pages[j] is None) == (pages[k] is None):
                    j += 1
                address = self._slot_address(row, first + k)
                if pages[k] is None:
                    backend.unmap(address, j - k)
                else:
                    backend.map(address, pages[k:j])  # type: ignore[arg-type]
                k = j
        except BaseException:
            # Restore up to j, not k: a failed map of several runs may have mapped a prefix of them.
            if j:
                try:
                    self._apply(row, first, before[:j], pages[:j])
                except BaseException as again:
                    raise BackendError("rollback", f"could not restore the mappings ({again}); "
                                                   "this cache is unusable") from again
            raise


def _slot_changes(old: Row, new: Row) -> list[tuple[int, list[PageId | None], list[PageId | None]]]:
    """Runs of consecutive page slots whose page differs: ``(first slot, old pages, new pages)``."""
    lo = min(old.start if old.pages else new.start, new.start if new.pages else old.start)
    hi = max(old.end, new.end)
    a, b = max(old.start, new.start), min(old.end, new.end)
    if a < b and old.pages[a - old.start: b - old.start] == new.pages[a - new.start: b - new.start]:
        slots = [*range(lo, a), *range(b, hi)]
    else:
        slots = list(range(lo, hi))
    runs: list[tuple[int, list[PageId | None], list[PageId | None]]] = []
    for i in slots:
        before = old.pages[i - old.start] if old.start <= i < old.end else None
        after = new.pages[i - new.start] if new.start <= i < new.end else None
        if before == after:
            continue
        if runs and runs[-1][0] + len(runs[-1][1]) == i:
            runs[-1][1].append(before)
            runs[-1][2].append(after)
        else:
            runs.append((i, [before], [after]))
    return runs


def _close(table: PageTable, arena: Arena, address: int, row_stride: int) -> None:
    """Return a buffer's pages and unmap its rows (also run when a buffer is garbage-collected)."""
    try:
        if not arena.closed:
            pages = arena.page_bytes
            try:
                for r, row in enumerate(table):
                    if row.pages:
                        arena.backend.unmap(address + r * row_stride + row.start * pages, len(row.pages))
            finally:  # the pages go back even if an unmap failed: the closed buffer is never read again
                for r in range(table.rows):
                    table.clear(r)
    finally:
        arena._buffer_closed()
