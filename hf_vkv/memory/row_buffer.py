"""Rows of items over one page table: the operations both translators share.

A :class:`RowBuffer` holds ``rows`` rows of up to ``capacity`` items of ``item_bytes`` bytes (for
the cache, an item is one token of a layer group). Every feature is a page-table operation here;
the two subclasses only differ in how a page table becomes something attention reads:

* :class:`~hf_vkv.memory.virtual_buffer.VirtualBuffer` maps each row's pages, in order, into the row's
  slice of one reserved address range (the contiguous layout: the MMU translates);
* :class:`~hf_vkv.memory.block_buffer.BlockBuffer` leaves the pages (blocks) where they are and hands
  out block tables (the paged layout: the attention kernel translates).

Every operation is a transaction: the page table changes first (pure bookkeeping, which checks
the budget before changing anything), then the page store creates and copies pages and the
subclass syncs its translation; if any of that fails, the table and the pool are restored
exactly, pages created on the way are given back, and the error propagates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from .errors import ArgumentError, CacheClosedError, CacheIndexError, CapacityError, InvariantError
from .interrupts import register_critical
from .invariants import check_pages
from .page_store import PageStore
from .page_table import CowCopy, PageTable, Row
from .table_records import EMPTY_ROW
from .reorder_plan import common_prefix
from .pool import PageId

__all__ = ["RowBuffer", "BufferStats", "return_pages"]

_CLOSED = "this buffer was closed and its pages returned; create a new cache"

_Self = TypeVar("_Self", bound="RowBuffer")


@dataclass(frozen=True, slots=True)
class BufferStats:
    """Memory accounting of one buffer (bytes; shared pages counted once)."""

    page_bytes: int
    mapped_slots: int  # page slots of all rows that hold a page (a shared page counts once per slot)
    distinct_pages: int  # pages these rows hold
    shared_pages: int  # of those, pages held by more than one table entry anywhere in the store
    resident_bytes: int  # distinct_pages * page_bytes
    live_bytes: int  # bytes of live items in those pages, each shared page counted once
    cow_copies: int  # pages copied on write over the buffer's life
    tail_copies: int = 0  # partly written pages reorders copied into a row's own page (instead of a later CoW)
    mappings: int = 0  # kernel mappings (vm.max_map_count) the buffer's reservation holds (0: none counted)

    @property
    def utilization(self) -> float:
        """live_bytes / resident_bytes (1.0 when empty)."""
        return self.live_bytes / self.resident_bytes if self.resident_bytes else 1.0


class RowBuffer(ABC):
    """``rows`` rows of up to ``capacity`` items of ``item_bytes`` bytes, in pages of ``store``.

    All lengths and positions are in items; the page table counts bytes (``page_size`` =
    ``store.page_bytes``). A row holds items ``[0, length)``, minus the pages dropped behind a
    window by :meth:`drop_before`. The buffer's table is open in its store from construction to
    :meth:`close` (the store closes with its last buffer).

    A row may be ``parts`` page-table rows (sub-rows) that always hold the same items: every
    operation on a row applies to each of its parts, and :meth:`table_rows` says which table
    rows they are (by default the ``parts`` consecutive ones; a translator may interleave them
    through :meth:`_part_rows`, asked once per row at construction).

    Subclasses implement :meth:`_sync` (make the translation follow changed table rows) and
    :meth:`_sibling` (an empty buffer of the same kind, for :meth:`fork`), and set ``_finalizer``
    (run once, by :meth:`close` or when the buffer is collected: it returns the pages, see
    :func:`return_pages`).
    """

    #: Whether a page that changes in a row costs a translation change (a remap), so that copying
    #: a partly written page in place can be cheaper than pointing the row at another page.
    remaps_cost: bool = False

    def __init__(self, store: PageStore, *, rows: int, capacity: int, item_bytes: int, hinted: bool,
                 parts: int = 1) -> None:
        if rows <= 0 or capacity <= 0 or item_bytes <= 0 or parts <= 0:
            raise ArgumentError(f"rows, capacity, item_bytes and parts must be positive, got {rows}, {capacity}, "
                                f"{item_bytes}, {parts}")
        page = store.page_bytes
        self.store = store
        self.rows = rows
        self.parts = parts
        self.capacity = capacity
        self.item_bytes = item_bytes
        self.pages_per_row = -(-capacity * item_bytes // page)
        # row -> its table rows, built once: a decode step expands rows without a call per row
        self._parts: list[tuple[int, ...]] = [tuple(self._part_rows(r)) for r in range(rows)]
        with store.lock:  # a new table adds a segment of ids to the pool another thread may be using
            self._table = PageTable(store.pool, rows=rows * parts, pages_per_row=self.pages_per_row, page_size=page,
                                    hinted=hinted)
            store.buffer_opened(self._table)  # a subclass whose own set-up fails calls store.buffer_closed()
        self._created: list[PageId] = []
        self._late_copies: list[CowCopy] = []  # a transaction's last step (see _transaction) ...
        self._late_written: int | None = None  # ... of the rows' first bytes that many (None: their lengths)
        self._closed = False
        self._finalizer: Callable[[], object]

    # ----------------------------------------------------------------------------- queries
    @property
    def table(self) -> PageTable:
        """The page table (read it; change it only through this buffer)."""
        return self._table

    @property
    def closed(self) -> bool:
        return self._closed

    def table_rows(self, row: int) -> Sequence[int]:
        """The page-table rows that hold ``row``'s parts, in part order."""
        return self._expand((row,))

    def _part_rows(self, row: int) -> Sequence[int]:
        """The table rows of ``row``'s parts (``row`` in range): by default ``parts`` consecutive ones."""
        return range(row * self.parts, (row + 1) * self.parts)

    def _first(self, row: int) -> Row:
        """The table of ``row``'s first part (every part holds the same items)."""
        return self._open().row(self.table_rows(row)[0])

    def length(self, row: int) -> int:
        """Items row ``row`` holds."""
        return self._first(row).length // self.item_bytes

    def first_live(self, row: int) -> int:
        """The first item of ``row`` still held (> 0 once pages were dropped behind a window;
        ``length(row)`` when none is)."""
        r = self._first(row)
        return min(-(-r.start * self.store.page_bytes // self.item_bytes), r.length // self.item_bytes)

    def shared_items(self, row: int, other: int) -> int:
        """Items ``[0, n)`` that ``row`` and ``other`` hold on the same physical pages (so equal
        bytes), read from their first parts: every row operation applies to all parts of a row
        alike (:meth:`check_shared_parts` checks it). 0 when either dropped pages behind a window."""
        a, b = self._first(row), self._first(other)
        if a.start or b.start:
            return 0
        pages = common_prefix(a.pages, b.pages, min(len(a.pages), len(b.pages)) - 1)  # beams: all but the tail
        return min(pages * self.store.page_bytes, a.length, b.length) // self.item_bytes

    def check_shared_parts(self, rows: Sequence[int]) -> None:
        """Raise :class:`~hf_vkv.memory.errors.InvariantError` unless every part of ``rows``
        shares pages with the same part of another row exactly where the first parts do (the
        premise of :meth:`shared_items`)."""
        table = self._open()
        for i in rows:
            for j in rows:
                if i < j:
                    shapes = {tuple(p == q for p, q in zip(table.row(a).pages, table.row(b).pages))
                              for a, b in zip(self.table_rows(i), self.table_rows(j))}
                    if len(shapes) > 1:
                        raise InvariantError(f"rows {i} and {j} share different pages in different parts")

    def stats(self) -> BufferStats:
        """Memory accounting (see :class:`BufferStats`)."""
        table = self._open()
        page = self.store.page_bytes
        used: dict[PageId, int] = {}
        slots = 0
        for row in table:
            slots += len(row.pages)
            for k, p in enumerate(row.pages):
                fill = min(page, row.length - (row.start + k) * page)
                if fill > used.get(p, 0):
                    used[p] = fill
        pool = self.store.pool
        return BufferStats(
            page_bytes=page,
            mapped_slots=slots,
            distinct_pages=len(used),
            shared_pages=sum(1 for p in used if pool.is_shared(p)),
            resident_bytes=len(used) * page,
            live_bytes=sum(used.values()),
            cow_copies=table.cow_copies,
            tail_copies=table.tail_copies,
        )

    def check_invariants(self) -> None:
        """Check the invariants of the pool and of every page table of the store, this buffer's
        included, and that each page's refcount equals the entries holding it over all of them
        (the translation follows the table by construction; the state-machine tests check it
        through the memory)."""
        self._open()
        with self.store.lock:  # other threads' buffers of the store change under it
            check_pages(self.store.pool, self.store.holders())

    # ----------------------------------------------------------------------------- operations
    def grow(self, rows: Iterable[int], length: int) -> None:
        """Make each row hold at least ``length`` items (new items are uninitialized)."""
        self._check_capacity(length)
        with self._transaction() as table:
            self._create(table.grow_and_cow(self._expand(rows), length * self.item_bytes, length * self.item_bytes)[1])

    def prepare_write(self, rows: Iterable[int], start: int, end: int) -> None:
        """Get items ``[start, end)`` of each row ready to be written: grow the rows to ``end``
        and give them private copies of shared pages in the range (copy-on-write)."""
        self._check_capacity(end)
        if start < 0 or start > end:
            raise ArgumentError(f"invalid write range [{start}, {end}): need 0 <= start <= end")
        ib = self.item_bytes
        rows = list(rows)
        if end > start:
            table = self._open()
            with self.store.lock:  # append marks are shared by the store's tables (other threads')
                if table.extend_in_place(self._expand(rows), start * ib, end * ib):
                    return  # inside the rows' own last pages: no page made, copied or mapped
        with self._transaction() as table:  # a CoW copies the bytes written so far, not whole pages
            copies, created, nbytes = table.grow_and_cow(self._expand(rows), start * ib, end * ib)
            self._create(created)
            if copies:  # one call for every row (a gathered copy where the sizes agree)
                self.store.copy([(c.src, c.dst) for c in copies], nbytes)

    def share(self, src: int, dsts: Iterable[int], *, length: int | None = None) -> None:
        """Make each row of ``dsts`` hold the first ``length`` items of ``src`` (all by default)
        on the same pages: no bytes move. One page-table call for all their parts
        (:meth:`~hf_vkv.memory.page_table.PageTable.share_rows`)."""
        with self._transaction() as table:
            units = None if length is None else length * self.item_bytes
            parts = self.table_rows(src)
            table.share_rows([pair for d in dict.fromkeys(dsts) if d != src for pair in zip(parts, self.table_rows(d))],
                             length=units)

    def adopt(self, row: int, source: RowBuffer, source_row: int, *, length: int) -> None:
        """Make ``row`` hold the first ``length`` items of ``source``'s row ``source_row`` on the
        same pages (``source``: a buffer of the same store and item layout, e.g. a stored prefix's);
        no bytes move. ``row``'s previous pages are dropped.

        Taking all of a source row whose partly written last page nobody else holds marks that
        page (:attr:`~hf_vkv.memory.pool.PagePool.marks`): the first of the two to append writes
        it in place; the other copies it when it writes (a stored prefix never does)."""
        if source.store is not self.store or source.item_bytes != self.item_bytes or source.parts != self.parts:
            raise ArgumentError("adopt takes a row of a buffer of the same store, item size and parts")
        if not 0 <= length <= source.length(source_row):
            raise ArgumentError(f"row {source_row} holds {source.length(source_row)} items, not {length}")
        self._check_capacity(length)
        units, page = length * self.item_bytes, self.store.page_bytes
        pool = self.store.pool
        end = -(-units // page)
        with self._transaction() as table:
            marks = {}
            tables = []
            for a, b in zip(self.table_rows(row), source.table_rows(source_row)):
                held = source.table.row(b)
                if units and end <= held.start:
                    raise ArgumentError(f"row {source_row}'s first {length} items were dropped behind its window")
                if units == held.length and units % page and pool.refcount(held.pages[-1]) == 1:
                    marks[held.pages[-1]] = units % page  # the source alone holds its last page: it is all it holds
                tables.append((a, Row(units, held.start, held.pages[:end - held.start]) if units else EMPTY_ROW))
            table.assign_rows(tables)
            pool.set_marks(marks)

    def install(self, row: int, tables: Sequence[Row]) -> None:
        """Make ``row``'s parts hold ``tables`` (one :class:`Row` per part, in part order: pages in
        use in this store, e.g. a mapped file's, holding the same items in every part); no bytes
        move. ``row``'s previous pages are dropped. Raises ``ValueError`` (nothing changed) for a
        table of the wrong count, of uneven lengths, not whole items, or over the capacity."""
        parts = self.table_rows(row)
        if len(tables) != len(parts) or len({t.length for t in tables}) > 1:
            raise ArgumentError(f"row {row} has {len(parts)} parts: give one table each, all of one length")
        length = tables[0].length if tables else 0
        if length % self.item_bytes:
            raise ArgumentError(f"a table of {length} bytes does not hold whole items of {self.item_bytes}")
        self._check_capacity(length // self.item_bytes)
        with self._transaction() as table:
            table.assign_rows(zip(parts, tables))

    def reorder(self, index: Sequence[int], *, private_tails: bool = False, written: int | None = None) -> bool:
        """Row ``i`` takes row ``index[i]``'s pages (duplicates allowed); later rows are emptied.

        Only the rows whose table changes are touched, and only past the common prefix of their
        old and new tables (:meth:`PageTable.reorder`). ``private_tails`` (beam search, where
        every row writes next): a row that takes another's partly written last page gets its
        own copy of it now, in the page it held there when nobody else holds that page, so the
        row's mapping stays and the next write needs no copy-on-write; pages past the written
        items (``written``, default each row's length: a static layout maps pages ahead of its
        writes) stay the row's own with nothing copied. Those copies are the transaction's last
        step, in one call (see :meth:`_transaction`).

        Returns whether any row's table changed. False: only bytes moved (or nothing), so every
        row holds the pages, lengths and mappings it held, each page as shared as before."""
        if len(index) > self.rows:
            raise ArgumentError(f"index has {len(index)} entries but the buffer has {self.rows} rows")
        parts, n = self._parts, self.rows
        moves: list[int | None] = [None] * (n * self.parts)
        for i, src in enumerate(index):
            src = int(src)
            if not 0 <= src < n:
                raise CacheIndexError(f"row {src} is out of range for {n} rows (0..{n - 1})")
            for a, b in zip(parts[i], parts[src]):
                moves[a] = b
        units = None if written is None else written * self.item_bytes
        with self._transaction() as table:
            self._late_copies = table.reorder(moves, private_tails=private_tails, remaps_cost=self.remaps_cost,
                                              gathered=self.store.gathered_copies, written=units,
                                              groups=self._parts if self.parts > 1 else None)
            self._late_written = units
            moved = bool(table.changed_rows())
        return moved

    def truncate(self, rows: Iterable[int], length: int) -> None:
        """Shrink each row to ``length`` items (rows already shorter are left alone)."""
        with self._transaction() as table:
            for t in self._expand(rows):
                table.truncate(t, min(length * self.item_bytes, table.row(t).length))

    def drop_before(self, rows: Iterable[int], item: int) -> None:
        """Drop the pages of each row that lie wholly before ``item``."""
        with self._transaction() as table:
            for t in self._expand(rows):
                table.drop_before(t, min(item * self.item_bytes, table.row(t).length))

    def clear(self, rows: Iterable[int]) -> None:
        """Empty the rows, returning their pages."""
        with self._transaction() as table:
            table.clear_rows(self._expand(rows))

    def fork(self: _Self, *, rows: int | None = None) -> _Self:
        """A new buffer of the same store whose rows share this buffer's pages (zero copy).

        ``rows`` (default: the same) sizes the new buffer; rows past it must be empty."""
        table = self._open()
        rows = self.rows if rows is None else rows
        extra = [r for r in range(rows, self.rows) if self.length(r)]
        if extra:
            raise ArgumentError(f"cannot fork into {rows} rows: rows {extra[:4]} hold items")
        other = self._sibling(rows)
        try:
            with other._transaction() as new:
                new.assign_rows((a, table.row(b)) for r in range(min(rows, self.rows))
                                for a, b in zip(other.table_rows(r), self.table_rows(r)))
        except BaseException:
            other.close()  # now, not when a traceback that holds it goes: it counts as an open buffer
            raise
        return other

    def close(self) -> None:
        """Return every page. Views taken earlier must not be used again."""
        if not self._closed:
            self._closed = True
            self._finalizer()

    # ----------------------------------------------------------------------------- for subclasses
    @abstractmethod
    def _sibling(self: _Self, rows: int) -> _Self:
        """An empty buffer like this one with ``rows`` rows, on the same store."""

    @abstractmethod
    def _sync(self, changed: dict[int, Row]) -> None:
        """Make the translation of the ``changed`` rows (old states given) follow the table; undo
        all of it before raising on failure."""

    def _expand(self, rows: Iterable[int]) -> list[int]:
        """The table rows of ``rows``' parts, in order (each row's, built once at construction)."""
        parts, n, out = self._parts, self.rows, []
        for r in rows:
            if not 0 <= r < n:
                raise CacheIndexError(f"row {r} is out of range for {n} rows (0..{n - 1})")
            out += parts[r]
        return out

    def _open(self) -> PageTable:
        if self._closed:
            raise CacheClosedError(_CLOSED)
        self.store.made_in.check("this cache")  # not in a child forked after it was made (the parent's pages)
        return self._table

    def _check_capacity(self, length: int) -> None:
        if length > self.capacity:
            raise CapacityError(
                f"{length} items do not fit: rows were reserved for {self.capacity}; create the cache "
                f"with a larger capacity (cache_config['max_tokens'], or max_cache_len / max_new_tokens)"
            )

    def _create(self, pages: list[PageId]) -> None:
        if pages:
            self.store.create(pages)
            self._created.extend(pages)

    @contextmanager
    def _transaction(self) -> Iterator[PageTable]:
        """Run the body's page-table changes, then create, map and copy: all of it or nothing,
        under the store's lock (buffers of one store may live in several threads: shared prefixes).

        Copies the body leaves in ``_late_copies`` (a reorder's tails, written into pages the
        rows held before and keep) run last, after the translation followed the table: they
        overwrite bytes a rollback could not restore, so nothing may fail after them. A store's
        copy writes all of its pages or none (the host reads every source first), so if it fails
        the table and pool roll back and the translation is made to follow them again."""
        with self.store.lock:
            with self._locked_transaction() as table:
                yield table

    @contextmanager
    def _locked_transaction(self) -> Iterator[PageTable]:
        table = self._open()
        pool = self.store.pool
        pool.begin()
        table.begin()
        self._created = []
        self._late_copies, self._late_written = [], None
        try:
            yield table
            changed = table.changed_rows()
            self._sync(changed)
            if self._late_copies:
                self._copy_late(table, changed)
        except BaseException:
            table.rollback()
            pool.rollback()
            if self._created:
                _give_back(self.store, self._created)
            raise
        else:
            table.commit()
            pool.commit()
        finally:
            self._created = []
            self._late_copies = []

    def _copy_late(self, table: PageTable, changed: dict[int, Row]) -> None:
        """Run ``_late_copies`` (their written bytes, in one call); if that fails, roll the table
        and pool back and re-sync the translation of the ``changed`` rows before raising."""
        copies, page, entries, written = self._late_copies, self.store.page_bytes, table.entries, self._late_written
        nbytes = []  # each copy's bytes: its row's written bytes in its page
        for copy in copies:
            end = entries[copy.row].length
            if written is not None and written < end:
                end = written
            nbytes.append(min(page, end - copy.index * page))
        try:
            self.store.copy([(copy.src, copy.dst) for copy in copies], nbytes)
        except BaseException:
            now = {r: entries[r] for r in changed}
            table.rollback()
            self.store.pool.rollback()
            self._sync(now)  # the mappings follow the restored table again
            raise


def _give_back(store: PageStore, pages: list[PageId]) -> None:
    """A rollback's release of the pages it created: one at a time, and a page that cannot be
    released stays resident free in the pool (so it is recycled, not created twice). Never
    raises: the error being rolled back is the one to report, and the rollback must not stop
    half way."""
    kept = []
    for page in pages:
        try:
            store.release([page])
        except Exception:  # noqa: BLE001
            kept.append(page)
    if kept:
        store.pool.keep_resident(kept)


@register_critical
def return_pages(table: PageTable, store: PageStore, untranslate: Callable[[], None] | None = None) -> None:
    """A buffer's end (its ``_finalizer``): undo its translation (``untranslate``), return every
    page of ``table`` to the pool, and close the table in ``store``. Pages go back even if
    ``untranslate`` failed (a closed buffer is never read again); nothing is returned to a store
    already closed (its memory is gone)."""
    with store.lock:
        try:
            if not store.closed:
                try:
                    if untranslate is not None:
                        untranslate()
                finally:
                    table.clear_rows(range(table.rows))
        finally:
            store.buffer_closed(table)
